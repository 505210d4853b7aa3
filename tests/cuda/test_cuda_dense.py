"""The bf16 projections on every engine (gemv_bf16.cu's batch-M GEMV to 8 rows, mma_bf16.cu's warp-streaming GEMM,
cuBLAS) and the dispatch between them, against their NumPy twins
(NumpyBackend.linear, gate_up_act) on fresh random inputs: outputs poisoned before each run, every element checked,
values within bf16 rounding (relative L2 < 1e-2)."""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.checkpoint.weights import DenseWeights

from _cuda import H, assert_written, backend, dev, host, poisoned, requires_cuda, unwritten
from helpers import BF16, assert_close, rand_bf16

pytestmark = [pytest.mark.cuda, requires_cuda]

NP = NumpyBackend()


# ---- dense: GEMV (1..8 rows), warp-streaming GEMM (5..16), cuBLAS (9+) --------------------------------
@pytest.mark.parametrize("t", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 20, 33, 64, 65, 300])
@pytest.mark.parametrize("n,k", [(200, 256), (64, 4096)])
def test_linear(rng, t, n, k, small_weight_engine):
    x, w = rand_bf16(rng, (t, k)), rand_bf16(rng, (n, k), k ** -0.5)
    ref = np.empty((t, n), BF16)
    NP.linear(x, w, ref)
    out = poisoned((t, n), BF16)
    backend().linear(dev(x), dev(w), out)
    got = host(out)
    assert_written(got, "linear")
    assert_close(got, ref, f"linear t={t}")


@pytest.mark.parametrize("t", [9, 20, 64, 300])
@pytest.mark.parametrize("size", [1, 2], ids=["shared-expert-weight", "dense-ffn-weight"])
def test_linear_wide_rows_on_cublas_on_stream(rng, t, size):
    """A projection of 9+ rows goes to cuBLAS whatever its weight's size (the shared expert's, the dense FFN's),
    and cuBLAS runs on the backend's stream even when CuPy's shared handle was last bound to another (the legacy
    default stream does not order against a non-blocking stream)."""
    import cupy
    from glm_ep.backend.cuda import dense

    be = backend()
    n, k = size * dense.SMALL_WEIGHT_MAX // 4096, 4096
    x, w = rand_bf16(rng, (t, k)), rand_bf16(rng, (n, k), k ** -0.5)
    assert not dense.wstream_takes(x, w, glu=False)
    cb, handle = dense._cublas(), cupy.cuda.device.get_cublas_handle()
    cb.setStream(handle, 0)
    ref = np.empty((t, n), BF16)
    NP.linear(x, w, ref)
    out = poisoned((t, n), BF16)
    be.linear(dev(x), dev(w), out)
    assert cb.getStream(handle) == be.stream.ptr, "cuBLAS was left on another stream"
    got = host(out)
    assert_written(got, "linear")
    assert_close(got, ref, f"linear (cuBLAS) t={t}")


def _wstream_scratch(blocks: int = 0):
    """The warp-streaming GEMM's split-K scratch for the launches the backend makes and for ``blocks`` blocks
    (a fixed split may pass what the device holds at once): poisoned partial sums, zeroed counters."""
    import cupy
    from glm_ep.backend.cuda import dense

    n_partials, n_arrived = dense.wstream_scratch_sizes()
    n_partials = max(n_partials, blocks * 2 * 4 * dense.WSTREAM_WARPS * 32)
    return (poisoned((n_partials,), np.float32),
            backend().zero(cupy.empty(max(n_arrived, blocks), dtype=np.uint32)))


# K splits: the launch's own choice (which depends on the device's SM count), and fixed ones so every device
# runs one slice, an odd count and more slices than K = 1056 has stages (empty slices). K = 2080 (65 steps)
# ends in a one-step stage; N = 600 ends in a part row block.
@pytest.mark.parametrize("t", [1, 5, 8, 9, 16])
@pytest.mark.parametrize("k,ksplit", [(4096, None), (4096, 1), (4096, 3), (2080, None), (2080, 2), (1056, 8)])
def test_wstream_gemm(rng, t, k, ksplit):
    """The warp-streaming GEMM against NumPy, every output written, the split-K counters back at zero, and
    a second launch bit for bit the first (the slices are added in slice order, whichever block comes last)."""
    from glm_ep.backend.cuda import dense

    n = 600
    x, w = rand_bf16(rng, (t, k)), rand_bf16(rng, (n, k), k ** -0.5)
    ref = np.empty((t, n), BF16)
    NP.linear(x, w, ref)
    grid, ks = dense.wstream_geometry(n, k, False, ksplit)
    partials, arrived = _wstream_scratch(grid)
    d_x, d_w, out, again = dev(x), dev(w), poisoned((t, n), BF16), poisoned((t, n), BF16)
    with backend().stream:
        dense.wstream_gemm_bf16(d_x, d_w, out, partials, arrived, ksplit)
        dense.wstream_gemm_bf16(d_x, d_w, again, partials, arrived, ksplit)
    got = host(out)
    assert_written(got, "wstream_gemm")
    assert_close(got, ref, f"wstream_gemm t={t} k={k} (K slices {ks})")
    np.testing.assert_array_equal(host(again).view(np.uint16), got.view(np.uint16), err_msg="a second launch")
    assert not host(arrived).any(), "split-K counters left nonzero"


# i = 203: the last warp's gate / up rows run past N
@pytest.mark.parametrize("t", [5, 9, 16])
@pytest.mark.parametrize("i,k,ksplit", [(200, 4096, None), (203, 4096, 1), (203, 2080, 3)])
def test_wstream_glu(rng, t, i, k, ksplit):
    from glm_ep.backend.cuda import dense

    x = rand_bf16(rng, (t, k))
    w = DenseWeights(rand_bf16(rng, (i, k), 2 * k ** -0.5), rand_bf16(rng, (i, k), 2 * k ** -0.5),
                     rand_bf16(rng, (k, i), i ** -0.5))
    refs = [np.empty((t, i), BF16) for _ in range(3)]
    NP.gate_up_act(x, w, 1.5, *refs)
    grid, ks = dense.wstream_geometry(i, k, True, ksplit)
    partials, arrived = _wstream_scratch(grid)
    outs = [poisoned((t, i), BF16) for _ in range(3)]
    with backend().stream:
        dense.wstream_glu_bf16(dev(x), dev(w.gate), dev(w.up), 1.5, *outs, partials, arrived, ksplit)
    for name, o, r in zip(("gate", "up", "act"), outs, refs):
        got = host(o)
        assert_written(got, name)
        assert_close(got, r, f"wstream_glu {name} t={t} i={i} k={k} (K slices {ks})")
    assert not host(arrived).any(), "split-K counters left nonzero"


def test_dense_ffn_rows_in_graph(rng):
    """A dense FFN of GLM's width at 6 rows (the warp-streaming GEMM, K split on the down projection) captured
    as a graph and replayed with fresh inputs: gate, up, act and down match NumPy every time."""
    from glm_ep.backend.cuda import dense

    be = backend()
    h = i = 4096  # I x H past dense.SMALL_WEIGHT_MAX
    w = DenseWeights(rand_bf16(rng, (i, h), 2 * h ** -0.5), rand_bf16(rng, (i, h), 2 * h ** -0.5),
                     rand_bf16(rng, (h, i), i ** -0.5))
    resident, t = be.upload_dense(w), 6
    assert dense.wstream_takes(np.empty((t, h), BF16), w.gate, glu=True)
    assert dense.wstream_takes(np.empty((t, i), BF16), w.down, glu=False)
    d_x = dev(rand_bf16(rng, (t, h)))
    outs = [poisoned((t, i), BF16) for _ in range(3)] + [poisoned((t, h), BF16)]

    def step():
        be.gate_up_act(d_x, resident, 1.5, *outs[:3])
        be.linear(outs[2], resident.down, outs[3])

    replay = be.capture(step)
    for n in range(2):
        x = rand_bf16(rng, (t, h))
        be.from_host(d_x, x)
        replay()
        refs = [np.empty((t, i), BF16) for _ in range(3)] + [np.empty((t, h), BF16)]
        NP.gate_up_act(x, w, 1.5, *refs[:3])
        NP.linear(refs[2], w.down, refs[3])
        for name, o, r in zip(("gate", "up", "act", "down"), outs, refs):
            got = host(o)
            assert_written(got, name)
            assert_close(got, r, f"replay {n}: {name}")


@pytest.mark.parametrize("order", ["up-after-gate", "up-before-gate"])
def test_gemm_bf16_pair(monkeypatch, rng, order):
    """gate and up in one strided-batched cuBLAS call where up's weights and output lie past gate's (stacked
    weights, the workspace's adjacent a_gate / a_up; here with a gap between the outputs), in two calls where they
    do not: both equal NumPy's within bf16 rounding, poisoned outputs written, the gap untouched."""
    from glm_ep.backend.cuda import dense

    t, n, k, gap = 300, 200, 256, 64
    x, w = rand_bf16(rng, (t, k)), rand_bf16(rng, (2, n, k), k ** -0.5)
    d_w, buf = dev(w), poisoned((2 * t * n + gap,), BF16)
    halves = [(d_w[0], buf[:t * n].reshape(t, n), w[0]), (d_w[1], buf[t * n + gap:].reshape(t, n), w[1])]
    if order == "up-before-gate":
        halves.reverse()
    (w0, o0, h0), (w1, o1, h1) = halves
    real, calls = dense._cublas(), []

    class Spy:  # the cuBLAS module, counting its GEMM entry points
        def __getattr__(self, name):
            fn = getattr(real, name)
            if name.startswith("gemm"):
                return lambda *a: (calls.append(name), fn(*a))[1]
            return fn

    monkeypatch.setattr(dense, "_cublas", lambda: Spy())
    with backend().stream:
        dense.gemm_bf16_pair(dev(x), w0, w1, o0, o1)
    assert calls == (["gemmStridedBatchedEx"] if order == "up-after-gate" else ["gemmEx", "gemmEx"]), calls
    got = host(buf)
    assert unwritten(got[t * n:t * n + gap]).all(), "written between the outputs"
    for name, o, hw in (("gate", o0, h0), ("up", o1, h1)):
        ref = np.empty((t, n), BF16)
        NP.linear(x, hw, ref)
        assert_written(host(o), name)
        assert_close(host(o), ref, f"{name} ({order})")


def test_upload_dense_stacks_gate_and_up():
    """gate and up resident as the halves of one allocation (what lets the wide path batch them)."""
    w = DenseWeights(*(np.full(s, v, BF16) for s, v in (((64, 128), 1.0), ((64, 128), 2.0), ((128, 64), 3.0))))
    r = backend().upload_dense(w)
    assert r.up.data.ptr == r.gate.data.ptr + r.gate.nbytes and r.gate.shape == r.up.shape == (64, 128)
    for name, a, v in (("gate", r.gate, 1.0), ("up", r.up, 2.0), ("down", r.down, 3.0)):
        assert (host(a).astype(np.float32) == v).all(), name


@pytest.mark.parametrize("t", [1, 2, 5, 8, 9, 20, 64, 65, 300])
def test_gate_up_act(rng, t, small_weight_engine):
    i = 200
    w = DenseWeights(rand_bf16(rng, (i, H), 2 * H ** -0.5), rand_bf16(rng, (i, H), 2 * H ** -0.5),
                     rand_bf16(rng, (H, i), i ** -0.5))
    x = rand_bf16(rng, (t, H))
    refs = [np.empty((t, i), BF16) for _ in range(3)]
    NP.gate_up_act(x, w, 1.5, *refs)
    outs = [poisoned((t, i), BF16) for _ in range(3)]
    backend().gate_up_act(dev(x), backend().upload_dense(w), 1.5, *outs)
    for name, o, r in zip(("gate", "up", "act"), outs, refs):
        got = host(o)
        assert_written(got, name)
        assert_close(got, r, f"gate_up_act {name} t={t}")

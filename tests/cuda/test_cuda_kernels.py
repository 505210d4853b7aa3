"""Every CUDA kernel against its NumPy twin on fresh random inputs.

Outputs are poisoned before each run and every element a kernel must write is checked; ids, union
tables and the expert sort must match exactly, values within bf16 rounding (relative L2 < 1e-2;
elementwise ops at most 1 bf16 ulp). Shapes: H=256, moe_inter=128, E=32, top_k=8, plus the
GLM-5.3-Flash shape (H=4096, moe_inter=2048) for the decode GEMV.
"""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.checkpoint import nvfp4
from glm_ep.mlp import routing
from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.errors import ConfigError
from glm_ep.checkpoint.weights import DenseWeights

from _cuda import (E, H, M, TOP_K, assert_written, backend, bind_scratch, both, check_moe_gate_up_act, check_moe_gemv,
                   dev, host, moe_weights, poisoned, requires_cuda, spy_launches, unwritten)
from helpers import BF16, assert_close, assert_ulps, rand_bf16, tiny_model

pytestmark = [pytest.mark.cuda, requires_cuda]

NP = NumpyBackend()


# ---- elementwise ------------------------------------------------------------------------------
def test_swiglu(rng):
    gate, up = rand_bf16(rng, (8, 1000), 4.0), rand_bf16(rng, (8, 1000), 4.0)
    specials = np.array([np.nan, np.inf, -np.inf, 3.0, -3.0, 2.9921875, 0.0, -0.0], dtype=np.float32)
    gate[0, :8], up[1, :8] = specials.astype(BF16), specials.astype(BF16)
    ref = np.empty_like(gate)
    NP.swiglu(gate, up, 3.0, ref)
    out = poisoned(gate.shape, BF16)
    backend().swiglu(dev(gate), dev(up), 3.0, out)
    got = host(out)
    assert_ulps(got, ref, "swiglu")


def test_add(rng):
    a, b = rand_bf16(rng, (3, 777)), rand_bf16(rng, (3, 777), 1e-2)
    ref = np.empty_like(a)
    NP.add(a, b, ref)
    out = poisoned(a.shape, BF16)
    backend().add(dev(a), dev(b), out)
    assert_ulps(host(out), ref, "add", ulps=0)


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("with_shared", [True, False])
@pytest.mark.parametrize("indexed", [False, True])
def test_combine(rng, t, with_shared, indexed):
    routed = rand_bf16(rng, (t * TOP_K, H))
    wts = rng.random((t, TOP_K)).astype(np.float32) * 2.5
    shared = rand_bf16(rng, (t, H)) if with_shared else None
    perm = rng.permutation(t * TOP_K).astype(np.int32).reshape(t, TOP_K) if indexed else None
    ref = np.empty((t, H), BF16)
    NP.combine(routed, wts, shared, ref, perm)
    out = poisoned((t, H), BF16)
    backend().combine(dev(routed), dev(wts), None if shared is None else dev(shared), out,
                      None if perm is None else dev(perm))
    got = host(out)
    assert_written(got, "combine")
    assert_ulps(got, ref, "combine")


@pytest.mark.parametrize("t", [1, 3, 8, 12])
@pytest.mark.parametrize("i", [128, 2048])
def test_shared_down_combine(rng, t, i):
    """The shared expert's down projection ending in the combine: one launch for 1..8 rows, bit for
    bit the separate ``linear`` + ``combine`` of the same backend, and within an ulp of NumPy."""
    act, down = rand_bf16(rng, (t, i)), rand_bf16(rng, (H, i), i ** -0.5)
    routed = rand_bf16(rng, (t * TOP_K, H))
    wts = rng.random((t, TOP_K)).astype(np.float32) * 2.5
    be, d_act, d_down, d_routed, d_wts = backend(), dev(act), dev(down), dev(routed), dev(wts)
    out, scratch = poisoned((t, H), BF16), poisoned((t, H), BF16)
    be.shared_down_combine(d_act, d_down, d_routed, d_wts, scratch, out)
    sep_shared, sep = poisoned((t, H), BF16), poisoned((t, H), BF16)
    be.linear(d_act, d_down, sep_shared)
    be.combine(d_routed, d_wts, sep_shared, sep)
    got = host(out)
    assert_written(got, "shared down + combine")
    np.testing.assert_array_equal(got.view(np.uint16), host(sep).view(np.uint16))
    ref, ref_shared = np.empty((t, H), BF16), np.empty((t, H), BF16)
    NP.shared_down_combine(act, down, routed, wts, ref_shared, ref)
    assert_close(got, ref, "shared down + combine")


# ---- dense: GEMV (1..8 rows), tensor-core GEMM (9..64), cuBLAS --------------------------------------
@pytest.mark.parametrize("t", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 20, 33, 64, 65, 300])
@pytest.mark.parametrize("n,k", [(200, 256), (64, 4096)])
def test_linear(rng, t, n, k):
    x, w = rand_bf16(rng, (t, k)), rand_bf16(rng, (n, k), k ** -0.5)
    ref = np.empty((t, n), BF16)
    NP.linear(x, w, ref)
    out = poisoned((t, n), BF16)
    backend().linear(dev(x), dev(w), out)
    got = host(out)
    assert_written(got, "linear")
    assert_close(got, ref, f"linear t={t}")


@pytest.mark.parametrize("t", [9, 16, 33, 64])
@pytest.mark.parametrize("out_dtype", [BF16, np.float32], ids=["bf16", "f32"])
def test_mma_gemm(rng, t, out_dtype):
    """The 9..64-row tensor-core GEMM itself (the router's fp32 logits; bf16 out for tools/dense_tiers.py, which
    times it against cuBLAS), each tier, against NumPy; every output written."""
    from glm_ep.backend.cuda import dense

    n, k = 288, 4096
    x, w = rand_bf16(rng, (t, k)), rand_bf16(rng, (n, k), k ** -0.5)
    ref = np.empty((t, n), BF16)
    NP.linear(x, w, ref)
    out = poisoned((t, n), out_dtype)
    with backend().stream:
        dense.mma_gemm_bf16(dev(x), dev(w), out)
    got = host(out)
    assert np.isfinite(got.astype(np.float32)).all(), "outputs left unwritten"
    assert_close(got.astype(BF16), ref, f"mma_gemm t={t}")


@pytest.mark.parametrize("t", [20, 300])
def test_linear_large_weight_on_stream(rng, t):
    """A weight past the tensor-core GEMM's size goes to cuBLAS at every width, and cuBLAS runs on
    the backend's stream even when CuPy's shared handle was last bound to another (the legacy
    default stream does not order against a non-blocking stream)."""
    import cupy
    from glm_ep.backend.cuda import dense

    be = backend()
    n, k = 2 * dense.MMA_GEMM_MAX_WEIGHT // 4096, 4096
    x, w = rand_bf16(rng, (t, k)), rand_bf16(rng, (n, k), k ** -0.5)
    assert not dense.mma_gemm_takes(x, w)
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
    h = i = 4096  # I x H past dense.MMA_GEMM_MAX_WEIGHT
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
def test_gate_up_act(rng, t):
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


# ---- routed experts ------------------------------------------------------------------------------
@pytest.mark.parametrize("proj,per_slot", [("gate", False), ("down", True)])
def test_moe_gemv_decode(rng, proj, per_slot):
    start, count = 8, 16  # ids outside [8, 24) belong to another rank
    cu, nu = both(moe_weights(rng, start=start, count=count))
    ids = np.array([8, 30, 23, 0, 12, 17, 5, 9], dtype=np.int32)
    local = (ids >= start) & (ids < start + count)
    check_moe_gemv(rng, cu, nu, proj, per_slot, ids, local, f"moe_gemv {proj}")


def test_moe_gate_up_act_decode(rng):
    cu, nu = both(moe_weights(rng, start=0, count=24))
    ids = rng.permutation(E)[:TOP_K].astype(np.int32)
    check_moe_gate_up_act(rng, cu, nu, ids, ids < 24, H, M, "moe_gate_up_act")


def test_moe_decode_glm_shape(rng):
    """The decode GEMV at GLM-5.3-Flash's shape: hidden 4096, moe_inter 2048 (two local experts
    and one remote, three slots)."""
    h, m, k = 4096, 2048, 3
    cu, nu = both(moe_weights(rng, h=h, m=m, start=0, count=2, num_experts=3))
    ids = np.array([1, 2, 0], dtype=np.int32)  # expert 2 is remote
    x = rand_bf16(rng, (1, h))
    refs = [np.zeros((k, m), BF16) for _ in range(3)]
    NP.moe_gate_up_act(x, nu, ids, 10.0, *refs)
    outs = [poisoned((k, m), BF16) for _ in range(3)]
    backend().moe_gate_up_act(dev(x), cu, dev(ids), 10.0, *outs)
    act = host(outs[2])
    for name, o, r in zip(("gate", "up", "act"), outs, refs):
        got = host(o)
        if name != "act":
            assert unwritten(got[1]).all()
        assert_close(got[[0, 2]], r[[0, 2]], f"glm-shape {name}")
    ref_down = np.zeros((k, h), BF16)
    NP.moe_gemv(act, nu.down, ids, ref_down, True)
    down = poisoned((k, h), BF16)
    backend().moe_gemv(dev(act), cu.down, dev(ids), down, True)
    got = host(down)
    assert unwritten(got[1]).all()
    assert_close(got[[0, 2]], ref_down[[0, 2]], "glm-shape down")


@pytest.mark.parametrize("t,e,sms", [(1, E, None), (37, E, None), (700, E, None), (1023, E, None), (1024, E, None),
                                     (1025, E, None), (4096, E, None), (37, 33, None), (700, 1500, None),
                                     (1100, 1500, None), (4097, 257, None), (4096, E, 3), (1100, 1500, 5)])
def test_sort_by_expert(rng, t, e, sms, monkeypatch):
    """Stable and exact at every width, in both forms: one block (one warp's segment of slots, several, ragged
    ends), and the multi-block sort the backend runs from SORT_MULTI_MIN_SLOTS slots in ceil(S / B) slot chunks
    (B = one block per SORT_CHUNK slots, at most one an SM: 8 chunks of 1024 at 1024 rows, 9 of 912 and a last
    of 904 at 1025, 33 at 4097; ``sms`` caps B lower, so chunks pass SORT_CHUNK: 3 of 10923 / 10923 / 10922
    slots); expert counts that are not a multiple of 32 or span two 1024-wide scan chunks (then a row may name
    an expert twice). Every output poisoned first."""
    from glm_ep.backend.cuda import cuda_backend
    from glm_ep.backend.cuda import route_kernels as route
    from glm_ep.backend.cuda.kernel_loader import block_smem_limit

    if route.sort_smem(e) + route.SORT_STATIC_SMEM > block_smem_limit():  # 1500 experts on a GB10 (99 KB a block)
        with pytest.raises(ConfigError, match="the sort by expert of wide calls needs"):
            route.check_sort_fits(e, block_smem_limit(), "this device")
        return
    if sms is not None:
        for module in (route, cuda_backend):
            monkeypatch.setattr(module, "sm_count", lambda: sms)
    if e == E:
        ids = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(t)]).astype(np.int32)
    else:
        ids = rng.integers(0, e, (t, TOP_K), dtype=np.int32)
    ids[: t // 2, 0] = 5  # one expert far more popular than the rest
    ref = routing.sort_by_expert(ids, e)
    s = t * TOP_K
    bind_scratch(backend(), experts=e)  # (a stack's workspace does this for its router's experts)
    names = ("sorted_token_ids", "sorted_expert_ids", "expert_offsets", "token_to_perm")
    launched = spy_launches(monkeypatch, route)
    for form in ("backend", "one block"):
        bufs = [poisoned((s,), np.int32), poisoned((s,), np.int32), poisoned((e + 1,), np.int32),
                poisoned((t, TOP_K), np.int32)]
        launched.clear()
        if form == "backend":
            backend().sort_by_expert(dev(ids), e, *bufs)
            blocks = route.sort_blocks(s, route.sm_count())
            assert launched == (["moe_sort_count", "moe_sort_place"] if blocks > 1 else ["moe_sort_by_expert"])
            assert (blocks > 1) == (s >= route.SORT_MULTI_MIN_SLOTS)
        else:
            with backend().stream:
                route.sort_by_expert(dev(ids), e, *bufs)
            assert launched == ["moe_sort_by_expert"]
        for got, want, name in zip(bufs, (ref.sorted_token_ids, ref.sorted_expert_ids, ref.expert_offsets,
                                          ref.token_to_perm), names):
            np.testing.assert_array_equal(host(got), want, err_msg=f"{form}: {name}")


def test_the_workspace_makes_the_sort_scratch():
    """A stack's workspace makes the multi-block sort's count scratch for its router's experts and hands it to the
    backend, so a wide call never allocates."""
    from glm_ep.backend.cuda import CudaBackend
    from glm_ep.backend.cuda import route_kernels as route
    from glm_ep.config.model import RankLayout, SiteConfig
    from glm_ep.config.topology import PathLevers
    from glm_ep.mlp.site import site_buffers
    from glm_ep.mlp.workspace import workspace_pool

    be = CudaBackend(0, stream=backend().stream)
    cfg = SiteConfig.for_rank(tiny_model(n_routed_experts=E), RankLayout(1, 0, 1, 1))
    pool = workspace_pool(be, (*site_buffers(cfg), *be.buffers(cfg, PathLevers())), 512, 2, False)
    assert be._sort_counts is not None and be._sort_counts.size >= route.sm_count() * E
    assert all(np.shares_memory(ws.view("sort_counts", E), be._sort_counts) for ws in pool)


def test_moe_gemm_sorted(rng):
    t, start, count = 13, 16, 16
    cu, nu = both(moe_weights(rng, start=start, count=count))
    ids = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(t)]).astype(np.int32)
    srt = routing.sort_by_expert(ids, E)
    local = (srt.sorted_expert_ids >= start) & (srt.sorted_expert_ids < start + count)
    tok, offsets = dev(srt.sorted_token_ids), dev(srt.expert_offsets)
    for proj, gather, a in (("gate", True, rand_bf16(rng, (t, H))), ("down", False, rand_bf16(rng, (t * TOP_K, M)))):
        n = getattr(nu, proj).weights[0].shape[0]
        ref = np.zeros((t * TOP_K, n), BF16)
        NP.moe_gemm_sorted(a, getattr(nu, proj), srt.sorted_token_ids, srt.expert_offsets, ref, gather)
        out = poisoned((t * TOP_K, n), BF16)
        backend().moe_gemm_sorted(dev(a), getattr(cu, proj), tok, offsets, out, gather)
        got = host(out)
        assert unwritten(got[~local]).all()
        assert_written(got[local], proj)
        assert_close(got[local], ref[local], f"sorted {proj}")


@pytest.mark.parametrize("n,k", [(40, 352), (24, 96), (2048, 4096)])
def test_nvfp4_gemv_shapes(rng, n, k):
    """Row and K tails: N not a multiple of a block's rows, K not a multiple of a 128-k step."""
    from glm_ep.backend.cuda import routed as kernels

    w_nk = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    w_nk[0, :16] = 0.0  # an all-zero block (scale 0)
    w_nk[1, :16] *= 1e-4  # a block whose E4M3 scale is subnormal
    w = nvfp4.quantize(w_nk)
    x = rand_bf16(rng, (1, k))
    ref = (x.astype(np.float32) @ nvfp4.dequantize(w).T).astype(BF16)
    out = poisoned((1, n), BF16)
    with backend().stream:
        kernels.nvfp4_gemv(dev(x), dev(w.packed), dev(w.scale.view(np.uint8)), w.scale_2, out)
    got = host(out)
    assert_written(got, "nvfp4_gemv")
    assert_close(got, ref, f"nvfp4_gemv {n}x{k}")


def test_expert_linear(rng):
    cu, nu = both(moe_weights(rng, start=4, count=3))
    for proj, kin, n in (("gate", H, M), ("down", M, H)):
        a = rand_bf16(rng, (1, kin))
        ref = np.empty((1, n), BF16)
        NP.expert_linear(a, getattr(nu, proj), 2, ref)
        out = poisoned((1, n), BF16)
        backend().expert_linear(dev(a), getattr(cu, proj), 2, out)
        got = host(out)
        assert_written(got, proj)
        assert_close(got, ref, f"expert_linear {proj}")

"""The elementwise kernels (elementwise.cu: clamped SwiGLU, residual add, the routed + shared combine) and the
shared expert's down projection fused with the combine (gemv_bf16.cu), against their NumPy twins
(NumpyBackend.swiglu, add, combine, shared_down_combine) on fresh random inputs: outputs poisoned before each run,
every element checked, at most 1 bf16 ulp off (the fused down + combine within bf16 rounding)."""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.backend.cuda import dense
from glm_ep.backend.numpy_backend import NumpyBackend

from _cuda import H, TOP_K, assert_written, backend, dev, host, poisoned, requires_cuda, spy_launches
from helpers import BF16, assert_close, assert_ulps, rand_bf16

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
@pytest.mark.parametrize("k", [TOP_K, 1, 13, 16])  # slots a row, to the 16 a router keeps at most
def test_combine(rng, t, with_shared, indexed, k):
    routed = rand_bf16(rng, (t * k, H))
    wts = rng.random((t, k)).astype(np.float32) * 2.5
    shared = rand_bf16(rng, (t, H)) if with_shared else None
    perm = rng.permutation(t * k).astype(np.int32).reshape(t, k) if indexed else None
    ref = np.empty((t, H), BF16)
    NP.combine(routed, wts, shared, ref, perm)
    out = poisoned((t, H), BF16)
    backend().combine(dev(routed), dev(wts), None if shared is None else dev(shared), out,
                      None if perm is None else dev(perm))
    got = host(out)
    assert_written(got, "combine")
    assert_ulps(got, ref, "combine")


@pytest.mark.parametrize("t", [1, 3, 4, 5, 8, 12])
@pytest.mark.parametrize("i", [128, 2048])
def test_shared_down_combine(rng, t, i, small_weight_engine):
    """The shared expert's down projection ending in the combine (one launch where the GEMV serves the rows, the
    warp-streaming GEMM then the combine where it takes them), bit for bit the separate ``linear`` + ``combine`` of
    the same backend, and within an ulp of NumPy."""
    _check_shared_down_combine(rng, t, i, TOP_K, small_weight_engine)


@pytest.mark.parametrize("t", [2, 4, 6])
@pytest.mark.parametrize("k", [1, 13, 16])
def test_shared_down_combine_slot_counts(rng, t, k):
    """The same at other slot counts a row than the model's: the GEMV's owner lanes hold a row's weighted slots
    (up to 16) from before its K loop; 6 rows take the warp-streaming GEMM and the combine kernel."""
    _check_shared_down_combine(rng, t, 2048, k, "shipped")


def test_shared_down_combine_refuses_more_slots_than_it_holds(rng):
    t, i, k = 2, 128, 17
    args = [dev(a) for a in (rand_bf16(rng, (t, i)), rand_bf16(rng, (H, i)), rand_bf16(rng, (t * k, H)),
                             np.ones((t, k), np.float32))]
    with pytest.raises(ValueError, match="gemv_combine_bf16: 17 slots a row, expected at most 16"):
        dense.gemv_combine_bf16(*args, poisoned((t, H), BF16))


def _check_shared_down_combine(rng, t, i, k, engine):
    act, down = rand_bf16(rng, (t, i)), rand_bf16(rng, (H, i), i ** -0.5)
    routed = rand_bf16(rng, (t * k, H))
    wts = rng.random((t, k)).astype(np.float32) * 2.5
    be, d_act, d_down, d_routed, d_wts = backend(), dev(act), dev(down), dev(routed), dev(wts)
    out, scratch = poisoned((t, H), BF16), poisoned((t, H), BF16)
    with pytest.MonkeyPatch.context() as mp:
        launched = spy_launches(mp, dense)  # the bf16 projections' kernels (cuBLAS past 8 rows: none)
        be.shared_down_combine(d_act, d_down, d_routed, d_wts, scratch, out)
    want = ("bf16_wstream_gemm_t8" if engine == "shipped" and 5 <= t <= 8
            else f"bf16_gemv_combine_r{t}" if t <= 8 else None)
    assert launched == ([want] if want else []), f"{t} rows ({engine}): launched {launched}"
    sep_shared, sep = poisoned((t, H), BF16), poisoned((t, H), BF16)
    be.linear(d_act, d_down, sep_shared)
    be.combine(d_routed, d_wts, sep_shared, sep)
    got = host(out)
    assert_written(got, "shared down + combine")
    np.testing.assert_array_equal(got.view(np.uint16), host(sep).view(np.uint16))
    ref, ref_shared = np.empty((t, H), BF16), np.empty((t, H), BF16)
    NP.shared_down_combine(act, down, routed, wts, ref_shared, ref)
    assert_close(got, ref, "shared down + combine")

"""Every CUDA kernel against its NumPy twin on fresh random inputs.

Outputs are poisoned before each run and every element a kernel must write is checked; ids, union
tables and the expert sort must match exactly, values within bf16 rounding (relative L2 < 1e-2;
elementwise ops at most 1 bf16 ulp). Shapes: H=256, moe_inter=128, E=32, top_k=8, plus the
GLM-5.3-Flash shape (H=4096, moe_inter=2048) for the decode GEMV.
"""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep import nvfp4, routing
from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.weights import DenseWeights

from _cuda import (E, H, M, TOP_K, assert_written, backend, both, dev, host, moe_weights, poisoned, requires_cuda,
                   unwritten)
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


@pytest.mark.parametrize("t", [1, 2, 5, 8, 9, 20, 64, 65])
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
def check_moe_gemv(rng, cu, nu, proj, per_slot, ids, local, label, be=None):
    """One decode moe_gemv against NumPy: local slots within bf16 rounding, remote rows untouched."""
    pc, pn = getattr(cu, proj), getattr(nu, proj)
    kin, n = pn.weights[0].shape[1], pn.weights[0].shape[0]
    x = rand_bf16(rng, (TOP_K if per_slot else 1, kin))
    ref = np.zeros((TOP_K, n), BF16)
    NP.moe_gemv(x, pn, ids, ref, per_slot)
    out = poisoned((TOP_K, n), BF16)
    (be or backend()).moe_gemv(dev(x), pc, dev(ids), out, per_slot)
    got = host(out)
    assert unwritten(got[~local]).all(), f"{label}: a remote slot's output was written"
    assert_written(got[local], label)
    assert_close(got[local], ref[local], label)


def check_moe_gate_up_act(rng, cu, nu, ids, local, h, m, label, be=None):
    """Decode gate + up + SwiGLU against NumPy; act rows of remote slots are unspecified."""
    x = rand_bf16(rng, (1, h), 3.0)
    refs = [np.zeros((TOP_K, m), BF16) for _ in range(3)]
    NP.moe_gate_up_act(x, nu, ids, 1.0, *refs)
    outs = [poisoned((TOP_K, m), BF16) for _ in range(3)]
    (be or backend()).moe_gate_up_act(dev(x), cu, dev(ids), 1.0, *outs)
    for name, o, r in zip(("gate", "up", "act"), outs, refs):
        got = host(o)
        if name != "act":
            assert unwritten(got[~local]).all(), f"{label} {name}: a remote slot was written"
        assert_written(got[local], name)
        assert_close(got[local], r[local], f"{label} {name}")


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


@pytest.mark.parametrize("t,e", [(1, E), (37, E), (700, E), (4096, E), (37, 33), (700, 1500), (4097, 257)])
def test_sort_by_expert(rng, t, e):
    """Stable and exact at every width: one warp's segment of slots, several, ragged ends; expert
    counts that are not a multiple of 32 or span two 1024-wide scan chunks (then a row may name an
    expert twice)."""
    if e == E:
        ids = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(t)]).astype(np.int32)
    else:
        ids = rng.integers(0, e, (t, TOP_K), dtype=np.int32)
    ids[: t // 2, 0] = 5  # one expert far more popular than the rest
    ref = routing.sort_by_expert(ids, e)
    s = t * TOP_K
    bufs = [poisoned((s,), np.int32), poisoned((s,), np.int32), poisoned((e + 1,), np.int32),
            poisoned((t, TOP_K), np.int32)]
    backend().sort_by_expert(dev(ids), e, *bufs)
    for got, want, name in zip(bufs, (ref.sorted_token_ids, ref.sorted_expert_ids, ref.expert_offsets,
                                      ref.token_to_perm),
                               ("sorted_token_ids", "sorted_expert_ids", "expert_offsets", "token_to_perm")):
        np.testing.assert_array_equal(host(got), want, err_msg=name)


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
    from glm_ep.backend.cuda import nvfp4 as kernels

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


# ---- the persistent decode ring (gemv_nvfp4_ring.cu) against gemv_nvfp4.cu's path and NumPy ----------
UNSCALED, SCALED, FP16, PLACED = ("bf16u", "bf16u"), ("bf16", "bf16"), ("f16", "f16"), ("placed", "placed")
DEFAULT = ("bf16u", "placed")  # (gate and up, down)


@pytest.mark.parametrize("ring,forms", [
    pytest.param(dict(enabled=False), SCALED, id="blocks"),  # gemv_nvfp4.cu's block-per-tile kernels
    pytest.param(dict(), DEFAULT, id="default"),  # gate and up unscaled bf16 (F = 2), down placed (F = 3)
    pytest.param(dict(depth=(4, 3), warps_per_sm=8), DEFAULT, id="t4d4-3-w8"),
    pytest.param(dict(depth=(2, 2), max_warps=3), DEFAULT, id="t4d2-w3"),  # several items per warp
    pytest.param(dict(depth=(4, 4), max_warps=5), DEFAULT, id="t4d4-w5"),  # a ring deeper than an item's slabs
    pytest.param(dict(slab=(8, 8), depth=(3, 2), max_warps=7), DEFAULT, id="t8d3-w7"),
    pytest.param(dict(slab=(8, 8), depth=(2, 2), warps_per_sm=16), DEFAULT, id="t8d2-w16"),
    pytest.param(dict(unscaled=False), SCALED, id="bf16"),  # the scaled bf16 form (consume_slab)
    pytest.param(dict(unscaled=False, depth=(2, 2), max_warps=3), SCALED, id="bf16-t4d2-w3"),
    pytest.param(dict(unscaled=False, depth=(4, 3), warps_per_sm=8), SCALED, id="bf16-t4d4-3-w8"),
    pytest.param(dict(unscaled=False, depth=(4, 4), max_warps=5), SCALED, id="bf16-t4d4-w5"),
    pytest.param(dict(unscaled=False, slab=(8, 8), depth=(3, 2), max_warps=7), SCALED, id="bf16-t8d3-w7"),
    pytest.param(dict(f16=True), ("bf16u", "f16"), id="f16-down"),  # the fp16 form on the down projection
    pytest.param(dict(f16=True, unscaled=False), ("bf16", "f16"), id="f16-down-bf16"),
    pytest.param(dict(f16=True, f16_hidden=True), FP16, id="f16"),  # consume_slab_unscaled, F = 1, everywhere
    pytest.param(dict(f16=True, f16_hidden=True, depth=(2, 2), max_warps=3), FP16, id="f16-t4d2-w3"),
    pytest.param(dict(f16=True, f16_hidden=True, depth=(4, 3), warps_per_sm=8), FP16, id="f16-t4d4-3-w8"),
    pytest.param(dict(f16=True, f16_hidden=True, slab=(8, 8), depth=(3, 2), max_warps=7), FP16, id="f16-t8d3-w7"),
    pytest.param(dict(placed=False), UNSCALED, id="bf16u"),  # the unscaled bf16 form everywhere (F = 2)
    pytest.param(dict(placed=False, depth=(2, 2), max_warps=3), UNSCALED, id="bf16u-t4d2-w3"),
    pytest.param(dict(placed_hidden=True), PLACED, id="placed"),  # consume_slab_unscaled, F = 3, everywhere
    pytest.param(dict(placed_hidden=True, depth=(2, 2), max_warps=3), PLACED, id="placed-t4d2-w3"),
    pytest.param(dict(placed_hidden=True, slab=(8, 8), depth=(3, 2), max_warps=7), PLACED, id="placed-t8d3-w7"),
    pytest.param(dict(placed_hidden=True, f16=True), ("placed", "f16"), id="placed-f16-down"),
])
def test_moe_decode_ring(rng, ring, forms):
    """A backend built with each ring config, on the shared backend's stream (the helpers' buffers)."""
    from glm_ep.backend.cuda import CudaBackend, RingConfig

    be = CudaBackend(0, RingConfig(**ring), stream=backend().stream)
    h, m, start, count = 2048, 1024, 4, 6  # ids outside [4, 10) are remote; K = 1..4 slabs
    cu, nu = both(moe_weights(rng, h=h, m=m, start=start, count=count), be)
    assert (cu.gate.weights.form, cu.up.weights.form, cu.down.weights.form) == (forms[0], forms[0], forms[1])
    ids = np.array([4, 30, 9, 0, 5, 17, 7, 8], dtype=np.int32)
    local = (ids >= start) & (ids < start + count)
    check_moe_gate_up_act(rng, cu, nu, ids, local, h, m, "ring glu", be)
    for proj, per_slot in (("gate", False), ("down", True)):
        check_moe_gemv(rng, cu, nu, proj, per_slot, ids, local, f"ring {proj}", be)


# ---- one-row sites: the routed down ring with the shared expert's down projection and the combine ---------
@pytest.mark.parametrize("ring,shared_k", [
    pytest.param(dict(), 512, id="default-2parts"),  # h 2048, m 1024, T = 4: 2 slabs, 256 k per shared item
    pytest.param(dict(), 256, id="default-1part"),
    pytest.param(dict(max_warps=3), 768, id="w3-3parts"),  # several items per warp, shared and routed mixed
    pytest.param(dict(depth=(4, 2), max_warps=5), 1024, id="t4d4-w5"),  # a ring deeper than an item's slabs
    pytest.param(dict(slab=(8, 4), depth=(3, 2), max_warps=7), 512, id="t8d3-w7"),
    pytest.param(dict(unscaled=False, max_warps=3), 512, id="bf16-w3"),
    pytest.param(dict(f16=True), 512, id="f16"),
    pytest.param(dict(placed=False), 512, id="bf16u"),
    pytest.param(dict(placed=False, max_warps=3), 768, id="bf16u-w3-3parts"),
])
def test_moe_down_combine_ring(rng, ring, shared_k):
    """``moe_down_shared_combine`` in ONE launch: the routed rows bit for bit the down ring's, the
    site output within an ulp of ``linear`` + ``combine`` here (the shared sums are added in another
    order) and close to NumPy; the fused launch ran (its fp32 partials, poisoned before each call,
    are all written, and the two-launch path's shared scratch is not); the arrival counts return
    to zero, so launches back to back and graph replays agree."""
    import cupy

    from glm_ep.backend.cuda import CudaBackend, RingConfig

    be = CudaBackend(0, RingConfig(**ring), stream=backend().stream)
    h, m, start, count = 2048, 1024, 4, 6
    cu, nu = both(moe_weights(rng, h=h, m=m, start=start, count=count), be)
    ids = np.array([4, 30, 9, 0, 5, 17, 7, 8], dtype=np.int32)
    local = (ids >= start) & (ids < start + count)
    t = be.ring.slab[0]
    assert be.ring.down_combine_parts(h, m, shared_k) == shared_k // (32 * t * (m // (128 * t)))
    act, sh_act = rand_bf16(rng, (TOP_K, m)), rand_bf16(rng, (1, shared_k))
    sh_down = rand_bf16(rng, (h, shared_k), shared_k ** -0.5)
    wts = (rng.random((1, TOP_K)) * 2.5).astype(np.float32)
    d_act, d_ids, d_sh_act, d_sh_down, d_wts = dev(act), dev(ids), dev(sh_act), dev(sh_down), dev(wts)

    routed_sep, shared_sep, out_sep = dev(np.zeros((TOP_K, h), BF16)), poisoned((1, h), BF16), poisoned((1, h), BF16)
    be.moe_gemv(d_act, cu.down, d_ids, routed_sep, True)
    be.linear(d_sh_act, d_sh_down, shared_sep)
    be.combine(routed_sep, d_wts, shared_sep, out_sep)
    ref_routed, ref_shared, ref = np.zeros((TOP_K, h), BF16), np.empty((1, h), BF16), np.empty((1, h), BF16)
    NP.moe_down_shared_combine(act, nu.down, ids, ref_routed, sh_act, sh_down, wts, ref_shared, ref)

    routed, scratch, out = dev(np.zeros((TOP_K, h), BF16)), poisoned((1, h), BF16), poisoned((1, h), BF16)

    def run():
        be.moe_down_shared_combine(d_act, cu.down, d_ids, routed, d_sh_act, d_sh_down, d_wts, scratch, out)

    def poison(a):
        cupy.cuda.runtime.memsetAsync(a.data.ptr, 0xFF, a.nbytes, be.stream.ptr)

    parts = be.ring.down_combine_parts(h, m, shared_k)
    run()  # loads the kernels outside the capture
    replay = be.capture(run)
    for label in ("launch", "launch again", "replay", "replay again"):
        poison(out)
        poison(be._dc_partials)
        if label.startswith("replay"):
            replay()
        else:
            run()
        got, got_routed = host(out), host(routed)
        partials = host(be._dc_partials)[:parts * h].view(np.uint32)
        assert not (partials == 0xFFFFFFFF).any(), f"{label}: partials left unwritten (the fused launch did not run)"
        assert unwritten(host(scratch)).all(), f"{label}: the shared scratch was written (the fused launch did not run)"
        np.testing.assert_array_equal(got_routed.view(np.uint16), host(routed_sep).view(np.uint16), err_msg=label)
        assert not got_routed[~local].view(np.uint16).any(), f"{label}: a remote slot is not zero"
        assert_written(got, label)
        assert_ulps(got, host(out_sep), f"down + shared + combine, {label}")
        assert_close(got, ref, f"down + shared + combine against NumPy, {label}")
        assert not host(be._dc_arrived).any(), f"{label}: the arrival counts were left non-zero"


def test_moe_down_combine_falls_back_where_the_ring_cannot():
    """A shared width the ring's items cannot cover, and the lever off, take the separate launches:
    the output is bit for bit the routed down launch, ``linear`` and ``combine``."""
    from glm_ep.backend.cuda import CudaBackend, RingConfig

    rng = np.random.default_rng(5)
    h, m = 2048, 1024
    for ring, shared_k in ((RingConfig(), 384), (RingConfig(down_combine=False), 512)):
        be = CudaBackend(0, ring, stream=backend().stream)
        assert not be._down_combine_scratch(h, m, shared_k)
        cu, _ = both(moe_weights(rng, h=h, m=m, start=0, count=4, num_experts=8), be)
        ids = dev(np.array([0, 1, 2, 3, 0, 1, 2, 3], dtype=np.int32))
        act, sh_act = dev(rand_bf16(rng, (TOP_K, m))), dev(rand_bf16(rng, (1, shared_k)))
        sh_down = dev(rand_bf16(rng, (h, shared_k), shared_k ** -0.5))
        wts = dev(np.full((1, TOP_K), 0.125, np.float32))
        routed, scratch, out = poisoned((TOP_K, h), BF16), poisoned((1, h), BF16), poisoned((1, h), BF16)
        be.moe_down_shared_combine(act, cu.down, ids, routed, sh_act, sh_down, wts, scratch, out)
        sep_routed, sep_shared, sep = poisoned((TOP_K, h), BF16), poisoned((1, h), BF16), poisoned((1, h), BF16)
        be.moe_gemv(act, cu.down, ids, sep_routed, True)
        be.linear(sh_act, sh_down, sep_shared)
        be.combine(sep_routed, wts, sep_shared, sep)
        assert_written(host(out), "fallback")
        np.testing.assert_array_equal(host(routed).view(np.uint16), host(sep_routed).view(np.uint16))
        np.testing.assert_array_equal(host(out).view(np.uint16), host(sep).view(np.uint16))


# ---- the placed form: x's power-of-two scale -------------------------------------------------------------
def test_placed_ring_scales_with_x(rng):
    """The placed form scales x by a power of two it picks from the row (gate and up) or the activation
    bound (down), and takes it back out of the outputs exactly: x * 2^k gives gate and up * 2^k bit for
    bit for k far beyond bf16's comfortable range (every product stays a normal fp32), matches the
    unscaled bf16 form within an ulp or two (the same products, paired in another order) and NumPy; a
    zero row gives zeros; the down projection and the single-row gemv (which finds its own scale) match
    the unscaled form likewise."""
    from glm_ep.backend.cuda import CudaBackend, RingConfig

    placed = CudaBackend(0, RingConfig(placed_hidden=True), stream=backend().stream)
    plain = CudaBackend(0, RingConfig(placed=False), stream=backend().stream)
    h, m, start, count = 2048, 1024, 0, 8
    w = moe_weights(rng, h=h, m=m, start=start, count=count, num_experts=8)
    cu_p, nu = both(w, placed)
    cu_u, _ = both(w, plain)
    assert (cu_p.gate.weights.form, cu_p.down.weights.form) == ("placed", "placed")
    assert cu_p.down.weights.xshift == 113  # act <= 100 at limit 10: below 2^7, scaled to below 2^120
    ids = np.array([0, 3, 5, 7, 1, 2, 4, 6], dtype=np.int32)
    x = rand_bf16(rng, (1, h), 3.0)
    ref = [np.zeros((TOP_K, m), BF16) for _ in range(3)]
    NP.moe_gate_up_act(x, nu, ids, 1e30, *ref)

    def glu(be, cu, xx):
        outs = [poisoned((TOP_K, m), BF16) for _ in range(3)]
        be.moe_gate_up_act(dev(xx), cu, dev(ids), 1e30, *outs)  # no clamp: gate and up scale with x
        return [host(o) for o in outs[:2]]

    base = glu(placed, cu_p, x)
    for o, u, r, name in zip(base, glu(plain, cu_u, x), ref, ("gate", "up")):
        assert_written(o, name)
        assert_ulps(o, u, f"placed {name} against bf16u", 2)
        assert_close(o, r, f"placed {name} against NumPy")
    for k in (-100, -60, -20, 17, 60, 100):
        xs = (x.astype(np.float32) * np.float32(2.0 ** k)).astype(BF16)
        assert np.array_equal(xs.astype(np.float32), x.astype(np.float32) * 2.0 ** k)  # exact in bf16
        for o, b, name in zip(glu(placed, cu_p, xs), base, ("gate", "up")):
            want = (b.astype(np.float64) * 2.0 ** k).astype(np.float32).astype(BF16)
            np.testing.assert_array_equal(o.view(np.uint16), want.view(np.uint16), err_msg=f"{name}, x * 2^{k}")
    for o in glu(placed, cu_p, np.zeros_like(x)):
        np.testing.assert_array_equal(o.astype(np.float32), 0.0)

    act = rand_bf16(rng, (TOP_K, m), 2.0)
    downs = []
    for be, cu in ((placed, cu_p), (plain, cu_u)):
        out = poisoned((TOP_K, h), BF16)
        be.moe_gemv(dev(act), cu.down, dev(ids), out, True)
        downs.append(host(out))
    assert_written(downs[0], "placed down")
    assert_ulps(downs[0], downs[1], "placed down against bf16u", 2)
    one = poisoned((TOP_K, m), BF16)
    placed.moe_gemv(dev(x), cu_p.gate, dev(ids), one, False)  # one x row, no bound: the kernel finds it
    assert_ulps(host(one), base[0], "placed gemv (own scale) against the glu's gate", 2)

"""The persistent decode ring (gemv_nvfp4_ring.cu) in each operand form and grid, its fused down + shared +
combine launch and the placed form's scaling, against gemv_nvfp4.cu's path and NumPy (the kernels' twins:
NumpyBackend.moe_gemv, moe_gate_up_act, moe_down_shared_combine): outputs poisoned before each run, values
within bf16 rounding."""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.backend.numpy_backend import NumpyBackend

from _cuda import (TOP_K, assert_claims_match, assert_written, backend, bind_scratch, both, check_moe_gate_up_act,
                   check_moe_gemv, claims_pair, dev, host, moe_weights, poisoned, requires_cuda, spy_launches, unwritten)
from helpers import BF16, assert_close, assert_ulps, rand_bf16

pytestmark = [pytest.mark.cuda, requires_cuda]

NP = NumpyBackend()
ANY_ITEMS = dict(min_items_per_sm=0)  # the ring at the tests' small shapes, whatever their items an SM


# ---- the persistent decode ring (gemv_nvfp4_ring.cu) against gemv_nvfp4.cu's path and NumPy ----------
UNSCALED, SCALED, FP16 = ("bf16u", "bf16u"), ("bf16", "bf16"), ("f16", "f16")
DEFAULT = ("bf16u", "placed")  # (gate and up, down)


@pytest.mark.parametrize("ring,forms", [
    pytest.param(dict(enabled=False), SCALED, id="blocks"),  # gemv_nvfp4.cu's block-per-tile kernels
    pytest.param(dict(), DEFAULT, id="default"),  # gate and up unscaled bf16 (F = 2), down placed (F = 3)
    pytest.param(dict(warps_per_sm=8), DEFAULT, id="w8"),
    pytest.param(dict(max_warps=3), DEFAULT, id="w3"),  # several items per warp: the ring crosses items
    pytest.param(dict(max_warps=5), DEFAULT, id="w5"),  # items shared out unevenly over the warps
    pytest.param(dict(f16=True), ("bf16u", "f16"), id="f16-down"),  # the fp16 form on the down projection
    pytest.param(dict(f16=True, f16_hidden=True), FP16, id="f16"),  # consume_slab_unscaled, F = 1, everywhere
    pytest.param(dict(f16=True, f16_hidden=True, max_warps=3), FP16, id="f16-w3"),
    pytest.param(dict(placed=False), UNSCALED, id="bf16u"),  # the unscaled bf16 form everywhere (F = 2)
    pytest.param(dict(placed=False, max_warps=3), UNSCALED, id="bf16u-w3"),
    pytest.param(dict(glu_slab=2, glu_depth=3), DEFAULT, id="glu-t2d3"),  # gate + up's other geometries
    pytest.param(dict(glu_slab=2, glu_depth=2, max_warps=3), DEFAULT, id="glu-t2d2-w3"),
    pytest.param(dict(f16=True, f16_hidden=True, glu_slab=2, glu_depth=2), FP16, id="f16-glu-t2d2"),
])
def test_moe_decode_ring(rng, ring, forms):
    """A backend built with each ring config, on the shared backend's stream (the helpers' buffers)."""
    from glm_ep.backend.cuda import CudaBackend, RingConfig

    be = CudaBackend(0, RingConfig(**{**ANY_ITEMS, **ring}), stream=backend().stream)
    h, m, start, count = 2048, 1024, 4, 6  # ids outside [4, 10) are remote; K = 1..4 slabs
    cu, nu = both(moe_weights(rng, h=h, m=m, start=start, count=count), be)
    assert (cu.gate.weights.form, cu.up.weights.form, cu.down.weights.form) == (forms[0], forms[0], forms[1])
    ids = np.array([4, 30, 9, 0, 5, 17, 7, 8], dtype=np.int32)
    local = (ids >= start) & (ids < start + count)
    check_moe_gate_up_act(rng, cu, nu, ids, local, h, m, "ring glu", be)
    for proj, per_slot in (("gate", False), ("down", True), ("down", False)):
        check_moe_gemv(rng, cu, nu, proj, per_slot, ids, local, f"ring {proj}", be)


# ---- one-row sites: the routed down ring with the shared expert's down projection and the combine ---------
@pytest.mark.parametrize("ring,shared_k", [
    pytest.param(dict(), 512, id="default-2parts"),  # h 2048, m 1024, T = 4: 2 slabs, 256 k per shared item
    pytest.param(dict(), 256, id="default-1part"),
    pytest.param(dict(max_warps=3), 768, id="w3-3parts"),  # several items per warp, shared and routed mixed
    pytest.param(dict(max_warps=5), 1024, id="w5-4parts"),
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
    from glm_ep.backend.cuda.ring import RING_SLAB

    be = CudaBackend(0, RingConfig(**{**ANY_ITEMS, **ring}), stream=backend().stream)
    h, m, start, count = 2048, 1024, 4, 6
    sc = bind_scratch(be, hidden=h, moe_width=m, shared_width=shared_k)  # as a site of this shape's workspace does
    cu, nu = both(moe_weights(rng, h=h, m=m, start=start, count=count), be)
    ids = np.array([4, 30, 9, 0, 5, 17, 7, 8], dtype=np.int32)
    local = (ids >= start) & (ids < start + count)
    t = RING_SLAB
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
        poison(sc["down_combine_partials"])
        if label.startswith("replay"):
            replay()
        else:
            run()
        got, got_routed = host(out), host(routed)
        partials = host(sc["down_combine_partials"])[:parts * h].view(np.uint32)
        assert not (partials == 0xFFFFFFFF).any(), f"{label}: partials left unwritten (the fused launch did not run)"
        assert unwritten(host(scratch)).all(), f"{label}: the shared scratch was written (the fused launch did not run)"
        np.testing.assert_array_equal(got_routed.view(np.uint16), host(routed_sep).view(np.uint16), err_msg=label)
        assert not got_routed[~local].view(np.uint16).any(), f"{label}: a remote slot is not zero"
        assert_written(got, label)
        assert_ulps(got, host(out_sep), f"down + shared + combine, {label}")
        assert_close(got, ref, f"down + shared + combine against NumPy, {label}")
        assert not host(sc["down_combine_arrived"]).any(), f"{label}: the arrival counts were left non-zero"
        assert not host(sc["ring_claims"]).any(), f"{label}: the ring's claim counter was left non-zero"


def test_moe_down_combine_falls_back_where_the_ring_cannot():
    """A shared width the ring's items cannot cover, and the lever off, take the separate launches:
    the output is bit for bit the routed down launch, ``linear`` and ``combine``."""
    from glm_ep.backend.cuda import CudaBackend, RingConfig

    rng = np.random.default_rng(5)
    h, m = 2048, 1024
    for ring, shared_k in ((RingConfig(**ANY_ITEMS), 384), (RingConfig(down_combine=False, **ANY_ITEMS), 512)):
        be = CudaBackend(0, ring, stream=backend().stream)
        assert not be.ring.down_combine_parts(h, m, shared_k)
        assert "down_combine_partials" not in bind_scratch(be, hidden=h, moe_width=m, shared_width=shared_k)
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
    """The placed down projection scales x by the power of two its activation bound gives (xshift, fixed at
    upload) and takes it back out of the outputs exactly: within an ulp or two of the unscaled bf16 form (the
    same products, paired in another order) and close to NumPy. Given no bound (xshift 0), one x row gets its
    scale from the kernel, which reads the row: x * 2^k gives the outputs * 2^k bit for bit for k far beyond
    bf16's comfortable range (every product stays a normal fp32), and a zero row gives zeros."""
    from dataclasses import replace

    from glm_ep.backend.base import ExpertTable
    from glm_ep.backend.cuda import CudaBackend, RingConfig

    placed = CudaBackend(0, RingConfig(**ANY_ITEMS), stream=backend().stream)
    plain = CudaBackend(0, RingConfig(placed=False, **ANY_ITEMS), stream=backend().stream)
    h, m, start, count = 2048, 1024, 0, 8
    w = moe_weights(rng, h=h, m=m, start=start, count=count, num_experts=8)
    cu_p, nu = both(w, placed)
    cu_u, _ = both(w, plain)
    assert (cu_p.gate.weights.form, cu_p.down.weights.form, cu_u.down.weights.form) == ("bf16u", "placed", "bf16u")
    assert cu_p.down.weights.xshift == 113  # act <= 100 at limit 10: below 2^7, scaled to below 2^120
    ids = np.array([0, 3, 5, 7, 1, 2, 4, 6], dtype=np.int32)

    def down(be, table, a, per_slot):
        out = poisoned((TOP_K, h), BF16)
        be.moe_gemv(dev(a), table, dev(ids), out, per_slot)
        return host(out)

    act = rand_bf16(rng, (TOP_K, m), 2.0)
    ref = np.zeros((TOP_K, h), BF16)
    NP.moe_gemv(act, nu.down, ids, ref, True)
    got = down(placed, cu_p.down, act, True)
    assert_written(got, "placed down")
    assert_ulps(got, down(plain, cu_u.down, act, True), "placed down against bf16u", 2)
    assert_close(got, ref, "placed down against NumPy")

    unbound = ExpertTable(replace(cu_p.down.weights, xshift=0), start, count)  # one row: the kernel finds the scale
    x = rand_bf16(rng, (1, m), 3.0)
    base = down(placed, unbound, x, False)
    assert_written(base, "placed down, its own scale")
    assert_ulps(base, down(plain, cu_u.down, x, False), "placed down (own scale) against bf16u", 2)
    for k in (-100, -60, -20, 17, 60, 100):
        xs = (x.astype(np.float32) * np.float32(2.0 ** k)).astype(BF16)
        assert np.array_equal(xs.astype(np.float32), x.astype(np.float32) * 2.0 ** k)  # exact in bf16
        want = (base.astype(np.float64) * 2.0 ** k).astype(np.float32).astype(BF16)
        np.testing.assert_array_equal(down(placed, unbound, xs, False).view(np.uint16), want.view(np.uint16),
                                      err_msg=f"x * 2^{k}")
    np.testing.assert_array_equal(down(placed, unbound, np.zeros_like(x), False).astype(np.float32), 0.0)


def test_few_items_an_sm_take_the_block_kernels(rng, monkeypatch):
    """Launches under ``min_items_per_sm`` (as one expert's down projection is at one row) go to gemv_nvfp4.cu's
    block kernels, on weights uploaded in the ring's forms: no ring entry launched, the outputs within bf16
    rounding of NumPy, remote slots untouched."""
    from glm_ep.backend.cuda import CudaBackend, RingConfig
    from glm_ep.backend.cuda import routed as NVM

    be = CudaBackend(0, RingConfig(min_items_per_sm=10 ** 6), stream=backend().stream)
    h, m, start, count = 2048, 1024, 4, 6
    cu, nu = both(moe_weights(rng, h=h, m=m, start=start, count=count), be)
    assert (cu.gate.weights.form, cu.down.weights.form) == DEFAULT
    entries = spy_launches(monkeypatch, NVM)
    ids = np.array([4, 30, 9, 0, 5, 17, 7, 8], dtype=np.int32)
    local = (ids >= start) & (ids < start + count)
    check_moe_gate_up_act(rng, cu, nu, ids, local, h, m, "block kernels glu", be)
    check_moe_gemv(rng, cu, nu, "down", True, ids, local, "block kernels down", be)
    assert entries and not any("ring" in e for e in entries), entries


@pytest.mark.parametrize("ring", [dict(), dict(glu_slab=2, glu_depth=3), dict(placed=False)],
                         ids=["default", "glu-t2d3", "bf16u"])
@pytest.mark.parametrize("max_warps", [3, 7, 0])
def test_decode_ring_claims(rng, ring, max_warps):
    """The decode ring's items past a warp's first claimed from the device counter (``ring_claims``) against the
    fixed stride: gate + up + SwiGLU and the down projection bit for bit the same, launched, launched again and
    replayed from a graph; the counter returns to zero after each launch."""
    h, m, start, count = 2048, 1024, 4, 6
    rc = dict(**ANY_ITEMS, max_warps=max_warps, **ring)
    claimed, fixed, sc = claims_pair(rc, h, m)
    w = moe_weights(rng, h=h, m=m, start=start, count=count)
    tables = {be: both(w, be)[0] for be in (claimed, fixed)}
    ids_host = np.array([4, 30, 9, 0, 5, 17, 7, 8], dtype=np.int32)
    ids, local = dev(ids_host), (ids_host >= start) & (ids_host < start + count)
    x, act = dev(rand_bf16(rng, (1, h), 3.0)), dev(rand_bf16(rng, (TOP_K, m)))
    outs = {be: [poisoned((TOP_K, m), BF16) for _ in range(3)] + [poisoned((TOP_K, h), BF16)]
            for be in (claimed, fixed)}

    def run(be):
        o = outs[be]
        be.moe_gate_up_act(x, tables[be], ids, 1.0, *o[:3])
        be.moe_gemv(act, tables[be].down, ids, o[3], True)

    # 5 local slots: 320 gate + up items and 640 down items; 4 or 8 warps claim them, one a slot's each does not
    # (act rows of remote slots are unspecified)
    assert_claims_match(claimed, fixed, run, outs, sc["ring_claims"], max_warps > 0, f"decode ring {rc}",
                        rows={"act": local})

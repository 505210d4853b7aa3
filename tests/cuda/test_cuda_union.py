"""The union (verify, 2..8 rows) kernels against NumPy: the union table, the block kernels and the
union ring (gemv_nvfp4_union.cu), whose rows are independent of which rows share their batch. The twins:
NumpyBackend.union_table, moe_gate_up_act_union and moe_gemv_union.
"""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.mlp import routing
from glm_ep.backend.numpy_backend import NumpyBackend

from _cuda import (E, H, M, TOP_K, assert_claims_match, assert_written, backend, both, claims_pair, dev, host,
                   moe_weights, poisoned, requires_cuda, unwritten)
from helpers import BF16, assert_close, rand_bf16

pytestmark = [pytest.mark.cuda, requires_cuda]

NP = NumpyBackend()


def _union_ids(rng, r):
    # rows drawn from a pool of 16 experts: plenty of overlap between rows
    return np.stack([rng.choice(16, TOP_K, replace=False) * 2 for _ in range(r)]).astype(np.int32)


@pytest.mark.parametrize("r", [2, 3, 4, 5, 6, 7, 8])
def test_union_table(rng, r):
    ids = _union_ids(rng, r)
    ref_eid, ref_slot = routing.union_table(ids)
    u_eid, u_slot = poisoned((r * TOP_K,), np.int32), poisoned((r * TOP_K, r), np.int32)
    backend().union_table(dev(ids), u_eid, u_slot)
    np.testing.assert_array_equal(host(u_eid), ref_eid)
    np.testing.assert_array_equal(host(u_slot), ref_slot)


@pytest.mark.parametrize("r", [2, 3, 4, 5, 6, 7, 8])
def test_moe_union(rng, r):
    start, count = 0, 20  # ids >= 20 are remote
    cu, nu = both(moe_weights(rng, start=start, count=count))
    ids = _union_ids(rng, r)
    check_moe_union(rng, cu, nu, ids, ids < count, H, M, "union")


def check_moe_union(rng, cu, nu, ids, local, h, m, label, be=None):
    """Union (verify) gate + up + SwiGLU and both projections against NumPy; remote slots untouched."""
    r = ids.shape[0]
    u_eid, u_slot = routing.union_table(ids)
    d_eid, d_slot = dev(u_eid), dev(u_slot)
    be = be or backend()
    x = rand_bf16(rng, (r, h), 2.0)
    refs = [np.zeros((r, TOP_K, m), BF16) for _ in range(3)]
    NP.moe_gate_up_act_union(x, nu, u_eid, u_slot, 1.0, *refs)
    outs = [poisoned((r, TOP_K, m), BF16) for _ in range(3)]
    be.moe_gate_up_act_union(dev(x), cu, d_eid, d_slot, 1.0, *outs)
    for name, o, ref in zip(("gate", "up", "act"), outs, refs):
        got = host(o)
        if name != "act":  # act rows of remote slots are unspecified
            assert unwritten(got[~local]).all(), f"{label} {name}: a remote slot was written"
        assert_written(got[local], f"{label} {name}")
        assert_close(got[local], ref[local], f"{label} {name} r={r}")
    for proj, per_slot, kin, n in (("gate", False, h, m), ("down", True, m, h)):
        a = rand_bf16(rng, (r, TOP_K, kin) if per_slot else (r, kin))
        ref = np.zeros((r, TOP_K, n), BF16)
        NP.moe_gemv_union(a, getattr(nu, proj), u_eid, u_slot, ref, per_slot)
        out = poisoned((r, TOP_K, n), BF16)
        be.moe_gemv_union(dev(a), getattr(cu, proj), d_eid, d_slot, out, per_slot)
        got = host(out)
        assert unwritten(got[~local]).all(), f"{label} {proj}: a remote slot was written"
        assert_written(got[local], f"{label} {proj}")
        assert_close(got[local], ref[local], f"{label} {proj} r={r}")


# ---- the union (verify) kernels on the ring (gemv_nvfp4_union.cu) against NumPy -------------------------
@pytest.mark.parametrize("ring", [
    dict(union_max_rows=0),  # gemv_nvfp4.cu's block-per-tile union kernels
    dict(union_max_rows=8),  # the union ring's default slabs at every width
    dict(union_max_rows=8, union_slab=(4, 4), union_depth=(2, 2)),
    dict(union_max_rows=8, max_warps=3),  # several items per warp: the ring crosses entry boundaries
    dict(union_max_rows=8, union_slab=(4, 4), union_depth=(2, 2), max_warps=5),
    dict(union_max_rows=8, union_depth=(2, 3)),  # the down projection's ring at depth 2
    dict(union_max_rows=8, union_depth=(2, 2), max_warps=3),  # both at depth 2
], ids=["blocks", "t2d3", "t4d2", "t2d3-w3", "t4d2-w5", "t2d2-down", "t2d2-w3"])
@pytest.mark.parametrize("r", [2, 3, 5, 6, 8])
def test_moe_union_ring(rng, ring, r):
    """A backend built with each union config, on the shared backend's stream."""
    from glm_ep.backend.cuda import CudaBackend, RingConfig

    be = CudaBackend(0, RingConfig(min_items_per_sm=0, **ring), stream=backend().stream)
    h, m, start, count = 2048, 1024, 6, 20  # ids outside [6, 26) are remote; K = 1..8 slabs
    cu, nu = both(moe_weights(rng, h=h, m=m, start=start, count=count), be)
    ids = _union_ids(rng, r)
    check_moe_union(rng, cu, nu, ids, (ids >= start) & (ids < start + count), h, m, f"union ring {ring}", be)


def test_union_ring_rows_independent(rng):
    """The union ring runs each row through its own mma column (the rows are the mma's B columns): every row's
    outputs are bit-identical whichever rows share its batch, and equal to the same row run twice as a batch
    of two. Rows share experts (a pool of 12), so union entries hold several rows."""
    from glm_ep.backend.cuda import CudaBackend, RingConfig

    be = CudaBackend(0, RingConfig(union_max_rows=8, min_items_per_sm=0), stream=backend().stream)
    h, m = 2048, 1024
    cu, _ = both(moe_weights(rng, h=h, m=m, start=0, count=E), be)
    ids8 = np.stack([rng.choice(12, TOP_K, replace=False) * 2 for _ in range(8)]).astype(np.int32)
    x8 = rand_bf16(rng, (8, h), 2.0)
    act8 = rand_bf16(rng, (8, TOP_K, m))

    def union(rows):  # gate, up, act and down of the rows ``rows`` of the pool, as one union batch
        r = len(rows)
        glu = [poisoned((r, TOP_K, m), BF16) for _ in range(3)]
        down = poisoned((r, TOP_K, h), BF16)
        u_eid, u_slot = (dev(a) for a in routing.union_table(ids8[rows]))
        be.moe_gate_up_act_union(dev(x8[rows]), cu, u_eid, u_slot, 1.0, *glu)
        be.moe_gemv_union(dev(act8[rows]), cu.down, u_eid, u_slot, down, True)
        return [host(o).view(np.uint16) for o in (*glu, down)]

    alone = [union([i, i]) for i in range(8)]  # each row twice: the smallest batch the union ring takes
    for i, outs in enumerate(alone):
        for name, o in zip(("gate", "up", "act", "down"), outs):
            np.testing.assert_array_equal(o[0], o[1], err_msg=f"row {i} {name}: the same row in two columns")
    for r in (2, 5, 6, 8):
        got = union(list(range(r)))
        for i in range(r):
            for name, g, want in zip(("gate", "up", "act", "down"), got, alone[i]):
                np.testing.assert_array_equal(g[i], want[0], err_msg=f"row {i} {name}: {r}-row union vs alone")


@pytest.mark.parametrize("max_warps", [3, 0])
def test_union_ring_absent_rows_leak_nothing(rng, max_warps):
    """The union ring copies only the x rows present in an entry; an absent row's staged x is whatever an
    earlier entry or batch left there. A batch of NaN rows that all chose the same experts fills the ring's
    staged x with NaN; the next batch (rows sharing few experts: most of an entry's rows absent) must still
    match NumPy, its remote slots untouched."""
    from glm_ep.backend.cuda import CudaBackend, RingConfig

    be = CudaBackend(0, RingConfig(union_max_rows=8, min_items_per_sm=0, max_warps=max_warps),
                     stream=backend().stream)
    h, m = 2048, 1024
    cu, nu = both(moe_weights(rng, h=h, m=m, start=0, count=E), be)
    same = np.tile(np.arange(TOP_K, dtype=np.int32) * 3, (8, 1))
    u_eid, u_slot = (dev(a) for a in routing.union_table(same))
    glu = [poisoned((8, TOP_K, m), BF16) for _ in range(3)]
    be.moe_gate_up_act_union(dev(np.full((8, h), np.nan, BF16)), cu, u_eid, u_slot, 1.0, *glu)
    be.moe_gemv_union(dev(np.full((8, TOP_K, m), np.nan, BF16)), cu.down, u_eid, u_slot,
                      poisoned((8, TOP_K, h), BF16), True)
    assert np.isnan(host(glu[0]).astype(np.float32)).all(), "the NaN batch did not run"
    ids = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(8)]).astype(np.int32)
    check_moe_union(rng, cu, nu, ids, np.ones_like(ids, bool), h, m, "after a NaN batch", be)


@pytest.mark.parametrize("ring", [dict(), dict(union_depth=(2, 2)), dict(union_slab=(4, 4), union_depth=(2, 2))],
                         ids=["t2d3", "t2d2", "t4d2"])
@pytest.mark.parametrize("max_warps", [3, 16, 0])
def test_union_ring_claims(rng, ring, max_warps):
    """Items past a warp's first claimed from the device counter (``ring_claims``, bound as a workspace binds it)
    against the fixed stride: the same items, each run by one warp in one order, so every output is bit for bit
    the same, launched, launched again and replayed from a graph; the counter returns to zero after each launch."""
    h, m = 2048, 1024
    rc = dict(union_max_rows=8, min_items_per_sm=0, max_warps=max_warps, **ring)
    claimed, fixed, sc = claims_pair(rc, h, m)
    w = moe_weights(rng, h=h, m=m, start=0, count=E)
    tables = {be: both(w, be)[0] for be in (claimed, fixed)}
    ids = _union_ids(rng, 6)
    u_eid, u_slot = (dev(a) for a in routing.union_table(ids))
    x, act = dev(rand_bf16(rng, (6, h), 2.0)), dev(rand_bf16(rng, (6, TOP_K, m)))
    outs = {be: [poisoned((6, TOP_K, m), BF16) for _ in range(3)] + [poisoned((6, TOP_K, h), BF16)]
            for be in (claimed, fixed)}

    def run(be):
        o = outs[be]
        be.moe_gate_up_act_union(x, tables[be], u_eid, u_slot, 1.0, *o[:3])
        be.moe_gemv_union(act, tables[be].down, u_eid, u_slot, o[3], True)

    # at most 16 union entries (the rows' pool): 1024 gate + up items and 2048 down items; 4 or 16 warps claim them,
    # a grid sized for the device's SMs (about one item a warp) does not
    assert_claims_match(claimed, fixed, run, outs, sc["ring_claims"], max_warps > 0, f"union ring {rc}")

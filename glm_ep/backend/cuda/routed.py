"""Wrappers of the NVFP4 routed-expert GEMV kernels (``gemv_nvfp4.cu``, ``gemv_nvfp4_ring.cu``,
``gemv_nvfp4_union.cu``): the expert pointer tables and the tensor-core launch geometry. The
one-row wrappers take the backend's ``RingConfig`` (``ring``); the grouped prefill GEMM's wrappers
are in ``grouped``. Compiled and launched through ``loader``'s one cached loader; the ``-D``
constants stay there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from glm_ep.backend.base import ExpertTable, RoutedExperts
from glm_ep.backend.cuda.kernel_loader import (BF16, F32, I32, MMA_ROWS, NVFP4_WARPS, RING_CLAIMS_MIN_ITEMS,
                                               RING_WARPS, U8, U32, UNION_MAX_IDS, UNION_MAX_ROWS, cdiv, check,
                                               check_shape, i32, i64, launch, sm_count, split_k)
from glm_ep.backend.cuda.ring import RingConfig
from glm_ep.config.model import NVFP4_GROUP

NVFP4_CHUNK = 32  # k per 16-byte packed chunk: K must be a multiple
MMA_STEP_CHUNKS = 4  # 16-byte chunks per step of a lane quad (128 k)
MMA_WORK_WARPS_PER_SM = 16  # split K until a launch holds this many warps per SM (16: fastest of 16/48/96 on H200)


# ---- routed experts: NVFP4 pointer tables -------------------------------------------------------
@dataclass(frozen=True)
class Nvfp4Pointers:
    """One projection of every local expert, as the grouped kernels index it (the CUDA backend's
    form of an ``ExpertTable``'s weights): device arrays of the experts' packed / scale base
    pointers (uint64) and their fp32 ``scale_2``, by local id. The arrays the pointers point at are
    kept alive in ``packed`` / ``scale``. ``form``: the operand form in which the ring reads this
    projection (``RingConfig.forms``, decided at upload); ``xshift``: the placed form's x scale
    2^xshift (the down projection's, ``ring.act_shift``; 0: none given)."""

    packed_ptrs: Any  # uint64 [count]
    scale_ptrs: Any  # uint64 [count]
    scale2: Any  # fp32 [count]
    n: int  # out width
    k: int  # in width
    packed: tuple[Any, ...]  # uint8 [n, k/2] per expert
    scale: tuple[Any, ...]  # uint8 (E4M3 bits) [n, k/16] per expert
    scale2_host: tuple[float, ...]
    form: str = "bf16"
    xshift: int = 0


def check_nvfp4_k(k: int, what: str) -> None:
    if k % NVFP4_CHUNK:
        raise ValueError(f"{what}: in width {k} is not a multiple of {NVFP4_CHUNK} (one 16-byte NVFP4 chunk)")


_NVFP4_BLOCK = (NVFP4_WARPS * 32, 1, 1)
_NVFP4 = "gemv_nvfp4.cu"


def _mma_geometry(n: int, k: int, entries: int) -> tuple[int, int]:
    """(grid.x, ksplit) of a tensor-core launch: K is split over 1, 2, 4 or 8 warps of a block until
    the launch holds MMA_WORK_WARPS_PER_SM warps per SM, each slice keeping >= 4 steps."""
    steps = cdiv(k // NVFP4_CHUNK, MMA_STEP_CHUNKS)
    return split_k(cdiv(n, MMA_ROWS), max(entries, 1), steps, NVFP4_WARPS, MMA_WORK_WARPS_PER_SM, 4, sm_count())


def nvfp4_gemv(x_1K: Any, packed_NK2: Any, scale_NG: Any, scale2: float, out_1N: Any) -> None:
    """One expert, one row: ``out = bf16(x @ dequant(w)^T)``; ``scale_2`` by value."""
    n, k = packed_NK2.shape[0], packed_NK2.shape[1] * 2
    check_nvfp4_k(k, "nvfp4_gemv")
    check("x", x_1K, BF16), check("packed", packed_NK2, U8), check("scale", scale_NG, U8, 2)
    check("out", out_1N, BF16, 2)
    check_shape("x", x_1K, (1, k)), check_shape("out", out_1N, (1, n))
    check_shape("scale", scale_NG, (n, k // NVFP4_GROUP))
    grid_x, ks = _mma_geometry(n, k, 1)
    launch(_NVFP4, "nvfp4_mma_gemv", (grid_x, 1, 1), _NVFP4_BLOCK,
           (x_1K, packed_NK2, scale_NG, np.float32(scale2), out_1N, i32(n), i32(k), i32(ks)))


# ---- one row, every slot: the persistent ring (gemv_nvfp4_ring.cu) or the block kernels ----------
_RING = "gemv_nvfp4_ring.cu"
_UNION = "gemv_nvfp4_union.cu"


def _claims(claims: Any, items: int, blocks: int) -> Any:
    """A ring launch's item counter (two uint32, zero between launches: the next item, the warps done), or the null
    pointer (a fixed stride) where its ``items`` at most (every slot local) cannot give each of its warps (``blocks``
    x RING_WARPS) ``RING_CLAIMS_MIN_ITEMS``; the kernel applies the same rule to the items it finds local."""
    if claims is None:
        return np.uint64(0)
    check("claims", claims, U32, 4)
    if claims.size < 2:
        raise ValueError(f"ring claims: {claims.size} uint32, the ring keeps 2 (the next item, the warps done)")
    return claims if items >= RING_CLAIMS_MIN_ITEMS * blocks * RING_WARPS else np.uint64(0)


def nvfp4_moe_gemv(x: Any, per_slot_input: bool, table: ExpertTable[Nvfp4Pointers], ids_S: Any, out_SN: Any,
                   ring: RingConfig, claims: Any = None) -> None:
    """Every slot of ONE row in one launch: slot s runs expert ``ids[s]`` on ``x[0]`` or,
    ``per_slot_input``, on ``x[s]``; a remote slot's output row is left untouched. ``claims``: the ring's
    item counter (``ring_claims``: two uint32, zero between launches; None, or too few items a warp: a fixed
    stride)."""
    s, proj, start, count = ids_S.size, table.weights, table.start, table.count
    check("x", x, BF16), check("ids", ids_S, I32, 4), check("out", out_SN, BF16)
    check_shape("x", x, (s if per_slot_input else 1, proj.k))
    check_shape("out", out_SN, (s, proj.n))
    x_stride = i64(proj.k if per_slot_input else 0)
    if ring.takes(proj.n, proj.k, s, 1):
        # the placed form needs x's scale: the projection's bound (act_shift, set at upload), or for a projection
        # given none, one x row's own (-1: the kernel finds it), while per-slot rows take the unscaled bf16 form
        form, xshift = proj.form, proj.xshift
        if form == "placed" and not xshift:
            form, xshift = ("bf16u", 0) if per_slot_input else (form, -1)
        blocks, smem, suffix = ring.geometry(proj.n, s, 1, form)
        launch(_RING, f"nvfp4_ring_moe_gemv_{suffix}", (blocks, 1, 1), (RING_WARPS * 32, 1, 1),
               (x, x_stride, proj.packed_ptrs, proj.scale_ptrs, proj.scale2, ids_S, i32(s), i32(start),
                i32(count), out_SN, i32(proj.n), i32(proj.k), i32(xshift),
                _claims(claims, s * (proj.n // MMA_ROWS), blocks)), smem=smem, persistent=True)
        return
    head = (x, x_stride, proj.packed_ptrs, proj.scale_ptrs, proj.scale2, ids_S,
            i32(start), i32(count), out_SN, i32(proj.n), i32(proj.k))
    grid_x, ks = _mma_geometry(proj.n, proj.k, s)
    launch(_NVFP4, "nvfp4_mma_moe_gemv", (grid_x, s, 1), _NVFP4_BLOCK, head + (i32(ks),))


def nvfp4_moe_down_combine(act_SK: Any, table: ExpertTable[Nvfp4Pointers], ids_S: Any, routed_SN: Any,
                           shared_act_1I: Any, shared_down_NI: Any, wts_1S: Any, out_1N: Any, partials: Any,
                           arrived: Any, ring: RingConfig, claims: Any = None) -> bool:
    """ONE row's routed down projection (slot s on ``act[s]``), the shared expert's down projection
    and the site's combine in ONE ring launch (``nvfp4_ring_moe_down_combine``): ``out`` as
    ``linear`` + ``combine`` compute it (the shared sums added in another order), ``routed`` as
    ``nvfp4_moe_gemv`` writes it (remote slots must already be zero). False, with nothing queued, where
    the ring does not take the shapes (``RingConfig.down_combine_parts``). ``partials``: fp32 of at
    least parts x n; ``arrived``: uint32 of at least n / 16, zero between launches (each launch leaves
    it zero); ``claims``: as ``nvfp4_moe_gemv``'s."""
    proj, start, count = table.weights, table.start, table.count
    s, n, k = ids_S.size, proj.n, proj.k
    shared_k = shared_down_NI.shape[1]
    parts = ring.down_combine_parts(n, k, shared_k)
    if not parts or not ring.takes(n, k, s, 1):
        return False
    check("act", act_SK, BF16), check("ids", ids_S, I32, 4), check("routed", routed_SN, BF16)
    check("shared_act", shared_act_1I, BF16), check("shared_down", shared_down_NI, BF16)
    check("wts", wts_1S, F32, 4), check("out", out_1N, BF16, 2)
    check_shape("act", act_SK, (s, k)), check_shape("routed", routed_SN, (s, n))
    check_shape("shared_act", shared_act_1I, (1, shared_k)), check_shape("shared_down", shared_down_NI, (n, shared_k))
    check_shape("wts", wts_1S, (1, s)), check_shape("out", out_1N, (1, n))
    check("partials", partials, F32, 4), check("arrived", arrived, U32, 4)
    if partials.size < parts * n or arrived.size < n // MMA_ROWS:
        raise ValueError(f"nvfp4_moe_down_combine: scratch of {partials.size} sums / {arrived.size} counts, the launch "
                         f"needs {parts * n} / {n // MMA_ROWS}")
    items = (s + parts) * (n // MMA_ROWS)
    blocks, smem, suffix = ring.geometry(n, s, 1, proj.form, extra_items=parts * (n // MMA_ROWS))
    launch(_RING, f"nvfp4_ring_moe_down_combine_{suffix}", (blocks, 1, 1), (RING_WARPS * 32, 1, 1),
           (act_SK, proj.packed_ptrs, proj.scale_ptrs, proj.scale2, ids_S, i32(s), i32(start), i32(count),
            routed_SN, i32(n), i32(k), shared_down_NI, shared_act_1I, i32(shared_k), i32(parts), partials, arrived,
            wts_1S, out_1N, i32(proj.xshift), _claims(claims, items, blocks)), smem=smem, persistent=True)
    return True


def nvfp4_moe_glu(x_1K: Any, experts: RoutedExperts[Nvfp4Pointers], ids_S: Any, limit: float, gate_SN: Any,
                  up_SN: Any, act_SN: Any, ring: RingConfig, claims: Any = None) -> None:
    """Decode gate, up and the clamped SwiGLU of every slot of one row in ONE launch; ``claims``: as
    ``nvfp4_moe_gemv``'s."""
    gate, up, start, count = experts.gate.weights, experts.up.weights, experts.start, experts.count
    s, n, k = ids_S.size, gate.n, gate.k
    check("x", x_1K, BF16), check("ids", ids_S, I32, 4)
    check_shape("x", x_1K, (1, k))
    for name, a in (("gate", gate_SN), ("up", up_SN), ("act", act_SN)):
        check(name, a, BF16, 2), check_shape(name, a, (s, n))
    if ring.takes(n, k, s, 2):
        blocks, smem, suffix = ring.geometry(n, s, 2, gate.form)
        launch(_RING, f"nvfp4_ring_moe_glu_{suffix}", (blocks, 1, 1), (RING_WARPS * 32, 1, 1),
               (x_1K, gate.packed_ptrs, gate.scale_ptrs, gate.scale2, up.packed_ptrs, up.scale_ptrs, up.scale2,
                ids_S, i32(s), i32(start), i32(count), gate_SN, up_SN, act_SN, i32(n), i32(k),
                np.float32(limit), _claims(claims, s * (n // MMA_ROWS), blocks)), smem=smem, persistent=True)
        return
    head = (x_1K, gate.packed_ptrs, gate.scale_ptrs, gate.scale2, up.packed_ptrs, up.scale_ptrs, up.scale2,
            ids_S, i32(start), i32(count), gate_SN, up_SN, act_SN, i32(n), i32(k))
    grid_x, ks = _mma_geometry(n, k, 2 * s)
    launch(_NVFP4, "nvfp4_mma_moe_glu", (grid_x, s, 1), _NVFP4_BLOCK, head + (i32(ks), np.float32(limit)))


def _union_dims(u_eid_U: Any, u_slot_UR: Any, out_RKN: Any, what: str) -> tuple[int, int]:
    r, k = out_RKN.shape[0], out_RKN.shape[1]
    if not 1 <= r <= UNION_MAX_ROWS:
        raise ValueError(f"{what}: {r} rows; one union launch covers 1..{UNION_MAX_ROWS} rows (the mma's B columns)")
    if r * k > UNION_MAX_IDS:
        raise ValueError(f"{what}: rows * top_k = {r * k} exceeds the union table's {UNION_MAX_IDS} ids")
    check("u_eid", u_eid_U, I32, 4), check("u_slot", u_slot_UR, I32, 4)
    check_shape("u_eid", u_eid_U, (r * k,)), check_shape("u_slot", u_slot_UR, (r * k, r))
    return r, k


def nvfp4_moe_gemv_union(x: Any, per_slot_input: bool, table: ExpertTable[Nvfp4Pointers], u_eid_U: Any,
                         u_slot_UR: Any, out_RKN: Any, ring: RingConfig, claims: Any = None) -> None:
    """R = 2..8 rows: each union expert's weights swept once for every row that chose it, on the
    union ring (``ring.union_takes``) or the block kernels (grid.y = union entry). ``x`` is
    ``[R, Kin]`` or, ``per_slot_input``, ``[R, K, Kin]``. ``claims``: as ``nvfp4_moe_gemv``'s."""
    proj, start, count = table.weights, table.start, table.count
    r, k = _union_dims(u_eid_U, u_slot_UR, out_RKN, "nvfp4_moe_gemv_union")
    check("x", x, BF16), check("out", out_RKN, BF16)
    check_shape("x", x, (r, k, proj.k) if per_slot_input else (r, proj.k))
    check_shape("out", out_RKN, (r, k, proj.n))
    x_row = proj.k * (k if per_slot_input else 1)
    tables = (proj.packed_ptrs, proj.scale_ptrs, proj.scale2, u_eid_U, u_slot_UR)
    if ring.union_takes(proj.n, proj.k, r, 1):
        blocks, smem, suffix = ring.union_geometry(proj.n, r, r * k, 1)
        launch(_UNION, f"nvfp4_ring_union_gemv_{suffix}", (blocks, 1, 1), (RING_WARPS * 32, 1, 1),
               (x, i64(x_row), i64(proj.k if per_slot_input else 0), *tables, i32(r * k), i32(r), i32(start),
                i32(count), out_RKN, i64(k * proj.n), i32(proj.n), i32(proj.k),
                _claims(claims, r * k * (proj.n // MMA_ROWS), blocks)), smem=smem, persistent=True)
        return
    grid_x, ks = _mma_geometry(proj.n, proj.k, r * k)
    launch(_NVFP4, "nvfp4_mma_moe_gemv_union", (grid_x, r * k, 1), _NVFP4_BLOCK,
           (x, i64(x_row), i64(proj.k if per_slot_input else 0), *tables, i32(r), i32(start), i32(count),
            out_RKN, i64(k * proj.n), i32(proj.n), i32(proj.k), i32(ks)))


def nvfp4_moe_glu_union(x_RK: Any, experts: RoutedExperts[Nvfp4Pointers], u_eid_U: Any, u_slot_UR: Any, limit: float,
                        gate_RKN: Any, up_RKN: Any, act_RKN: Any, ring: RingConfig, claims: Any = None) -> None:
    """The union twin of ``nvfp4_moe_glu``: gate, up and SwiGLU of R = 2..8 rows in ONE launch; ``claims``: as
    ``nvfp4_moe_gemv``'s."""
    gate, up, start, count = experts.gate.weights, experts.up.weights, experts.start, experts.count
    r, k = _union_dims(u_eid_U, u_slot_UR, act_RKN, "nvfp4_moe_glu_union")
    n, kin = gate.n, gate.k
    check("x", x_RK, BF16), check_shape("x", x_RK, (r, kin))
    for name, a in (("gate", gate_RKN), ("up", up_RKN), ("act", act_RKN)):
        check(name, a, BF16, 2), check_shape(name, a, (r, k, n))
    tables = (gate.packed_ptrs, gate.scale_ptrs, gate.scale2, up.packed_ptrs, up.scale_ptrs, up.scale2,
              u_eid_U, u_slot_UR)
    if ring.union_takes(n, kin, r, 2):
        blocks, smem, suffix = ring.union_geometry(n, r, r * k, 2)
        launch(_UNION, f"nvfp4_ring_union_glu_{suffix}", (blocks, 1, 1), (RING_WARPS * 32, 1, 1),
               (x_RK, i64(kin), *tables, i32(r * k), i32(r), i32(start), i32(count), gate_RKN, up_RKN, act_RKN,
                i64(k * n), i32(n), i32(kin), np.float32(limit), _claims(claims, r * k * (n // MMA_ROWS), blocks)),
               smem=smem, persistent=True)
        return
    grid_x, ks = _mma_geometry(n, kin, 2 * r * k)
    launch(_NVFP4, "nvfp4_mma_moe_glu_union", (grid_x, r * k, 1), _NVFP4_BLOCK,
           (x_RK, i64(kin), *tables, i32(r), i32(start), i32(count), gate_RKN, up_RKN, act_RKN,
            i64(k * n), i32(n), i32(kin), i32(ks), np.float32(limit)))

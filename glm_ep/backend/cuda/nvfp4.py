"""Wrappers of the NVFP4 routed-expert kernels (``gemv_nvfp4.cu``, ``gemv_nvfp4_ring.cu``, the
grouped prefill GEMM ``gemm_nvfp4.cu``): the expert pointer tables, the tensor-core launch geometry
and the persistent decode ring's configuration (``RING``, read at every launch, so it may be swapped
at run time). Compiled and launched through ``kernels``' one cached loader; the ``-D`` constants
stay there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from glm_ep.backend.cuda.loader import (BF16, I32, NVFP4_WARPS, RING_WARPS, U8, UNION_MAX_IDS, _cdiv, _check,
                                    _check_shape, _current_device, _device_attr, _i32, _i64, _launch, _split_k)
from glm_ep.config import NVFP4_GROUP

NVFP4_CHUNK = 32  # k per 16-byte packed chunk: K must be a multiple
MMA_ROWS = 16  # weight rows per warp group: the mma's 16-row A operand (MMA_ROWS in gemv_nvfp4.cu)
MMA_STEP_CHUNKS = 4  # 16-byte chunks per step of a lane quad (128 k)
MMA_MAX_X_ROWS = 8  # x rows per launch: the mma's 8 B columns
MMA_WORK_WARPS_PER_SM = 16  # split K until a launch holds this many warps per SM (16: fastest of 16/48/96 on H200)
RING_STEP_K = 128  # k per step of the ring kernels; a ring stage is a slab of T steps (K a multiple)
SM_SMEM = 228 * 1024  # shared memory of one SM (sm_90), of which each resident block costs 1 KB more


# ---- routed experts: NVFP4 pointer tables -------------------------------------------------------
@dataclass(frozen=True)
class ExpertPtrTable:
    """One projection of every local expert, as the grouped kernels index it: device arrays of the
    experts' packed / scale base pointers (uint64) and their fp32 ``scale_2``, by local id. The
    arrays the pointers point at are kept alive in ``packed`` / ``scale``."""

    packed_ptrs: Any  # uint64 [count]
    scale_ptrs: Any  # uint64 [count]
    scale2: Any  # fp32 [count]
    n: int  # out width
    k: int  # in width
    packed: tuple[Any, ...]  # uint8 [n, k/2] per expert
    scale: tuple[Any, ...]  # uint8 (E4M3 bits) [n, k/16] per expert
    scale2_host: tuple[float, ...]


def check_nvfp4_k(k: int, what: str) -> None:
    if k % NVFP4_CHUNK:
        raise ValueError(f"{what}: in width {k} is not a multiple of {NVFP4_CHUNK} (one 16-byte NVFP4 chunk)")


_NVFP4_BLOCK = (NVFP4_WARPS * 32, 1, 1)
_NVFP4 = "gemv_nvfp4.cu"


def _mma_geometry(n: int, k: int, entries: int) -> tuple[int, int]:
    """(grid.x, ksplit) of a tensor-core launch: K is split over 1, 2, 4 or 8 warps of a block until
    the launch holds MMA_WORK_WARPS_PER_SM warps per SM, each slice keeping >= 4 steps."""
    steps = _cdiv(k // NVFP4_CHUNK, MMA_STEP_CHUNKS)
    return _split_k(_cdiv(n, MMA_ROWS), max(entries, 1), steps, NVFP4_WARPS, MMA_WORK_WARPS_PER_SM, 4,
                    _device_attr(_current_device(), "MultiProcessorCount"))


def nvfp4_gemv(x_1K: Any, packed_NK2: Any, scale_NG: Any, scale2: float, out_1N: Any) -> None:
    """One expert, one row: ``out = bf16(x @ dequant(w)^T)``; ``scale_2`` by value."""
    n, k = packed_NK2.shape[0], packed_NK2.shape[1] * 2
    check_nvfp4_k(k, "nvfp4_gemv")
    _check("x", x_1K, BF16), _check("packed", packed_NK2, U8), _check("scale", scale_NG, U8, 2)
    _check("out", out_1N, BF16, 2)
    _check_shape("x", x_1K, (1, k)), _check_shape("out", out_1N, (1, n))
    _check_shape("scale", scale_NG, (n, k // NVFP4_GROUP))
    grid_x, ks = _mma_geometry(n, k, 1)
    _launch(_NVFP4, "nvfp4_mma_gemv", (grid_x, 1, 1), _NVFP4_BLOCK,
            (x_1K, packed_NK2, scale_NG, np.float32(scale2), out_1N, _i32(n), _i32(k), _i32(ks)))


# ---- the persistent decode kernels (gemv_nvfp4_ring.cu) ---------------------------------------
RING_KERNELS = ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3))  # the (T, D) gemv_nvfp4_ring.cu instantiates


@dataclass
class RingConfig:
    """How the one-row routed kernels run: the persistent ring (``enabled``) or gemv_nvfp4.cu's
    block-per-tile kernels. By P, the matrices a warp sweeps (1: one projection, 2: gate + up): the
    slab (T steps of 128 k per ring stage) and the ring depth D (stages per warp); the warps per SM
    the grid aims at (fewer where the rings' shared memory does not fit). ``max_warps`` caps the grid
    (tests: several items per warp). ``f16``: the fp16 form (the input rounded to fp16; fastest on
    H200) instead of the bf16 form (exact for any bf16 input), for inputs that are activations:
    the clamped SwiGLU is bounded by swiglu_limit^2, inside fp16's range (65504) for limits up to
    255. ``f16_hidden`` also uses it for gate/up, which read the hidden state: off by default,
    since a hidden value past 65504 would become inf there."""

    enabled: bool = True
    slab: dict = field(default_factory=lambda: {1: 4, 2: 4})
    depth: dict = field(default_factory=lambda: {1: 2, 2: 2})  # fastest on H200 (docs/perf/NOTES.md)
    warps_per_sm: int = 16
    max_warps: int = 0
    f16: bool = True  # gemv_nvfp4_ring.cu's consume_slab_f16 (docs/perf/NOTES.md, version 3)
    f16_hidden: bool = False


RING = RingConfig()
_RING = "gemv_nvfp4_ring.cu"


def ring_stage_bytes(p: int, t: int) -> int:
    """One ring stage of one warp (RingStage<P, T>): P x 16 rows x 64 T weight bytes, P x 16 x 8 T
    scale bytes, 256 T bytes of x."""
    return p * 16 * 64 * t + p * 16 * 8 * t + 256 * t


def _ring_ok(n: int, k: int, slots: int, p: int) -> bool:
    return RING.enabled and n % MMA_ROWS == 0 and k % (RING_STEP_K * RING.slab[p]) == 0 and slots <= 32


def _ring_geometry(n: int, slots: int, p: int, f16: bool) -> tuple[int, int, str]:
    """(blocks, dynamic smem bytes, entry suffix): as even a share of the slots x row-group items per
    warp as the cap allows (warps_per_sm per SM, or fewer where the rings do not fit), RING_WARPS per
    block."""
    t, depth = RING.slab[p], RING.depth[p]
    if (t, depth) not in RING_KERNELS:
        raise ValueError(f"ring slab {t}, depth {depth}: gemv_nvfp4_ring.cu instantiates (T, D) in {RING_KERNELS}")
    smem = RING_WARPS * depth * ring_stage_bytes(p, t)
    per_sm = min(RING.warps_per_sm, SM_SMEM // (smem + 1024) * RING_WARPS)
    items = max(1, slots * (n // MMA_ROWS))
    cap = max(1, _device_attr(_current_device(), "MultiProcessorCount") * per_sm)
    if RING.max_warps:
        cap = min(cap, RING.max_warps)
    warps = _cdiv(items, _cdiv(items, cap))
    return _cdiv(warps, RING_WARPS), smem, f"{'f16_' if f16 else ''}t{t}_d{depth}"


def nvfp4_moe_gemv(x: Any, per_slot_input: bool, proj: ExpertPtrTable, ids_S: Any, start: int, count: int,
                   out_SN: Any) -> None:
    """Every slot of ONE row in one launch: slot s runs expert ``ids[s]`` on ``x[0]`` or,
    ``per_slot_input``, on ``x[s]``; a remote slot's output row is left untouched."""
    s = ids_S.size
    _check("x", x, BF16), _check("ids", ids_S, I32, 4), _check("out", out_SN, BF16)
    _check_shape("x", x, (s if per_slot_input else 1, proj.k))
    _check_shape("out", out_SN, (s, proj.n))
    x_stride = _i64(proj.k if per_slot_input else 0)
    if _ring_ok(proj.n, proj.k, s, 1):
        f16 = RING.f16 and (per_slot_input or RING.f16_hidden)  # per-slot input: the activation
        blocks, smem, suffix = _ring_geometry(proj.n, s, 1, f16)
        _launch(_RING, f"nvfp4_ring_moe_gemv_{suffix}", (blocks, 1, 1), (RING_WARPS * 32, 1, 1),
                (x, x_stride, proj.packed_ptrs, proj.scale_ptrs, proj.scale2, ids_S, _i32(s), _i32(start),
                 _i32(count), out_SN, _i32(proj.n), _i32(proj.k)), smem=smem)
        return
    head = (x, x_stride, proj.packed_ptrs, proj.scale_ptrs, proj.scale2, ids_S,
            _i32(start), _i32(count), out_SN, _i32(proj.n), _i32(proj.k))
    grid_x, ks = _mma_geometry(proj.n, proj.k, s)
    _launch(_NVFP4, "nvfp4_mma_moe_gemv", (grid_x, s, 1), _NVFP4_BLOCK, head + (_i32(ks),))


def nvfp4_moe_glu(x_1K: Any, gate: ExpertPtrTable, up: ExpertPtrTable, ids_S: Any, start: int, count: int,
                  limit: float, gate_SN: Any, up_SN: Any, act_SN: Any) -> None:
    """Decode gate, up and the clamped SwiGLU of every slot of one row in ONE launch."""
    s, n, k = ids_S.size, gate.n, gate.k
    _check("x", x_1K, BF16), _check("ids", ids_S, I32, 4)
    _check_shape("x", x_1K, (1, k))
    for name, a in (("gate", gate_SN), ("up", up_SN), ("act", act_SN)):
        _check(name, a, BF16, 2), _check_shape(name, a, (s, n))
    if _ring_ok(n, k, s, 2):
        blocks, smem, suffix = _ring_geometry(n, s, 2, RING.f16 and RING.f16_hidden)
        _launch(_RING, f"nvfp4_ring_moe_glu_{suffix}", (blocks, 1, 1), (RING_WARPS * 32, 1, 1),
                (x_1K, gate.packed_ptrs, gate.scale_ptrs, gate.scale2, up.packed_ptrs, up.scale_ptrs, up.scale2,
                 ids_S, _i32(s), _i32(start), _i32(count), gate_SN, up_SN, act_SN, _i32(n), _i32(k),
                 np.float32(limit)), smem=smem)
        return
    head = (x_1K, gate.packed_ptrs, gate.scale_ptrs, gate.scale2, up.packed_ptrs, up.scale_ptrs, up.scale2,
            ids_S, _i32(start), _i32(count), gate_SN, up_SN, act_SN, _i32(n), _i32(k))
    grid_x, ks = _mma_geometry(n, k, 2 * s)
    _launch(_NVFP4, "nvfp4_mma_moe_glu", (grid_x, s, 1), _NVFP4_BLOCK, head + (_i32(ks), np.float32(limit)))


def _union_dims(u_eid_U: Any, u_slot_UR: Any, out_RKN: Any, what: str) -> tuple[int, int]:
    r, k = out_RKN.shape[0], out_RKN.shape[1]
    if not 1 <= r <= MMA_MAX_X_ROWS:
        raise ValueError(f"{what}: {r} rows; one union launch covers 1..{MMA_MAX_X_ROWS} rows (the mma's B columns)")
    if r * k > UNION_MAX_IDS:
        raise ValueError(f"{what}: rows * top_k = {r * k} exceeds the union table's {UNION_MAX_IDS} ids")
    _check("u_eid", u_eid_U, I32, 4), _check("u_slot", u_slot_UR, I32, 4)
    _check_shape("u_eid", u_eid_U, (r * k,)), _check_shape("u_slot", u_slot_UR, (r * k, r))
    return r, k


def nvfp4_moe_gemv_union(x: Any, per_slot_input: bool, proj: ExpertPtrTable, u_eid_U: Any, u_slot_UR: Any,
                         start: int, count: int, out_RKN: Any) -> None:
    """R = 2..8 rows (grid.y = union entry): each union expert's weights swept once for every row
    that chose it. ``x`` is ``[R, Kin]`` or, ``per_slot_input``, ``[R, K, Kin]``."""
    r, k = _union_dims(u_eid_U, u_slot_UR, out_RKN, "nvfp4_moe_gemv_union")
    _check("x", x, BF16), _check("out", out_RKN, BF16)
    _check_shape("x", x, (r, k, proj.k) if per_slot_input else (r, proj.k))
    _check_shape("out", out_RKN, (r, k, proj.n))
    x_row = proj.k * (k if per_slot_input else 1)
    tables = (proj.packed_ptrs, proj.scale_ptrs, proj.scale2, u_eid_U, u_slot_UR)
    grid_x, ks = _mma_geometry(proj.n, proj.k, r * k)
    _launch(_NVFP4, "nvfp4_mma_moe_gemv_union", (grid_x, r * k, 1), _NVFP4_BLOCK,
            (x, _i64(x_row), _i64(proj.k if per_slot_input else 0), *tables, _i32(r), _i32(start), _i32(count),
             out_RKN, _i64(k * proj.n), _i32(proj.n), _i32(proj.k), _i32(ks)))


def nvfp4_moe_glu_union(x_RK: Any, gate: ExpertPtrTable, up: ExpertPtrTable, u_eid_U: Any, u_slot_UR: Any,
                        start: int, count: int, limit: float, gate_RKN: Any, up_RKN: Any, act_RKN: Any) -> None:
    """The union twin of ``nvfp4_moe_glu``: gate, up and SwiGLU of R = 2..8 rows in ONE launch."""
    r, k = _union_dims(u_eid_U, u_slot_UR, act_RKN, "nvfp4_moe_glu_union")
    n, kin = gate.n, gate.k
    _check("x", x_RK, BF16), _check_shape("x", x_RK, (r, kin))
    for name, a in (("gate", gate_RKN), ("up", up_RKN), ("act", act_RKN)):
        _check(name, a, BF16, 2), _check_shape(name, a, (r, k, n))
    tables = (gate.packed_ptrs, gate.scale_ptrs, gate.scale2, up.packed_ptrs, up.scale_ptrs, up.scale2,
              u_eid_U, u_slot_UR)
    grid_x, ks = _mma_geometry(n, kin, 2 * r * k)
    _launch(_NVFP4, "nvfp4_mma_moe_glu_union", (grid_x, r * k, 1), _NVFP4_BLOCK,
            (x_RK, _i64(kin), *tables, _i32(r), _i32(start), _i32(count), gate_RKN, up_RKN, act_RKN,
             _i64(k * n), _i32(n), _i32(kin), _i32(ks), np.float32(limit)))


# ---- the grouped prefill GEMM (gemm_nvfp4.cu) ---------------------------------------------------
_GEMM = "gemm_nvfp4.cu"
#: the variants gemm_nvfp4.cu instantiates (its GEMM_VARIANT lines): (rows per tile BM, warps of 32
#: weight rows each, k per stage BK, stages)
GEMM_VARIANTS = ((16, 4, 64, 4), (32, 4, 64, 4), (64, 4, 64, 4), (64, 8, 64, 4), (64, 4, 128, 3), (64, 8, 128, 3),
                 (128, 4, 64, 3), (128, 8, 64, 3))
GEMM_DEFAULT = {16: (16, 4, 64, 4), 32: (32, 4, 64, 4), 64: (64, 4, 64, 4)}  # by BM (docs/perf/NOTES.md)


@dataclass(frozen=True)
class GemmGeometry:
    bm: int  # sorted rows of one expert per block
    warps: int
    bk: int  # k per pipeline stage
    stages: int

    @classmethod
    def of(cls, variant: tuple[int, int, int, int]) -> "GemmGeometry":
        if tuple(variant) not in GEMM_VARIANTS:
            raise ValueError(f"grouped GEMM variant {tuple(variant)}: gemm_nvfp4.cu instantiates (rows, warps, k, "
                             f"stages) in {GEMM_VARIANTS}")
        return cls(*variant)

    @property
    def bn(self) -> int:  # weight rows per block (the fused GLU: half gate, half up)
        return 32 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem(self) -> int:  # dynamic shared memory: stages x GemmStage<BM, BN, BK>
        return self.stages * (self.bm * self.bk * 2 + self.bn * self.bk // 2 + self.bn * self.bk // 16)

    @property
    def suffix(self) -> str:
        return f"m{self.bm}w{self.warps}k{self.bk}"

    def tiles(self, slots: int, count: int) -> int:
        """Row tiles a launch must cover at most: every local expert's ceil(rows / BM), whatever the
        routing (the last tile of each expert that has rows may be partial)."""
        return _cdiv(slots, self.bm) + min(count, slots)


def gemm_variant(slots: int, num_experts: int) -> tuple[int, int, int, int]:
    """The variant for a call: the smallest BM that holds the rows an expert gets on average (slots
    spread over all experts), so few-row widths do not pay for empty tile rows."""
    per_expert = slots / max(num_experts, 1)
    return GEMM_DEFAULT[next((bm for bm in sorted(GEMM_DEFAULT) if per_expert <= bm), max(GEMM_DEFAULT))]


def _gemm_checks(x: Any, gather_rows: bool, sorted_token_ids_S: Any, expert_offsets: Any, num_experts: int,
                 k: int, out_SN: Any, n: int, geo: GemmGeometry, what: str) -> int:
    s = sorted_token_ids_S.size
    if k % geo.bk:
        raise ValueError(f"{what}: in width {k} is not a multiple of {geo.bk} (one grouped-GEMM stage)")
    if n % 8:
        raise ValueError(f"{what}: out width {n} is not a multiple of 8")
    _check("x", x, BF16), _check("sorted_token_ids", sorted_token_ids_S, I32, 4)
    _check("expert_offsets", expert_offsets, I32, 4), _check("out", out_SN, BF16)
    _check_shape("expert_offsets", expert_offsets, (num_experts + 1,))
    _check_shape("out", out_SN, (s, n))
    if x.ndim != 2 or x.shape[1] != k or (not gather_rows and x.shape[0] != s):
        raise ValueError(f"{what}: x has shape {tuple(x.shape)}, expected [rows, {k}]"
                         + ("" if gather_rows else f" with {s} rows"))
    return s


def nvfp4_gemm_sorted(x: Any, gather_rows: bool, sorted_token_ids_S: Any, expert_offsets: Any, num_experts: int,
                      proj: ExpertPtrTable, start: int, count: int, out_SN: Any,
                      variant: tuple[int, int, int, int] | None = None) -> None:
    """Every local expert's expert-sorted rows in ONE tensor-core launch: sorted row i of expert e
    reads ``x[sorted_token_ids[i]]`` (``gather_rows``) or ``x[i]``; rows of remote experts untouched.
    ``variant``: one of ``GEMM_VARIANTS`` (default: ``gemm_variant``'s)."""
    geo = GemmGeometry.of(variant or gemm_variant(sorted_token_ids_S.size, num_experts))
    s = _gemm_checks(x, gather_rows, sorted_token_ids_S, expert_offsets, num_experts, proj.k, out_SN, proj.n, geo,
                     "nvfp4_gemm_sorted")
    if s == 0 or count == 0:
        return
    n_blocks = _cdiv(proj.n, geo.bn)
    _launch(_GEMM, f"nvfp4_gemm_sorted_{geo.suffix}", (geo.tiles(s, count) * n_blocks, 1, 1), (geo.threads, 1, 1),
            (x, sorted_token_ids_S if gather_rows else np.uint64(0), expert_offsets, proj.packed_ptrs,
             proj.scale_ptrs, proj.scale2, _i32(start), _i32(count), out_SN, _i32(proj.n), _i32(proj.k),
             _i32(n_blocks)), smem=geo.smem)


def nvfp4_gemm_sorted_glu(x_TK: Any, sorted_token_ids_S: Any, expert_offsets: Any, num_experts: int,
                          gate: ExpertPtrTable, up: ExpertPtrTable, start: int, count: int, limit: float,
                          act_SN: Any, variant: tuple[int, int, int, int] | None = None) -> None:
    """Gate, up and the clamped SwiGLU of every local expert's sorted rows in ONE launch (the token
    rows gathered through ``sorted_token_ids``); writes only ``act`` (gate and up stay in registers,
    each rounded to bf16 before the SwiGLU, as the separate ops round them)."""
    if (gate.n, gate.k) != (up.n, up.k):
        raise ValueError(f"nvfp4_gemm_sorted_glu: gate [{gate.n}, {gate.k}] and up [{up.n}, {up.k}] differ")
    geo = GemmGeometry.of(variant or gemm_variant(sorted_token_ids_S.size, num_experts))
    s = _gemm_checks(x_TK, True, sorted_token_ids_S, expert_offsets, num_experts, gate.k, act_SN, gate.n, geo,
                     "nvfp4_gemm_sorted_glu")
    if s == 0 or count == 0:
        return
    n_blocks = _cdiv(gate.n, geo.bn // 2)
    _launch(_GEMM, f"nvfp4_gemm_sorted_glu_{geo.suffix}", (geo.tiles(s, count) * n_blocks, 1, 1),
            (geo.threads, 1, 1),
            (x_TK, sorted_token_ids_S, expert_offsets, gate.packed_ptrs, gate.scale_ptrs, gate.scale2,
             up.packed_ptrs, up.scale_ptrs, up.scale2, _i32(start), _i32(count), act_SN, _i32(gate.n),
             _i32(gate.k), _i32(n_blocks), np.float32(limit)), smem=geo.smem)

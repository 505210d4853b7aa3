"""Wrappers of the grouped NVFP4 prefill GEMM (``gemm_nvfp4.cu``): every local expert's expert-sorted
rows in ONE tensor-core launch per projection (gate + up + SwiGLU fused into one), the tile
variants it instantiates and the choice among them.

Shape suffixes: T rows, S expert-sorted slots, N/K a projection's out/in width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from glm_ep.backend.base import ExpertTable, RoutedExperts
from glm_ep.backend.cuda.loader import (ARCH_SPECIFIC, BF16, GEMM_VARIANTS, I32, arch_build, block_smem_limit, cdiv,
                                        check, check_shape, compute_capability, current_device, gemm_smem_bytes,
                                        gemm_suffix, i32, launch)
from glm_ep.backend.cuda.nvfp4 import Nvfp4Pointers

_GEMM = "gemm_nvfp4.cu"
# the variants (loader.GEMM_VARIANTS) gemm_nvfp4.cu instantiates; the default of each BM, the fastest
# measured on H200 (PREFILL.md's variant table): the 64-row tile takes 128-k stages where K allows,
# its 64-k twin otherwise (GEMM_FALLBACK); past 64 rows per expert the tiled engine's 128 x 128 tile;
# on sm_90a the wgmma engine's 128 x 128 tile from 17 rows per expert on (GEMM_WGMMA_FROM)
GEMM_DEFAULT = {16: (16, 1, 4, 64, 4, "sync"), 32: (32, 1, 4, 64, 4, "sync"), 64: (64, 1, 4, 128, 3, "sync"),
                128: (128, 2, 4, 64, 3, "sync")}
GEMM_FALLBACK = {(64, 1, 4, 128, 3, "sync"): (64, 1, 4, 64, 4, "sync")}
GEMM_WGMMA = (128, 1, 4, 64, 4, "wgmma")
GEMM_WGMMA_FROM = 16  # rows per expert past which the wgmma engine is the default where it runs
Variant = tuple[int, int, int, int, int, str]


@dataclass(frozen=True)
class GemmGeometry:
    bm: int  # sorted rows of one expert per block
    wm: int  # warps along the rows (1: the register engine, every warp on all BM rows)
    wn: int  # warps along the weight rows, 32 each
    bk: int  # k per pipeline stage
    stages: int
    mma: str  # "sync" (mma.sync) or "wgmma" (sm_90a)

    @classmethod
    def of(cls, variant: Variant) -> "GemmGeometry":
        if tuple(variant) not in GEMM_VARIANTS:
            raise ValueError(f"grouped GEMM variant {tuple(variant)}: gemm_nvfp4.cu instantiates (rows, warp rows, "
                             f"warp columns, k, stages, mma) in {GEMM_VARIANTS}")
        return cls(*variant)

    @property
    def bn(self) -> int:  # weight rows per block (the fused GLU: half gate, half up)
        return 32 * self.wn

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn

    @property
    def smem(self) -> int:  # dynamic shared memory (loader.gemm_smem_bytes: stages, bf16 tiles, alignment)
        return gemm_smem_bytes(self.bm, self.wm, self.wn, self.bk, self.stages, self.mma)

    @property
    def suffix(self) -> str:
        return gemm_suffix(self.bm, self.wm, self.wn, self.bk, self.stages, self.mma)

    def tiles(self, slots: int, count: int) -> int:
        """Row tiles a launch must cover at most: every local expert's ceil(rows / BM), whatever the
        routing (the last tile of each expert that has rows may be partial)."""
        return cdiv(slots, self.bm) + min(count, slots)


def gemm_variant(slots: int, num_experts: int, k: int, wgmma: bool = False) -> Variant:
    """The variant for a call: the smallest BM that holds the rows an expert gets on average (slots
    spread over all experts), so few-row widths do not pay for empty tile rows; where ``wgmma`` runs
    (sm_90a), its 128-row tile past ``GEMM_WGMMA_FROM`` rows per expert. A variant whose stage does not
    divide the in width ``k`` gives way to its fallback (the launch names the width if it has none)."""
    per_expert = slots / max(num_experts, 1)
    if wgmma and per_expert > GEMM_WGMMA_FROM and k % GEMM_WGMMA[3] == 0:
        return GEMM_WGMMA
    bm = next((bm for bm in sorted(GEMM_DEFAULT) if per_expert <= bm), max(GEMM_DEFAULT))
    return _fitting(GEMM_DEFAULT[bm], k)


def _fitting(v: Variant, k: int) -> Variant:
    """``v``, or its fallback where its stage does not divide the in width ``k``."""
    return v if k % v[3] == 0 else GEMM_FALLBACK.get(v, v)


def wgmma_here() -> bool:
    """Whether this device runs the wgmma variants (gemm_nvfp4.cu built for sm_90a)."""
    dev = current_device()
    return (ARCH_SPECIFIC["gemm_nvfp4.cu"].get(compute_capability(dev)) == "sm_90a"
            and arch_build("gemm_nvfp4.cu", dev) is not None)


def why_not_here(variant: Variant) -> str:
    """'' where this device runs ``variant``, else why not: its stages past the shared memory one block may have
    (m64w8k128's 104 KB on a GB10's 99 KB), or a wgmma variant where ``wgmma_here`` is false. The dynamic
    shared memory only: a variant within an entry's few static bytes of the limit passes here and is still
    refused, by name, at launch."""
    geo = GemmGeometry.of(variant)
    if geo.mma == "wgmma" and not wgmma_here():
        return (f"variant {geo.suffix} needs wgmma (sm_90a, compute capability 9.0); this device is "
                f"{compute_capability(current_device())}")
    if geo.smem > (limit := block_smem_limit()):
        return f"variant {geo.suffix} needs {geo.smem} bytes of shared memory a block; this device allows {limit}"
    return ""


def runs_here(variant: Variant) -> bool:
    """Whether this device runs ``variant`` (``why_not_here``)."""
    return not why_not_here(variant)


#: the tiled and wgmma engines address x with 32-bit element offsets
X_OFFSET_LIMIT = 2 ** 32


def _geometry(variant: Variant | None, x: Any, slots: int, num_experts: int, k: int, what: str) -> GemmGeometry:
    """The call's variant: the one asked for (a wgmma one only where it runs), or ``gemm_variant``'s; an
    x too large for the tiled and wgmma engines' 32-bit offsets takes the register engine (asked for: a
    clear error)."""
    geo = GemmGeometry.of(variant or gemm_variant(slots, num_experts, k, wgmma_here()))
    if variant is not None and (why := why_not_here(variant)):  # gemm_variant offers wgmma only where it runs
        raise ValueError(f"{what}: {why}")
    if (geo.wm > 1 or geo.mma == "wgmma") and x.size >= X_OFFSET_LIMIT:
        if variant is not None:
            raise ValueError(f"{what}: x has {x.size} elements; variant {geo.suffix} addresses it with 32-bit "
                             f"offsets (fewer than {X_OFFSET_LIMIT}); split the call")
        geo = GemmGeometry.of(_fitting(GEMM_DEFAULT[64], k))
    return geo


def _gemm_checks(x: Any, gather_rows: bool, sorted_token_ids_S: Any, expert_offsets: Any, num_experts: int,
                 k: int, out_SN: Any, n: int, geo: GemmGeometry, what: str) -> int:
    s = sorted_token_ids_S.size
    if k % geo.bk:
        raise ValueError(f"{what}: in width {k} is not a multiple of {geo.bk} (one grouped-GEMM stage)")
    if n % 8:
        raise ValueError(f"{what}: out width {n} is not a multiple of 8")
    check("x", x, BF16), check("sorted_token_ids", sorted_token_ids_S, I32, 4)
    check("expert_offsets", expert_offsets, I32, 4), check("out", out_SN, BF16)
    check_shape("expert_offsets", expert_offsets, (num_experts + 1,))
    check_shape("out", out_SN, (s, n))
    if x.ndim != 2 or x.shape[1] != k or (not gather_rows and x.shape[0] != s):
        raise ValueError(f"{what}: x has shape {tuple(x.shape)}, expected [rows, {k}]"
                         + ("" if gather_rows else f" with {s} rows"))
    return s


def nvfp4_gemm_sorted(x: Any, gather_rows: bool, sorted_token_ids_S: Any, expert_offsets: Any, num_experts: int,
                      table: ExpertTable[Nvfp4Pointers], out_SN: Any,
                      variant: Variant | None = None) -> None:
    """Every local expert's expert-sorted rows in ONE tensor-core launch: sorted row i of expert e
    reads ``x[sorted_token_ids[i]]`` (``gather_rows``) or ``x[i]``; rows of remote experts untouched.
    ``variant``: one of ``GEMM_VARIANTS`` (default: ``gemm_variant``'s)."""
    proj, start, count = table.weights, table.start, table.count
    geo = _geometry(variant, x, sorted_token_ids_S.size, num_experts, proj.k, "nvfp4_gemm_sorted")
    s = _gemm_checks(x, gather_rows, sorted_token_ids_S, expert_offsets, num_experts, proj.k, out_SN, proj.n, geo,
                     "nvfp4_gemm_sorted")
    if s == 0 or count == 0:
        return
    n_blocks = cdiv(proj.n, geo.bn)
    launch(_GEMM, f"nvfp4_gemm_sorted_{geo.suffix}", (geo.tiles(s, count) * n_blocks, 1, 1), (geo.threads, 1, 1),
           (x, sorted_token_ids_S if gather_rows else np.uint64(0), expert_offsets, proj.packed_ptrs,
            proj.scale_ptrs, proj.scale2, i32(start), i32(count), out_SN, i32(proj.n), i32(proj.k),
            i32(n_blocks)), smem=geo.smem)


def nvfp4_gemm_sorted_glu(x_TK: Any, sorted_token_ids_S: Any, expert_offsets: Any, num_experts: int,
                          experts: RoutedExperts[Nvfp4Pointers], limit: float, act_SN: Any,
                          variant: Variant | None = None) -> None:
    """Gate, up and the clamped SwiGLU of every local expert's sorted rows in ONE launch (the token
    rows gathered through ``sorted_token_ids``); writes only ``act`` (gate and up stay in registers,
    each rounded to bf16 before the SwiGLU, as the separate ops round them)."""
    gate, up, start, count = experts.gate.weights, experts.up.weights, experts.start, experts.count
    if (gate.n, gate.k) != (up.n, up.k):
        raise ValueError(f"nvfp4_gemm_sorted_glu: gate [{gate.n}, {gate.k}] and up [{up.n}, {up.k}] differ")
    geo = _geometry(variant, x_TK, sorted_token_ids_S.size, num_experts, gate.k, "nvfp4_gemm_sorted_glu")
    s = _gemm_checks(x_TK, True, sorted_token_ids_S, expert_offsets, num_experts, gate.k, act_SN, gate.n, geo,
                     "nvfp4_gemm_sorted_glu")
    if s == 0 or count == 0:
        return
    n_blocks = cdiv(gate.n, geo.bn // 2)
    launch(_GEMM, f"nvfp4_gemm_sorted_glu_{geo.suffix}", (geo.tiles(s, count) * n_blocks, 1, 1),
           (geo.threads, 1, 1),
           (x_TK, sorted_token_ids_S, expert_offsets, gate.packed_ptrs, gate.scale_ptrs, gate.scale2,
            up.packed_ptrs, up.scale_ptrs, up.scale2, i32(start), i32(count), act_SN, i32(gate.n),
            i32(gate.k), i32(n_blocks), np.float32(limit)), smem=geo.smem)

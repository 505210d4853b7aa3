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
from glm_ep.backend.cuda.loader import (BF16, GEMM_VARIANTS, I32, cdiv, check, check_shape, gemm_smem_bytes, i32,
                                        launch)
from glm_ep.backend.cuda.nvfp4 import Nvfp4Pointers

_GEMM = "gemm_nvfp4.cu"
# the variants (loader.GEMM_VARIANTS) gemm_nvfp4.cu instantiates; the default of each BM, the fastest
# measured on H200 (PREFILL.md's variant table): the 64-row tile takes 128-k stages where K allows,
# its 64-k twin otherwise (GEMM_FALLBACK); past 64 rows per expert the tiled engine's 128 x 128 tile
GEMM_DEFAULT = {16: (16, 1, 4, 64, 4), 32: (32, 1, 4, 64, 4), 64: (64, 1, 4, 128, 3), 128: (128, 2, 4, 64, 3)}
GEMM_FALLBACK = {(64, 1, 4, 128, 3): (64, 1, 4, 64, 4)}


@dataclass(frozen=True)
class GemmGeometry:
    bm: int  # sorted rows of one expert per block
    wm: int  # warps along the rows (1: the register engine, every warp on all BM rows)
    wn: int  # warps along the weight rows, 32 each
    bk: int  # k per pipeline stage
    stages: int

    @classmethod
    def of(cls, variant: tuple[int, int, int, int, int]) -> "GemmGeometry":
        if tuple(variant) not in GEMM_VARIANTS:
            raise ValueError(f"grouped GEMM variant {tuple(variant)}: gemm_nvfp4.cu instantiates (rows, warp rows, "
                             f"warp columns, k, stages) in {GEMM_VARIANTS}")
        return cls(*variant)

    @property
    def bn(self) -> int:  # weight rows per block (the fused GLU: half gate, half up)
        return 32 * self.wn

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn

    @property
    def smem(self) -> int:  # dynamic shared memory: the stages (+ two bf16 weight tiles when tiled)
        return gemm_smem_bytes(self.bm, self.wm, self.wn, self.bk, self.stages)

    @property
    def suffix(self) -> str:
        return f"m{self.bm}w{self.wn}k{self.bk}" if self.wm == 1 else f"m{self.bm}w{self.wm}x{self.wn}k{self.bk}"

    def tiles(self, slots: int, count: int) -> int:
        """Row tiles a launch must cover at most: every local expert's ceil(rows / BM), whatever the
        routing (the last tile of each expert that has rows may be partial)."""
        return cdiv(slots, self.bm) + min(count, slots)


def gemm_variant(slots: int, num_experts: int, k: int) -> tuple[int, int, int, int, int]:
    """The variant for a call: the smallest BM that holds the rows an expert gets on average (slots
    spread over all experts), so few-row widths do not pay for empty tile rows; a variant whose
    stage does not divide the in width ``k`` gives way to its fallback."""
    per_expert = slots / max(num_experts, 1)
    v = GEMM_DEFAULT[next((bm for bm in sorted(GEMM_DEFAULT) if per_expert <= bm), max(GEMM_DEFAULT))]
    return v if k % v[3] == 0 else GEMM_FALLBACK[v]


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
                      variant: tuple[int, int, int, int, int] | None = None) -> None:
    """Every local expert's expert-sorted rows in ONE tensor-core launch: sorted row i of expert e
    reads ``x[sorted_token_ids[i]]`` (``gather_rows``) or ``x[i]``; rows of remote experts untouched.
    ``variant``: one of ``GEMM_VARIANTS`` (default: ``gemm_variant``'s)."""
    proj, start, count = table.weights, table.start, table.count
    geo = GemmGeometry.of(variant or gemm_variant(sorted_token_ids_S.size, num_experts, proj.k))
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
                          variant: tuple[int, int, int, int, int] | None = None) -> None:
    """Gate, up and the clamped SwiGLU of every local expert's sorted rows in ONE launch (the token
    rows gathered through ``sorted_token_ids``); writes only ``act`` (gate and up stay in registers,
    each rounded to bf16 before the SwiGLU, as the separate ops round them)."""
    gate, up, start, count = experts.gate.weights, experts.up.weights, experts.start, experts.count
    if (gate.n, gate.k) != (up.n, up.k):
        raise ValueError(f"nvfp4_gemm_sorted_glu: gate [{gate.n}, {gate.k}] and up [{up.n}, {up.k}] differ")
    geo = GemmGeometry.of(variant or gemm_variant(sorted_token_ids_S.size, num_experts, gate.k))
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

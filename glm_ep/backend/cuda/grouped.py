"""Wrappers of the grouped NVFP4 prefill GEMM (``gemm_nvfp4.cu``): every local expert's expert-sorted
rows in ONE tensor-core launch per projection (gate + up + SwiGLU fused into one), the tile
variants it instantiates and the choice among them.

A launch with few tiles (one expert's rows: a dense FFN stored NVFP4, whose down projection at
N = 4096 is 32 weight-row blocks over K = 12288) splits K where the caller lends an fp32 scratch:
each split block streams its share of K and writes fp32 partial sums, and a second, small launch
(``nvfp4_gemm_reduce[_glu]``) adds them in split order and rounds once, as the unsplit epilogue does.

Shape suffixes: T rows, S expert-sorted slots, N/K a projection's out/in width.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from glm_ep.backend.base import ExpertTable, RoutedExperts
from glm_ep.backend.cuda.kernel_loader import (ARCH_SPECIFIC, BF16, F32, GEMM_SWEEP_FILE, GEMM_SWEEP_VARIANTS,
                                               GEMM_VARIANTS, I32, arch_build, block_smem_limit, cdiv, check,
                                               check_shape, compute_capability, current_device, gemm_smem_bytes,
                                               gemm_suffix, i32, i64, launch, sm_count)
from glm_ep.backend.cuda.routed import Nvfp4Pointers

_GEMM = "gemm_nvfp4.cu"
# the variants (loader.GEMM_VARIANTS) gemm_nvfp4.cu instantiates, and the default for calls whose experts get up to
# (key) rows each on average (past the largest key: its variant), the fastest measured (glm-ep bench --prefill's
# variant table; the runs in docs/perf/runs/2026-12-07-variants):
# - to 16 rows the narrow 16-row tile (x rows as the mma's n8 side) with the placed dequantization, which leaves
#   the integer pipe half the work of the lookup but pairs every x chunk: H100, gate + up + down at 64 / 128 rows
#   1500 / 1842 us against 1570 / 1945 on the same tile with the lookup (m16w4k128n, kept in the variant table),
#   level at 16, 256 and 512 rows; H200, the routed experts of one call at 128 / 256 rows 1700 / 1925 against
#   1776 / 1966. It takes 128-k stages where K allows, its 64-k twin otherwise (GEMM_FALLBACK);
# - past that the narrow 64-row tile, whose experts' last tiles leave out their empty 8-row x tiles;
# - on sm_90a, where x is staged, the wgmma engine's 64-row tile (two warpgroups, two blocks an SM) past 13 rows an
#   expert (GEMM_WGMMA_64_FROM): H100, gate + up + down at 512 rows (14.2 an expert) 2490 / 2485 us in two passes
#   against 2846 / 2901 on the lookup tile and 2867 / 2829 on the placed one; H200, the routed experts of one call
#   at 512 rows 2505 against 2634 on the lookup tile, but 2491 against 2415 at 448 rows (12.4) and 2483 against
#   2275 at 384 (10.7). Both changes in one call on an H100: the sparse site at 128 / 512 rows 1902 / 2912 ->
#   1857 / 2635 us (68 / 47% -> 70 / 51% of its roofline), level at 256..448;
# - and past 48 rows an expert its 128-row tile (GEMM_WGMMA_FROM: 256 weight rows x up to 128 rows a block; the
#   64-row narrow tile level with it between 42.7 and 56.9 rows an expert, docs/perf/runs/2026-12-06-h100-wgmma;
#   the two wgmma tiles level at 1024 rows in every table of 2026-12-07, the 128-row one 0.4-1.8% ahead at 1536).
GEMM_DEFAULT = {16: (16, 1, 4, 128, 3, "placed"), 64: (64, 1, 4, 64, 4, "narrow")}
GEMM_FALLBACK = {(16, 1, 4, 128, 3, "placed"): (16, 1, 4, 64, 4, "narrow")}
GEMM_WGMMA = (128, 2, 8, 64, 6, "wgmma")
GEMM_WGMMA_FROM = 48  # rows per expert past which the wgmma engine's 128-row tile is the default where it runs
GEMM_WGMMA_64 = (64, 2, 4, 64, 6, "wgmma")
GEMM_WGMMA_64_FROM = 13
# ONE expert (a dense FFN stored NVFP4: 192 blocks for gate + up, two thirds of a wave): the register engine up to
# 32 rows, where its tiles measured faster than the wgmma engine before the current one (docs/perf/DESIGN-NOTES.md;
# not re-measured against the current one)
GEMM_WGMMA_FROM_ONE = 32
Variant = tuple[int, int, int, int, int, str]
SPLIT_MAX = 8  # K splits of one launch at most
SPLIT_MIN_KBLOCKS = 8  # k stages a split streams at least (the pipeline's fill and drain amortized)
SPLIT_PARTIAL_BYTES = 8 << 20  # fp32 partial sums one split launch writes at most (so they stay in L2)
REDUCE_THREADS = 256
#: the expert widths (gate/up out, down in) every routed kernel takes: a multiple of the grouped GEMM's narrowest
#: stage of k, itself a multiple of the GEMVs' 32-k chunk (``routed.NVFP4_CHUNK``)
EXPERT_WIDTH_MULTIPLE = min(v[3] for v in GEMM_VARIANTS)


@dataclass(frozen=True)
class GemmGeometry:
    bm: int  # sorted rows of one expert per block
    wm: int  # warps along the rows (1: the register engine, every warp on all BM rows)
    wn: int  # warps along the weight rows, 32 each
    bk: int  # k per pipeline stage
    stages: int
    mma: str  # "sync" (mma.sync, the rows as its m16 side), "narrow" (mma.sync, the rows as its n8 side), "placed"
    # (narrow, the placed dequantization) or "wgmma"

    @classmethod
    def of(cls, variant: Variant) -> "GemmGeometry":
        if tuple(variant) not in GEMM_VARIANTS + GEMM_SWEEP_VARIANTS:
            raise ValueError(f"grouped GEMM variant {tuple(variant)}: gemm_nvfp4.cu instantiates (rows, warp rows, "
                             f"warp columns, k, stages, mma) in {GEMM_VARIANTS}, and its stage sweep's build in "
                             f"{GEMM_SWEEP_VARIANTS}")
        return cls(*variant)

    @property
    def file(self) -> str:  # the build its entries are in: the shipped one, or the stage sweep's
        return GEMM_SWEEP_FILE if self.variant in GEMM_SWEEP_VARIANTS else _GEMM

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

    @property
    def staged(self) -> bool:  # reads its x in the staged k order (``stage_k``): the wgmma engine
        return self.mma == "wgmma"

    @property
    def variant(self) -> Variant:
        return (self.bm, self.wm, self.wn, self.bk, self.stages, self.mma)

    def tiles(self, slots: int, count: int) -> int:
        """Row tiles a launch must cover at most: every local expert's ceil(rows / BM), whatever the
        routing. ceil(a) + ceil(b) <= ceil(a + b) + 1, so c experts that hold the ``slots`` rows
        between them need at most ceil(slots / BM) + c - 1 tiles (exactly ceil(slots / BM) for one)."""
        return cdiv(slots, self.bm) + min(count, slots) - 1 if slots and count else 0


def gemm_variant(slots: int, num_experts: int, k: int, wgmma: bool = False) -> Variant:
    """The variant for a call: ``GEMM_DEFAULT``'s for the rows an expert gets on average (slots spread over all
    experts), so few-row widths do not pay for empty tile rows; where ``wgmma`` runs
    (sm_90a), its engine past ``GEMM_WGMMA_FROM`` rows per expert (``GEMM_WGMMA_FROM_ONE`` for one), its 64-row
    tile past ``GEMM_WGMMA_64_FROM`` (several experts).
    A variant whose stage does not divide the in width ``k`` gives way to its fallback (the launch names
    the width if it has none)."""
    per_expert = slots / max(num_experts, 1)
    wgmma_from = GEMM_WGMMA_FROM if num_experts > 1 else GEMM_WGMMA_FROM_ONE
    if wgmma and per_expert > wgmma_from and k % GEMM_WGMMA[3] == 0:
        return GEMM_WGMMA
    if wgmma and num_experts > 1 and per_expert > GEMM_WGMMA_64_FROM and k % GEMM_WGMMA_64[3] == 0:
        return GEMM_WGMMA_64
    most = next((most for most in sorted(GEMM_DEFAULT) if per_expert <= most), max(GEMM_DEFAULT))
    return _fitting(GEMM_DEFAULT[most], k)


STAGE_K = 64  # the span of k the staged order permutes within
STAGE_THREADS = 256
STAGE_BLOCKS_PER_SM = 8  # the grid-stride loop's blocks an SM


def staged_order(k: int) -> np.ndarray:
    """The staged k order the wgmma engine reads its x rows in (``stage_k``): ``x_staged = x[:, staged_order(k)]``.
    In each 64 k, position ``16 s + 8 j + 2 t + e`` holds k ``16 t + 8 j + 4 e + s``: lane t's 16 k of a weight
    row, dequantized by bit placement, are then its wgmma fragments as they come (gemm_nvfp4_wgmma.cuh)."""
    if k % STAGE_K:
        raise ValueError(f"staged k order: width {k} is not a multiple of {STAGE_K}")
    s, j, t, e = np.meshgrid(np.arange(4), np.arange(2), np.arange(4), np.arange(2), indexing="ij")
    within = (16 * t + 8 * j + 4 * e + s).reshape(-1)  # position 16 s + 8 j + 2 t + e, in order
    return (np.arange(0, k, STAGE_K)[:, None] + within[None, :]).reshape(-1)


def stage_k(x_TK: Any, out_TK: Any) -> None:
    """``out = x[:, staged_order(k)]``: the rows of ``x`` in the wgmma engine's staged k order (one pass, a
    thread per 16 bytes of the output)."""
    check("x", x_TK, BF16, 16), check("out", out_TK, BF16, 16)
    if x_TK.ndim != 2 or x_TK.shape[1] % STAGE_K:
        raise ValueError(f"stage_k: x has shape {tuple(x_TK.shape)}, expected [rows, a multiple of {STAGE_K}]")
    check_shape("out", out_TK, x_TK.shape)
    pieces = x_TK.size // 8  # 16-byte pieces of the output, a thread each
    if pieces:
        grid = min(cdiv(pieces, STAGE_THREADS), STAGE_BLOCKS_PER_SM * sm_count())
        launch(_GEMM, "stage_k64", (grid, 1, 1), (STAGE_THREADS, 1, 1), (x_TK, out_TK, i64(pieces)))


def k_splits(blocks: int, kblocks: int, partial_floats: int, scratch_floats: int, sms: int) -> int:
    """K splits of a launch of ``blocks`` blocks (row tiles x weight-row blocks) over ``kblocks`` stages
    of k, each split writing ``partial_floats`` fp32 partial sums into a scratch of ``scratch_floats``:
    where the launch has fewer blocks than SMs, enough for two an SM, within ``SPLIT_MAX``,
    ``SPLIT_MIN_KBLOCKS`` stages a split, the scratch and ``SPLIT_PARTIAL_BYTES``; 1 (no split) where
    fewer than 2 would do. Measured (one expert of 12288 x 4096, docs/perf/DESIGN-NOTES.md): the down
    projection's 32 blocks run several times faster in 8 splits; gate + up's 192 blocks gain from 2 splits
    less than the reduce launch costs an eager call on the host."""
    if blocks >= sms or partial_floats <= 0:
        return 1
    splits = min(SPLIT_MAX, cdiv(2 * sms, max(blocks, 1)), kblocks // SPLIT_MIN_KBLOCKS,
                 scratch_floats // partial_floats, SPLIT_PARTIAL_BYTES // (4 * partial_floats))
    return splits if splits >= 2 else 1


def _splits(asked: int | None, blocks: int, kblocks: int, partial_floats: int, scratch: Any, what: str) -> int:
    """The call's K splits: ``asked`` (checked against the stages and the scratch), else ``k_splits``'s
    (none without a scratch)."""
    floats = 0 if scratch is None else scratch.size
    if asked is None:
        splits = k_splits(blocks, kblocks, partial_floats, floats, sm_count()) if floats else 1
    elif not 1 <= asked <= kblocks:
        raise ValueError(f"{what}: {asked} K splits, expected 1..{kblocks} (the in width's stages of k)")
    elif asked > 1 and asked * partial_floats > floats:
        raise ValueError(f"{what}: {asked} K splits need a float32 scratch of {asked * partial_floats} elements, "
                         f"{'got none' if scratch is None else f'got {floats}'}")
    else:
        splits = asked
    if splits > 1:  # only a scratch that will hold partial sums must be fp32, contiguous and aligned
        check("scratch", scratch, F32, 16)
    return splits


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


def _staged_checks(geo: GemmGeometry, x_staged: bool, what: str) -> None:
    if geo.staged != x_staged:
        raise ValueError(f"{what}: variant {geo.suffix} reads x in the "
                         + ("staged k order (stage_k's output; pass x_staged=True)" if geo.staged else
                            "natural k order; x_staged=True is for the wgmma variant"))


def _geometry(variant: Variant | None, x_size: int, slots: int, num_experts: int, k: int, what: str,
              staged: bool) -> GemmGeometry:
    """The call's variant: the one asked for (a wgmma one only where it runs), or ``gemm_variant``'s (the
    wgmma engine only for an x in the staged k order: ``staged``); an x too large for the tiled and wgmma
    engines' 32-bit offsets takes the register engine (asked for: a clear error)."""
    geo = GemmGeometry.of(variant or gemm_variant(slots, num_experts, k, staged and wgmma_here()))
    if variant is not None and (why := why_not_here(variant)):  # gemm_variant offers wgmma only where it runs
        raise ValueError(f"{what}: {why}")
    if (geo.wm > 1 or geo.mma == "wgmma") and x_size >= X_OFFSET_LIMIT:
        if variant is not None:
            raise ValueError(f"{what}: x has {x_size} elements; variant {geo.suffix} addresses it with 32-bit "
                             f"offsets (fewer than {X_OFFSET_LIMIT}); split the call")
        geo = GemmGeometry.of(_fitting(GEMM_DEFAULT[max(GEMM_DEFAULT)], k))  # the register engine
    return geo


def _slots(sorted_token_ids_S: Any, expert_offsets: Any, out_SN: Any, count: int, what: str) -> int:
    """The call's slot count: the sorted ids', or without a routing (``expert_offsets`` None: ONE local expert
    owns every row, in order) the output's rows."""
    if expert_offsets is not None:
        if sorted_token_ids_S is None:
            raise ValueError(f"{what}: expert_offsets without sorted_token_ids (a routing needs both, or neither for "
                             "one expert that takes every row)")
        return sorted_token_ids_S.size
    if sorted_token_ids_S is not None or count != 1:
        raise ValueError(f"{what}: without expert_offsets one local expert owns every row in order (no "
                         f"sorted_token_ids); got {count} local experts"
                         + ("" if sorted_token_ids_S is None else " and sorted_token_ids"))
    return out_SN.shape[0] if out_SN.ndim == 2 else 0


def _gemm_checks(x: Any, gather_rows: bool, sorted_token_ids_S: Any, expert_offsets: Any, num_experts: int,
                 k: int, out_SN: Any, n: int, s: int, geo: GemmGeometry, what: str) -> None:
    if k % geo.bk:
        raise ValueError(f"{what}: in width {k} is not a multiple of {geo.bk} (one grouped-GEMM stage)")
    if n % 8:
        raise ValueError(f"{what}: out width {n} is not a multiple of 8")
    check("x", x, BF16), check("out", out_SN, BF16)
    if expert_offsets is not None:
        check("sorted_token_ids", sorted_token_ids_S, I32, 4), check("expert_offsets", expert_offsets, I32, 4)
        check_shape("expert_offsets", expert_offsets, (num_experts + 1,))
    check_shape("out", out_SN, (s, n))
    in_order = not gather_rows or expert_offsets is None
    if x.ndim != 2 or x.shape[1] != k or (in_order and x.shape[0] != s):
        raise ValueError(f"{what}: x has shape {tuple(x.shape)}, expected [rows, {k}]"
                         + (f" with {s} rows" if in_order else ""))


def _ptr(a: Any) -> Any:
    """A device array, or the null pointer for None."""
    return np.uint64(0) if a is None else a


def _reduce(entry: str, scratch: Any, splits: int, s: int, expert_offsets: Any, start: int, count: int, out_SN: Any,
            n: int, *extra: Any) -> None:
    """A K split's second pass ``entry`` (``nvfp4_gemm_reduce[_glu]``): the splits' partial sums of the local
    experts' slots added in order into ``out`` [s, n], a thread per 4 columns; ``extra``: the entry's own
    trailing arguments."""
    launch(_GEMM, entry, (cdiv(s * n // 4, REDUCE_THREADS), 1, 1), (REDUCE_THREADS, 1, 1),
           (scratch, i32(splits), i32(s), _ptr(expert_offsets), i32(start), i32(count), out_SN, i32(n), *extra))


def nvfp4_gemm_sorted(x: Any, gather_rows: bool, sorted_token_ids_S: Any, expert_offsets: Any, num_experts: int,
                      table: ExpertTable[Nvfp4Pointers], out_SN: Any, variant: Variant | None = None,
                      scratch: Any = None, splits: int | None = None, x_staged: bool = False) -> None:
    """Every local expert's expert-sorted rows in ONE tensor-core launch: sorted row i of expert e
    reads ``x[sorted_token_ids[i]]`` (``gather_rows``) or ``x[i]``; rows of remote experts untouched.
    Without a routing (``sorted_token_ids`` and ``expert_offsets`` None) the table's one expert takes
    every row of x in order. ``variant``: one of ``GEMM_VARIANTS`` (default: ``gemm_variant``'s).
    ``scratch``: a float32 buffer whose contents are dead, for a K split's partial sums (``k_splits``;
    ``splits`` forces a count). ``x_staged``: x is in the staged k order (``stage_k``), which the wgmma
    variant reads and the others do not; the default variant for a natural x is never the wgmma one."""
    proj, start, count = table.weights, table.start, table.count
    s = _slots(sorted_token_ids_S, expert_offsets, out_SN, count, "nvfp4_gemm_sorted")
    geo = _geometry(variant, x.size, s, num_experts, proj.k, "nvfp4_gemm_sorted", x_staged)
    _staged_checks(geo, x_staged, "nvfp4_gemm_sorted")
    _gemm_checks(x, gather_rows, sorted_token_ids_S, expert_offsets, num_experts, proj.k, out_SN, proj.n, s, geo,
                 "nvfp4_gemm_sorted")
    n_blocks = cdiv(proj.n, geo.bn)
    blocks = geo.tiles(s, count) * n_blocks
    ks = _splits(splits, blocks, proj.k // geo.bk, s * proj.n, scratch, "nvfp4_gemm_sorted")
    if s == 0 or count == 0:
        return
    launch(geo.file, f"nvfp4_gemm_sorted_{geo.suffix}", (blocks, ks, 1), (geo.threads, 1, 1),
           (x, _ptr(sorted_token_ids_S if gather_rows else None), _ptr(expert_offsets), proj.packed_ptrs,
            proj.scale_ptrs, proj.scale2, i32(start), i32(count), out_SN, i32(proj.n), i32(proj.k),
            i32(n_blocks), _ptr(scratch if ks > 1 else None), i32(s)), smem=geo.smem)
    if ks > 1:
        _reduce("nvfp4_gemm_reduce", scratch, ks, s, expert_offsets, start, count, out_SN, proj.n)


def nvfp4_gemm_sorted_glu(x_TK: Any, sorted_token_ids_S: Any, expert_offsets: Any, num_experts: int,
                          experts: RoutedExperts[Nvfp4Pointers], limit: float, act_SN: Any,
                          variant: Variant | None = None, scratch: Any = None, splits: int | None = None,
                          x_staged: bool = False, act_staged: bool = False) -> None:
    """Gate, up and the clamped SwiGLU of every local expert's sorted rows in ONE launch (the token
    rows gathered through ``sorted_token_ids``; without a routing, as ``nvfp4_gemm_sorted``, every row
    of x in order); writes only ``act`` (gate and up stay in registers, each rounded to bf16 before the
    SwiGLU, as the separate ops round them). ``scratch`` / ``splits`` / ``x_staged``: as
    ``nvfp4_gemm_sorted``'s (a split writes gate's and up's partial sums). ``act_staged`` (the wgmma variant):
    act written in the staged k order, as the down projection's wgmma variant reads it."""
    gate, up, start, count = experts.gate.weights, experts.up.weights, experts.start, experts.count
    if (gate.n, gate.k) != (up.n, up.k):
        raise ValueError(f"nvfp4_gemm_sorted_glu: gate [{gate.n}, {gate.k}] and up [{up.n}, {up.k}] differ")
    s = _slots(sorted_token_ids_S, expert_offsets, act_SN, count, "nvfp4_gemm_sorted_glu")
    geo = _geometry(variant, x_TK.size, s, num_experts, gate.k, "nvfp4_gemm_sorted_glu", x_staged)
    _staged_checks(geo, x_staged, "nvfp4_gemm_sorted_glu")
    if act_staged and not geo.staged:
        raise ValueError(f"nvfp4_gemm_sorted_glu: act_staged is for the wgmma variant; this call takes {geo.suffix}")
    if act_staged and gate.n % STAGE_K:
        raise ValueError(f"nvfp4_gemm_sorted_glu: act_staged needs a width that is a multiple of {STAGE_K}; "
                         f"got {gate.n}")
    _gemm_checks(x_TK, True, sorted_token_ids_S, expert_offsets, num_experts, gate.k, act_SN, gate.n, s, geo,
                 "nvfp4_gemm_sorted_glu")
    n_blocks = cdiv(gate.n, geo.bn // 2)
    blocks = geo.tiles(s, count) * n_blocks
    ks = _splits(splits, blocks, gate.k // geo.bk, 2 * s * gate.n, scratch, "nvfp4_gemm_sorted_glu")
    if s == 0 or count == 0:
        return
    launch(geo.file, f"nvfp4_gemm_sorted_glu_{geo.suffix}", (blocks, ks, 1), (geo.threads, 1, 1),
           (x_TK, _ptr(sorted_token_ids_S), _ptr(expert_offsets), gate.packed_ptrs, gate.scale_ptrs, gate.scale2,
            up.packed_ptrs, up.scale_ptrs, up.scale2, i32(start), i32(count), act_SN, i32(gate.n),
            i32(gate.k), i32(n_blocks), np.float32(limit), _ptr(scratch if ks > 1 else None), i32(s),
            i32(act_staged)),
           smem=geo.smem)
    if ks > 1:
        _reduce("nvfp4_gemm_reduce_glu", scratch, ks, s, expert_offsets, start, count, act_SN, gate.n,
                np.float32(limit))


def _stage_holds(stage: Any, x_TK: Any) -> bool:
    return stage is not None and stage.size >= x_TK.size


def stage_view(stage: Any, x_TK: Any) -> Any:
    """Where ``nvfp4_experts_sorted`` stages x: the first ``x.size`` elements of the contiguous buffer ``stage`` in
    x's shape, or None where there is no buffer or it cannot hold x."""
    return stage.reshape(-1)[:x_TK.size].reshape(x_TK.shape) if _stage_holds(stage, x_TK) else None


def experts_geometry(x_TK: Any, slots: int, num_experts: int, experts: RoutedExperts[Nvfp4Pointers],
                     stage: Any) -> tuple[GemmGeometry, GemmGeometry]:
    """The geometries ``nvfp4_experts_sorted`` gives gate + up and down: the defaults, except that the wgmma
    variant runs for both or for neither (its act is in the staged k order, which only it reads), and only
    with a ``stage`` buffer to stage x into (None: none)."""
    return _experts_geometry(x_TK.size, slots, num_experts, experts.gate.weights.k, experts.gate.weights.n,
                             experts.down.weights.k, _stage_holds(stage, x_TK), wgmma_here())


@functools.lru_cache(maxsize=4096)
def _experts_geometry(x_size: int, slots: int, num_experts: int, k_glu: int, n_glu: int, k_down: int,
                      can_stage: bool, wgmma: bool) -> tuple[GemmGeometry, GemmGeometry]:
    """``experts_geometry``'s choice, cached: a prefill call makes it on the host before its launches."""
    sizes = ((x_size, k_glu), (slots * n_glu, k_down))
    if can_stage and wgmma:
        glu, down = (_geometry(None, size, slots, num_experts, k, "nvfp4_experts_sorted", True) for size, k in sizes)
        if glu.staged and down.staged:
            return glu, down
    glu, down = (_geometry(None, size, slots, num_experts, k, "nvfp4_experts_sorted", False) for size, k in sizes)
    return glu, down


def nvfp4_experts_sorted(x_TK: Any, sorted_token_ids_S: Any, expert_offsets: Any, num_experts: int,
                         experts: RoutedExperts[Nvfp4Pointers], limit: float, act_SM: Any, out_SN: Any,
                         stage: Any = None, scratch: Any = None) -> None:
    """The routed experts of every local expert's sorted rows: gate + up + SwiGLU into ``act``, then down into
    ``out`` (``experts_geometry``'s variants). Where that is the wgmma variant, x is first staged into the first
    ``x.size`` elements of ``stage`` (a contiguous bf16 buffer whose contents are dead; ``stage_k``) and act
    written and read in the staged k order; ``act`` then holds the staged order. ``scratch``: as
    ``nvfp4_gemm_sorted``'s."""
    s = _slots(sorted_token_ids_S, expert_offsets, act_SM, experts.count, "nvfp4_experts_sorted")
    glu, down = experts_geometry(x_TK, s, num_experts, experts, stage)
    if not glu.staged:  # the two launches' own defaults, for an x in the natural k order
        nvfp4_gemm_sorted_glu(x_TK, sorted_token_ids_S, expert_offsets, num_experts, experts, limit, act_SM,
                              scratch=scratch)
        nvfp4_gemm_sorted(act_SM, False, sorted_token_ids_S, expert_offsets, num_experts, experts.down, out_SN,
                          scratch=scratch)
        return
    if x_TK.ndim != 2 or x_TK.shape[1] != experts.gate.weights.k:  # before x is staged
        raise ValueError(f"nvfp4_experts_sorted: x has shape {tuple(x_TK.shape)}, expected [rows, "
                         f"{experts.gate.weights.k}]")
    check("stage", stage, BF16, 16)
    xs = stage_view(stage, x_TK)
    stage_k(x_TK, xs)
    nvfp4_gemm_sorted_glu(xs, sorted_token_ids_S, expert_offsets, num_experts, experts, limit, act_SM,
                          variant=glu.variant, scratch=scratch, x_staged=True, act_staged=True)
    nvfp4_gemm_sorted(act_SM, False, sorted_token_ids_S, expert_offsets, num_experts, experts.down, out_SN,
                      variant=down.variant, scratch=scratch, x_staged=True)


DEQUANT_THREADS = 256
DEQUANT_BLOCKS_PER_SM = 8  # the grid-stride loop's blocks an SM


def nvfp4_dequant_bf16(proj: Nvfp4Pointers, local: int, out_NK: Any) -> None:
    """Local expert ``local``'s projection as exact bf16 ``e2m1 * e4m3`` into ``out`` [n, k] (``scale_2`` left
    for the GEMM that reads it to apply to its fp32 sums): the operand of a bf16 GEMM at compute-bound widths."""
    if not 0 <= local < len(proj.packed):
        raise ValueError(f"nvfp4_dequant_bf16: local expert {local}, the table holds {len(proj.packed)}")
    check("out", out_NK, BF16), check_shape("out", out_NK, (proj.n, proj.k))
    words = proj.n * proj.k // 8  # 32-bit words of packed weights, a thread each
    if words == 0:
        return
    grid = min(cdiv(words, DEQUANT_THREADS * 4), DEQUANT_BLOCKS_PER_SM * sm_count())
    launch(_GEMM, "nvfp4_dequant_bf16", (grid, 1, 1), (DEQUANT_THREADS, 1, 1),
           (proj.packed[local], proj.scale[local], out_NK, i64(words)))

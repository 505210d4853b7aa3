"""How the one-row routed kernels run: the frozen lever set of the persistent decode ring
(``gemv_nvfp4_ring.cu``), held by the CUDA backend from its construction, and its launch geometry.

The ring reads each projection in one of these operand forms, chosen once at weight upload
(``RingConfig.forms``); the block kernels (``gemv_nvfp4.cu``, the ring off) read ``bf16``:
- ``bf16``: the dequantized weight (e2m1 times its block scale) as bf16, one mma chain over K;
- ``bf16u``: the unscaled e2m1 as bf16, the block scale applied to each 16-k group's fp32 partial;
  the input as it is, so exact for any bf16 input (gate and up, and the down projection where the
  limit does not bound the activation);
- ``placed`` (the down projection): the unscaled bf16 form with the weights decoded by bit placement
  (e2m1 x 2^-126, no table) and x paired to match and scaled by a power of two fixed at upload from
  the activation's bound (``act_shift``; the form is not taken where the limit does not bound it below
  2^113), so every product is a normal fp32. The same products as ``bf16u``, paired in another order;
- ``f16``: the same as ``bf16u`` with fp16 operands, the input rounded to fp16: exact only while the
  input fits fp16 (|v| <= 65504). The down projection reads the clamped SwiGLU, bounded by the site's
  ``swiglu_limit``; the form is refused where the limit does not bound it. Gate and up read the
  hidden state, which nothing bounds: the fp16 form there is an explicit opt-in (``f16_hidden``).
Why each default is what it is, and the command that re-measures it: docs/perf/DESIGN-NOTES.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from glm_ep.backend.cuda.kernel_loader import (BF16, MMA_ROWS, RING_KERNELS, RING_WARPS, UNION_RING_ROWS, cdiv,
                                               ring_stage_bytes, sm_count, smem_per_sm)
from glm_ep.errors import ConfigError
from glm_ep.config.topology import PathLevers, check_ring_geometries

RING_STEP_K = 128  # k per step of the ring kernels; a ring stage is a slab of T steps (K a multiple)
RING_MAX_SLOTS = 32  # slots of one launch: lane j of a warp holds slot j's ids and pointers
F16_MAX = 65504.0
# operand form -> the ring entry's name prefix
FORM_PREFIX = {"bf16u": "bf16u_", "placed": "pl_", "f16": "f16_"}
RING_SLAB, RING_DEPTH = RING_KERNELS[0]  # one projection's one geometry: 128-k steps per stage, stages per warp
SILU_MIN = -0.2785  # the least value of silu(g) = g / (1 + exp(-g))


def act_bound(swiglu_limit: float) -> float:
    """The largest |clamped SwiGLU output|: ``|silu(min(g, L)) * clamp(u, -L, L)|`` is at most
    ``max(L, 0.2785) * L``, rounded to bf16 once (the activation's rounding); inf for no finite limit."""
    if not math.isfinite(swiglu_limit):
        return math.inf
    bound = np.float32(max(swiglu_limit, -SILU_MIN)) * np.float32(swiglu_limit)
    return float(np.array(bound, np.float32).astype(BF16))


def act_fits_f16(swiglu_limit: float) -> bool:
    """Whether every clamped SwiGLU output fits fp16."""
    return act_bound(swiglu_limit) <= F16_MAX


PLACED_TOP = 120  # the placed form scales x so that its largest |value| is below 2^PLACED_TOP
PLACED_MIN_SHIFT = 7  # ... by at least 2^7, else small activations' products leave fp32's normal range


def act_shift(swiglu_limit: float) -> int:
    """The placed down projection's x scale 2^shift: the activation's bound below 2^PLACED_TOP, at most
    2^127 (a bf16 power of two); 0 where no shift >= PLACED_MIN_SHIFT does it (no placed form then).
    A contract on the projection's input: a clamped SwiGLU of this limit, as the site computes it; an
    input past the bound times 2^(128 - PLACED_TOP) would overflow to inf in the kernel."""
    bound = act_bound(swiglu_limit)
    if not math.isfinite(bound) or bound <= 0:
        return 0
    shift = min(127, PLACED_TOP - math.frexp(bound)[1])  # bound < 2^e
    return shift if shift >= PLACED_MIN_SHIFT else 0


@dataclass(frozen=True)
class RingConfig:
    """The ring levers (``[levers] ring*`` of the topology): the persistent ring (``enabled``) or
    gemv_nvfp4.cu's block-per-tile kernels. The decode ring's slab and depth are RING_SLAB and
    RING_DEPTH for one projection, ``glu_slab`` / ``glu_depth`` for gate + up (one of RING_GLU_KERNELS);
    the warps per SM its grid aims at (fewer where the rings' shared memory does not fit); ``max_warps``
    caps the grid (tests: several items per warp); ``f16``: the down projection in the fp16 form;
    ``f16_hidden``: gate and up too; ``placed``: the down projection decoded by bit placement (the
    ``placed`` form, where the limit bounds the activation; else ``bf16u``); ``down_combine``: at one row,
    the shared expert's down projection and the site's combine run inside the routed down launch;
    ``union_*``: the verify (union) ring, by P, the matrices a warp sweeps (index 0: one projection, 1: gate
    + up), its slab (T steps of 128 k per stage) and depth; ``min_items_per_sm``: a launch with fewer (slot x
    16-row group) items an SM goes to the block kernels, which split K (0: never); ``claims``: a warp's items past
    its first are claimed from a device counter (two uint32 of scratch, ``ring_claims``) where a launch's items give
    its warps 3 or more each (``kernel_loader.RING_CLAIMS_MIN_ITEMS``), so warps that stream faster take more and the
    launch's warps finish together, instead of every W-th item. Each default's
    measurement: docs/perf/DESIGN-NOTES.md."""

    enabled: bool = True
    warps_per_sm: int = 16
    max_warps: int = 0
    f16: bool = False  # consume_slab_unscaled's fp16 form (F = 1) on the down projection
    f16_hidden: bool = False
    placed: bool = True  # the down projection in the placed form, where the limit bounds it
    down_combine: bool = True  # one-row sites: the shared expert's down projection and the combine in the down ring
    union_max_rows: int = 4  # verify groups of 2..this many rows on the union ring (bf16 form)
    union_slab: tuple[int, int] = (2, 2)
    union_depth: tuple[int, int] = (3, 3)
    min_items_per_sm: int = 4  # ONE expert's down projection at one row (a dense FFN stored NVFP4) falls below
    glu_slab: int = 4  # the decode ring's gate + up (RING_GLU_KERNELS)
    glu_depth: int = 2
    claims: bool = True  # a warp's items past its first claimed from a device counter (the workspace's ring_claims)

    def __post_init__(self) -> None:
        if self.enabled:  # as the topology checks its levers (a RingConfig built in code too)
            check_ring_geometries((self.glu_slab, self.glu_depth), self.union_slab, self.union_depth)

    @classmethod
    def from_levers(cls, lv: PathLevers) -> "RingConfig":
        return cls(lv.ring, lv.ring_warps_per_sm, lv.ring_max_warps, lv.ring_f16, lv.ring_f16_hidden, lv.ring_placed,
                   lv.ring_down_combine, lv.ring_union_max_rows, tuple(lv.ring_union_slab),
                   tuple(lv.ring_union_depth), lv.ring_min_items_per_sm, lv.ring_glu_slab, lv.ring_glu_depth,
                   lv.ring_claims)

    def forms(self, swiglu_limit: float) -> tuple[str, str]:
        """(gate and up, down): the operand form (``FORM_PREFIX``'s keys; ``bf16`` for the block kernels, the
        ring off) in which each projection is read, decided once for a site's experts. A ConfigError where
        ``f16`` asks for the down projection's fp16 form and ``swiglu_limit`` does not keep the activation
        inside fp16."""
        if not self.enabled:
            return "bf16", "bf16"
        if self.f16 and not act_fits_f16(swiglu_limit):
            raise ConfigError(f"levers.ring_f16 = true: the routed down projection's fp16 form is exact only while "
                              f"every activation fits fp16 (|act| <= swiglu_limit^2 <= {F16_MAX:g}), and "
                              f"swiglu_limit = {swiglu_limit:g} does not bound it there; set ring_f16 = false")
        act = "placed" if self.placed and act_shift(swiglu_limit) else "bf16u"
        return "f16" if self.f16 and self.f16_hidden else "bf16u", "f16" if self.f16 else act

    def takes(self, n: int, k: int, slots: int, p: int) -> bool:
        """Whether the ring serves a launch of ``slots`` slots of ``p`` [n, k] matrices: the shapes it is
        built for, with at least ``min_items_per_sm`` items an SM (a warp takes whole items, K unsplit)."""
        return (self.enabled and n % MMA_ROWS == 0 and k > 0 and k % (RING_STEP_K * self.stages(p)[0]) == 0
                and slots <= RING_MAX_SLOTS
                and (not self.min_items_per_sm or slots * (n // MMA_ROWS) >= self.min_items_per_sm * sm_count()))

    def geometry(self, n: int, slots: int, p: int, form: str, extra_items: int = 0) -> tuple[int, int, str]:
        """(blocks, dynamic smem bytes, entry suffix): as even a share of the slots x row-group items
        (and ``extra_items``) per warp as the cap allows (warps_per_sm per SM, or fewer where the
        rings do not fit in the device's shared memory), RING_WARPS per block."""
        smem, (slab, depth) = self.smem(p), self.stages(p)
        return (self._blocks(slots * (n // MMA_ROWS) + extra_items, smem), smem,
                f"{FORM_PREFIX[form]}t{slab}_d{depth}")

    def stages(self, p: int) -> tuple[int, int]:
        """(slab, depth) of the decode ring over ``p`` matrices: one projection's, or gate + up's."""
        return (self.glu_slab, self.glu_depth) if p == 2 else (RING_SLAB, RING_DEPTH)

    def smem(self, p: int) -> int:
        """Dynamic shared memory of one block of the ring over ``p`` matrices: RING_WARPS rings of depth stages."""
        slab, depth = self.stages(p)
        return RING_WARPS * depth * ring_stage_bytes(p, slab)

    def union_smem(self, p: int, rows: int) -> int:
        """Dynamic shared memory of one block of the union ring over ``p`` matrices for ``rows`` rows (the stage
        holds them rounded up to an instantiated R)."""
        r = next(r for r in UNION_RING_ROWS if rows <= r)
        return RING_WARPS * self.union_depth[p - 1] * ring_stage_bytes(p, self.union_slab[p - 1], r)

    def check_fits(self, limit: int) -> None:
        """A ConfigError naming the levers where a ring block needs more shared memory than ``limit``, what one
        block of the device may have: such a launch would be refused at the first step (a gate + up block takes
        40960 bytes on the decode ring, 69632 on the union ring at slab 4 and 8 rows; a GB10 gives 101376)."""
        if not self.enabled:
            return
        for p in (1, 2):
            if self.smem(p) > limit:
                raise ConfigError(f"levers.ring = true: a block of the decode ring over "
                                  f"{'gate + up' if p == 2 else 'one projection'} needs {self.smem(p)} bytes of "
                                  f"shared memory, this device allows {limit} a block; set ring = false (the block "
                                  "kernels)")
        union_rows = min(self.union_max_rows, UNION_RING_ROWS[-1])
        for p in (1, 2) if union_rows >= 2 else ():
            need = self.union_smem(p, union_rows)
            if need > limit:
                slab, depth = self.union_slab, self.union_depth
                raise ConfigError(f"levers.ring_union_slab = {list(slab)}, ring_union_depth = {list(depth)}: a block "
                                  f"of the union ring over {'gate + up' if p == 2 else 'one projection'} (slab "
                                  f"{slab[p - 1]}, depth {depth[p - 1]}, {union_rows} rows) needs {need} bytes of "
                                  f"shared memory, this device allows {limit} a block; choose a smaller slab or "
                                  "depth, or fewer ring_union_max_rows")

    def down_combine_parts(self, n: int, k: int, shared_k: int) -> int:
        """K slices of the shared expert's down projection [n, shared_k] when it runs as extra items
        of the routed down ring ([n, k] per expert; ``nvfp4_ring_moe_down_combine``), 0 where it
        cannot: a shared item sweeps as many slabs as a routed one, 32 T k each (a bf16 slab fills a
        stage row's 64 T bytes), so shared_k must be a multiple of that span."""
        t = RING_SLAB
        if not self.down_combine or n % MMA_ROWS or k % (RING_STEP_K * t) or shared_k <= 0:
            return 0
        span = 32 * t * (k // (RING_STEP_K * t))
        return shared_k // span if shared_k % span == 0 else 0

    def union_takes(self, n: int, k: int, rows: int, p: int) -> bool:
        """Whether the union ring serves ``rows`` rows of ``p`` [n, k] matrices."""
        return (self.enabled and 2 <= rows <= min(self.union_max_rows, UNION_RING_ROWS[-1])
                and n % MMA_ROWS == 0 and k > 0 and k % (RING_STEP_K * self.union_slab[p - 1]) == 0)

    def union_geometry(self, n: int, rows: int, entries: int, p: int) -> tuple[int, int, str]:
        """(blocks, dynamic smem bytes, entry suffix) of a union launch over its entries x row groups;
        the stage holds the rows rounded up to an instantiated R."""
        t, depth = self.union_slab[p - 1], self.union_depth[p - 1]
        r = next(r for r in UNION_RING_ROWS if rows <= r)
        smem = self.union_smem(p, rows)
        return self._blocks(entries * (n // MMA_ROWS), smem), smem, f"r{r}_t{t}_d{depth}"

    def _blocks(self, items: int, smem: int) -> int:
        """As even a share of ``items`` per warp as the cap allows (warps_per_sm per SM, or fewer
        where the rings' ``smem`` per block does not fit the device), RING_WARPS per block."""
        sm_smem, reserved = smem_per_sm()  # each resident block costs its own smem and the reserved part
        per_sm = min(self.warps_per_sm, sm_smem // (smem + reserved) * RING_WARPS)
        items = max(1, items)
        cap = max(1, sm_count() * per_sm)
        if self.max_warps:
            cap = min(cap, self.max_warps)
        return cdiv(cdiv(items, cdiv(items, cap)), RING_WARPS)

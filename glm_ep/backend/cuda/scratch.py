"""The CUDA backend's scratch, declared for the workspace to make once at load (``Backend.buffers``): the counters
and partial sums its kernels keep between the blocks of one launch. Nothing here imports CuPy at import time."""

from __future__ import annotations

from typing import Any

import numpy as np

from glm_ep.backend.cuda import dense
from glm_ep.backend.cuda.kernel_loader import F32, I32, MMA_ROWS, U32, sm_count
from glm_ep.backend.cuda.ring import RingConfig
from glm_ep.config.model import SiteConfig
from glm_ep.config.topology import PathLevers
from glm_ep.mlp.workspace import Buffer

SCRATCH = "backend scratch"  # the footprint report's line for the buffers below


def scratch_buffers(ring: RingConfig, cfg: SiteConfig, levers: PathLevers) -> tuple[Buffer, ...]:
    """The stack scratch of the backend's ops for sites of ``cfg``'s geometry (``Backend.buffers``), sized once:

    | buffer                  | what reads it                                | size                                |
    |-------------------------|----------------------------------------------|-------------------------------------|
    | `route_done`            | the fused router's block counter (1..8 rows) | 1 uint32, zero between launches     |
    | `wstream_partials`,     | the warp-streaming GEMM's K split (the dense | `dense.wstream_scratch_sizes()`:    |
    | `wstream_arrived`       | FFN at 5..16 rows, the shared expert at 5..8)| fp32 sums, uint32 counters (zero)   |
    | `down_combine_partials`,| the one-row down ring's combine, where the   | parts x hidden fp32, hidden / 16    |
    | `down_combine_arrived`  | ring takes the site's shapes                 | uint32 counters (zero)              |
    | `sort_counts`           | the multi-block sort by expert (wide calls,  | SMs x experts int32 (152 KB for 288 |
    |                         | never captured) where the sorted path runs   | experts on 132 SMs)                 |
    | `ring_claims`           | the ring kernels' item counter and their     | 2 uint32 (zero), where the ring     |
    |                         | warps done (``RingConfig.claims``)           | claims items                        |
    """
    h, lv = cfg.hidden, levers
    n_partials, n_arrived = dense.wstream_scratch_sizes()
    parts = ring.down_combine_parts(h, cfg.moe_intermediate, cfg.local_shared_intermediate)
    counts = sm_count() * cfg.num_experts if lv.prefill_gemm and not lv.host_dispatch else 0
    claims = 2 if ring.enabled and ring.claims else 0
    note = ("the CUDA kernels' counters and partial sums: the fused router, the K-split GEMM, the one-row down "
            "ring's combine, the wide sort's counts, the rings' item claims; one for the stack")

    def buf(name: str, dtype: Any, elements: Any, zeroed: bool = False) -> Buffer:
        return Buffer(name, np.dtype(dtype), elements, zeroed, stack=SCRATCH, note=note)

    return (buf("route_done", U32, lambda r: 1, zeroed=True),
            buf("wstream_partials", F32, lambda r: n_partials),
            buf("wstream_arrived", U32, lambda r: n_arrived, zeroed=True),
            buf("down_combine_partials", F32, lambda r: parts * h),
            buf("down_combine_arrived", U32, lambda r: h // MMA_ROWS if parts else 0, zeroed=True),
            buf("sort_counts", I32, lambda r: counts if r >= lv.prefill_gemm_min_rows else 0),
            buf("ring_claims", U32, lambda r: claims, zeroed=True))

"""Wrapper of ``expert_map.cu``: a placement's map of global expert ids to physical slots, on the device.

Shape suffixes: T rows, K top-k, E experts, W the most replicas of one expert.
"""

from __future__ import annotations

from typing import Any

from glm_ep.backend.cuda.kernel_loader import ELEM_THREADS, I32, cdiv, check, check_shape, i32, launch


def map_expert_ids(ids_TK: Any, table_EW: Any, nrep_E: Any, out_TK: Any) -> None:
    """``out[s] = table[ids[s], s % nrep[ids[s]]]`` for every slot s (``glm_ep.mlp.expert_map.map_ids``), in one
    launch that reads nothing back to the host; ``out`` may be ``ids``."""
    check("ids", ids_TK, I32, 4), check("out", out_TK, I32, 4), check_shape("out", out_TK, ids_TK.shape)
    check("table", table_EW, I32, 4), check("nrep", nrep_E, I32, 4)
    if table_EW.ndim != 2 or nrep_E.shape != (table_EW.shape[0],):
        raise ValueError(f"map_expert_ids: table {tuple(table_EW.shape)} and nrep {tuple(nrep_E.shape)}, expected "
                         "[E, W] and [E]")
    n = ids_TK.size
    if n:
        launch("expert_map.cu", "map_expert_ids", (cdiv(n, ELEM_THREADS), 1, 1), (ELEM_THREADS, 1, 1),
               (ids_TK, out_TK, i32(n), table_EW, i32(table_EW.shape[1]), nrep_E))

"""Global expert ids -> physical expert slots: the dispatch side of a load-aware placement.

A placement (``glm_ep.balance.eplb``) lays ``P = E + R`` physical expert slots over the ``ep`` expert
groups, ``P / ep`` each: group ``g`` holds slots ``[g*P/ep, (g+1)*P/ep)``, and ``phys_expert[p]`` is the
expert in slot ``p`` (an expert with replicas sits in several). The router still ranks all ``E`` experts;
right after routing, each chosen id is replaced by one of its slots, so every path (decode, union, sorted,
host) sees ids in the physical space and its ``[start, start + count)`` test of locality is unchanged: a slot
held by another group is remote and adds exactly zero.

Replica rule: slot ``s`` of a call (its flat index ``t * K + k``) that chose expert ``e`` takes replica
``s % nrep[e]`` of ``e``'s slots, in slot order: round robin over the call's slots, a function of the ids and
their positions alone, so every rank picks the same replica, and on a device it is one gather with no host
sync (``Backend.map_expert_ids``).

Shape suffixes: T rows, K top-k, E experts, W the most replicas of one expert, P physical slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def replica_table(phys_expert_P: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """``(table [E, W], nrep [E])``, int32: ``table[e, :nrep[e]]`` are the slots of expert ``e`` in
    increasing order (the rest repeat its first). ValueError where an expert has no slot or an entry is
    not an expert id (a placement is checked with names before it gets here)."""
    phys = np.asarray(phys_expert_P, dtype=np.int64)
    if phys.ndim != 1 or phys.size and (phys.min() < 0 or phys.max() >= num_experts):
        raise ValueError(f"phys_expert: expected expert ids in 0..{num_experts - 1}, got {phys.tolist()}")
    nrep = np.bincount(phys, minlength=num_experts).astype(np.int32)
    if nrep.min(initial=1) < 1:
        raise ValueError(f"phys_expert: experts {np.flatnonzero(nrep == 0).tolist()} have no slot")
    by_expert = np.argsort(phys, kind="stable")  # the slots of expert 0, then of expert 1, ..., each in order
    first_E = np.concatenate([[0], np.cumsum(nrep)[:-1]])
    j_W = np.arange(int(nrep.max(initial=1)))
    table = by_expert[first_E[:, None] + j_W[None, :] % nrep[:, None]].astype(np.int32)
    return table, nrep


def map_ids(ids_TK: np.ndarray, table_EW: np.ndarray, nrep_E: np.ndarray) -> np.ndarray:
    """The replica rule on NumPy (the twin of the device gather): ``[T, K]`` int32 physical slots."""
    ids = np.asarray(ids_TK, dtype=np.int64)
    s = np.arange(ids.size, dtype=np.int64).reshape(ids.shape)
    return np.asarray(table_EW)[ids, s % np.asarray(nrep_E)[ids]].astype(np.int32)


@dataclass(frozen=True)
class ExpertMap:
    """One sparse layer's map, resident on a backend (``table`` and ``nrep`` on its device)."""

    table_EW: Any  # int32 [E, W]
    nrep_E: Any  # int32 [E]

    @classmethod
    def upload(cls, be: Any, phys_expert_P: np.ndarray, num_experts: int) -> "ExpertMap":
        table, nrep = replica_table(phys_expert_P, num_experts)
        return cls(be.asarray(table), be.asarray(nrep))

    def __call__(self, be: Any, ids_TK: Any) -> Any:
        """``ids`` (global expert ids, as routed) replaced in place by their physical slots."""
        return be.map_expert_ids(ids_TK, self.table_EW, self.nrep_E, ids_TK)

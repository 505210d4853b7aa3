"""Balance by counting: what each rank runs and reads of one call's routed experts, under a layout.

A layout (``ExpertLayout``) is ``ep`` expert groups of ``moe_tp`` consecutive ranks over ``P`` physical expert
slots, ``P / ep`` a group, group ``g`` holding slots ``[g*P/ep, (g+1)*P/ep)``: a placement's
(``glm_ep.balance.eplb``, with replicas ``P > E``) or the contiguous ranges (slot ``p`` = expert ``p``).
Chosen ids map to slots by the runtime's own replica rule (``glm_ep.mlp.expert_map``). For one call's ids
``[T, K]`` of one sparse layer, per rank:

* slots: the (row, slot) pairs whose expert slot the rank's group holds; each rank of a group runs every
  one of them, over its ``1 / moe_tp`` of the expert's width;
* routed bytes: the expert weight bytes the rank reads: each distinct slot its group holds that the call
  chose, once (a call sweeps each chosen expert once), at ``1 / moe_tp`` of an expert's bytes.

The all-reduce waits for the busiest rank, so a call costs its max over the ranks: ``Imbalance`` keeps
``E[max] / E[mean]`` over calls (what a step pays), and the max / mean of the load summed over the calls (what
a placement evens out; per call, a few hundred slots a rank still scatter by their square root).

Shape suffixes: T rows, K top-k, E experts, P physical slots, R ranks (``ep * moe_tp``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from glm_ep.app.footprint import nvfp4_bytes
from glm_ep.mlp.expert_map import map_ids, replica_table


@dataclass(frozen=True)
class ExpertLayout:
    """One sparse layer's experts on the ranks: ``ep`` groups of ``moe_tp`` ranks over ``phys_expert``."""

    ep: int
    moe_tp: int
    phys_expert_P: np.ndarray  # the expert in each physical slot, group-major

    @classmethod
    def contiguous(cls, num_experts: int, ep: int, moe_tp: int = 1) -> "ExpertLayout":
        """The default: group ``g`` holds experts ``[g*E/ep, (g+1)*E/ep)``."""
        return cls(ep, moe_tp, np.arange(num_experts, dtype=np.int32))

    @property
    def ranks(self) -> int:
        return self.ep * self.moe_tp

    @property
    def group_slots(self) -> int:
        return len(self.phys_expert_P) // self.ep

    @functools.cached_property
    def _table(self) -> tuple[np.ndarray, np.ndarray]:
        return replica_table(self.phys_expert_P, int(np.max(self.phys_expert_P)) + 1)

    def physical(self, ids_TK: np.ndarray) -> np.ndarray:
        """The slots the runtime sends ``ids`` to (``glm_ep.mlp.expert_map``'s replica rule)."""
        return map_ids(ids_TK, *self._table)


def expert_slice_bytes(hidden: int, moe_intermediate: int, moe_tp: int = 1) -> int:
    """NVFP4 bytes of one rank's slice of one routed expert (gate, up and down; ``weight_scale_2`` whole)."""
    m = moe_intermediate // moe_tp
    return 2 * nvfp4_bytes(m, hidden) + nvfp4_bytes(hidden, m)


def rank_slots(phys_TK: np.ndarray, layout: ExpertLayout) -> np.ndarray:
    """int64 ``[R]``: the slots of one call each rank runs (its group's; ``phys``: physical slots)."""
    group_G = np.bincount(np.asarray(phys_TK).reshape(-1) // layout.group_slots, minlength=layout.ep)
    return np.repeat(group_G.astype(np.int64), layout.moe_tp)


def rank_bytes(phys_TK: np.ndarray, layout: ExpertLayout, slice_bytes: int) -> np.ndarray:
    """int64 ``[R]``: the routed weight bytes each rank reads for one call: each distinct chosen slot of its
    group once, ``slice_bytes`` (``expert_slice_bytes`` at the layout's moe_tp) each."""
    distinct = np.unique(np.asarray(phys_TK).reshape(-1))
    group_G = np.bincount(distinct // layout.group_slots, minlength=layout.ep)
    return np.repeat(group_G.astype(np.int64) * slice_bytes, layout.moe_tp)


@dataclass
class Imbalance:
    """Per-rank loads of a sequence of calls: ``add`` one call's ``[R]`` at a time."""

    calls: int = 0
    sum_max: float = 0.0
    sum_mean: float = 0.0
    total_R: np.ndarray | None = field(default=None, repr=False)

    def add(self, load_R: np.ndarray) -> None:
        load = np.asarray(load_R, dtype=np.float64)
        self.calls += 1
        self.sum_max += float(load.max())
        self.sum_mean += float(load.mean())
        self.total_R = load.copy() if self.total_R is None else self.total_R + load

    @property
    def per_call(self) -> float:
        """``E[max] / E[mean]`` over the calls: the busiest rank against a balanced share, as a step pays it."""
        return self.sum_max / self.sum_mean if self.sum_mean else 1.0

    @property
    def aggregate(self) -> float:
        """Max / mean of the load summed over the calls."""
        if self.total_R is None or not self.total_R.mean():
            return 1.0
        return float(self.total_R.max() / self.total_R.mean())

    @property
    def mean(self) -> float:
        """The mean load of a rank per call."""
        return self.sum_mean / self.calls if self.calls else 0.0

    @property
    def busiest(self) -> float:
        """The busiest rank's load per call, on average."""
        return self.sum_max / self.calls if self.calls else 0.0

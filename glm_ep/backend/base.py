"""The backend interface: every op an MLP site runs, with the numerics each must follow.

A backend is chosen once, at construction, and carries the array namespace (``xp``), its kernels
and nothing else; the site forward calls these ops and never asks which backend it has. Every op
writes into a caller-provided ``out`` (a workspace view), so a CUDA backend can capture the step
as a graph. Numerics (both backends): fp32 accumulation; bf16 rounding only at each projection
output, the activation, each routed expert's down output and the combine (ONE rounding); router
logits, scores and weights stay fp32.

Shape suffixes: T rows, H hidden, N/Kin a projection's out/in width, E experts, K top-k slots,
S slots (``T*K``), U union entries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from glm_ep.errors import ConfigError
from glm_ep.routing import RouteParams
from glm_ep.topology import PathLevers
from glm_ep.weights import DenseWeights, MoeWeights


@dataclass(frozen=True)
class Capabilities:
    """What a backend's kernels can do. The dispatch, the stack and the checks of the levers and the
    model read these instead of the kernels' numbers."""

    max_row_group: int  # widest row group one union sweep serves; wider calls are prefill
    max_union_ids: int  # rows * top_k one union table holds
    max_gemv_rows: int  # widest batch-M GEMV: a step of up to this many rows never waits on the host
    max_top_k: int  # most experts the router keeps per row
    grouped_gemm: bool  # ``moe_gemm_sorted`` is one grouped GEMM launch (else prefill runs row groups)
    capture: bool  # ``capture`` records a replayable graph of a step of up to ``max_gemv_rows`` rows

    def check(self, backend: str, levers: PathLevers, top_k: int) -> None:
        """A ConfigError naming the first lever or model value past these limits."""
        on = f"on backend {backend!r}"
        if top_k > self.max_top_k:
            raise ConfigError(f"num_experts_per_tok = {top_k}, expected <= {self.max_top_k} {on} (the experts its "
                              "router keeps per row)")
        if levers.row_batch_max > self.max_row_group:
            raise ConfigError(f"levers.row_batch_max = {levers.row_batch_max}, expected 1..{self.max_row_group} {on} "
                              "(its widest row group)")
        if levers.union_max_ids > self.max_union_ids:
            raise ConfigError(f"levers.union_max_ids = {levers.union_max_ids}, expected 1..{self.max_union_ids} {on} "
                              "(the ids one union table holds)")
        if levers.prefill_gemm_min_rows <= self.max_row_group:
            raise ConfigError(f"levers.prefill_gemm_min_rows = {levers.prefill_gemm_min_rows}, expected >= "
                              f"{self.max_row_group + 1} {on} (rows up to {self.max_row_group} are one row group)")


class Backend(ABC):
    name: str
    xp: Any  # numpy or cupy
    capabilities: Capabilities  # a class attribute: checked before the backend is built

    # ---- placement -------------------------------------------------------------------------
    @abstractmethod
    def asarray(self, host: np.ndarray) -> Any:
        """A resident copy of a host array."""

    @abstractmethod
    def to_host(self, a: Any) -> np.ndarray:
        """A host copy (synchronises)."""

    def synchronize(self) -> None:  # noqa: B027 - a backend that queues work overrides it
        """Wait for all queued work."""

    def capture(self, fn):
        """Record ``fn``'s device work once; returns a callable that replays it."""
        raise NotImplementedError(f"backend {self.name!r} cannot capture graphs")

    @abstractmethod
    def upload_dense(self, w: DenseWeights) -> Any:
        """Resident form of a bf16 MLP (``.gate``, ``.up``, ``.down`` usable by ``linear``)."""

    @abstractmethod
    def upload_moe(self, w: MoeWeights) -> Any:
        """Resident router (``.router``, ``.bias``) and expert tables (``.gate``, ``.up``,
        ``.down``, ``.start``, ``.count``) of a routed site; ``.shared`` via ``upload_dense``."""

    # ---- dense ops -------------------------------------------------------------------------
    @abstractmethod
    def linear(self, x_TK: Any, w_NK: Any, out_TN: Any) -> Any:
        """``out = bf16(x @ w^T)``, fp32 accumulation. The path (GEMV, batch-M GEMV, GEMM) is the
        backend's, chosen from T."""

    @abstractmethod
    def router_logits(self, x_TH: Any, router_EH: Any, out_TE: Any) -> Any:
        """``out = x @ router^T`` in fp32 (x and the bf16 or fp32 router upcast)."""

    @abstractmethod
    def router_topk(self, logits_TE: Any, bias_E: Any, p: RouteParams, ids_TK: Any, wts_TK: Any) -> None:
        """``glm_ep.routing.router_topk`` into ``ids``/``wts``; ids must match it exactly."""

    @abstractmethod
    def swiglu(self, gate: Any, up: Any, limit: float, out: Any) -> Any:
        """``out = bf16(silu(min(g, L)) * clamp(u, -L, L))`` elementwise, in fp32."""

    @abstractmethod
    def combine(self, routed_SH: Any, wts_TK: Any, shared_TH: Any | None, out_TH: Any,
                perm_TK: Any | None = None) -> Any:
        """``out[t] = bf16(sum_k wts[t,k] * routed[t*K+k] + shared[t])`` (one rounding). With
        ``perm``, slot ``(t, k)`` is read from ``routed[perm[t, k]]`` (expert-sorted order)."""

    @abstractmethod
    def add(self, a: Any, b: Any, out: Any) -> Any:
        """``out = bf16(a + b)`` (the residual of a chained stack)."""

    def zero(self, a: Any) -> Any:
        a[...] = 0
        return a

    # ---- routed experts --------------------------------------------------------------------
    # ``proj`` is one projection's expert table (``table.gate`` etc.); a slot whose id is outside
    # ``[table.start, table.start + table.count)`` is remote and its output is left untouched.
    @abstractmethod
    def moe_gemv(self, a: Any, proj: Any, table: Any, ids_K: Any, out_KN: Any, per_slot_input: bool) -> None:
        """Decode: every slot of ONE row in one launch. ``a`` is ``[1, Kin]`` (all slots read the
        same row) or ``[K, Kin]`` (``per_slot_input``)."""

    @abstractmethod
    def union_table(self, ids_RK: Any, u_eid_U: Any, u_slot_UR: Any) -> None:
        """``glm_ep.routing.union_table`` into the two buffers; must match it exactly."""

    @abstractmethod
    def moe_gemv_union(self, a: Any, proj: Any, table: Any, u_eid_U: Any, u_slot_UR: Any,
                       out_RKN: Any, per_slot_input: bool) -> None:
        """Verify: each union expert swept once for all rows of the group. ``a`` is ``[R, Kin]``
        or ``[R, K, Kin]`` (``per_slot_input``)."""

    @abstractmethod
    def sort_by_expert(self, ids_TK: Any, num_experts: int, sorted_token_ids_S: Any,
                       sorted_expert_ids_S: Any, expert_offsets: Any, token_to_perm_TK: Any) -> None:
        """``glm_ep.routing.sort_by_expert`` into the four buffers; must match it exactly."""

    @abstractmethod
    def moe_gemm_sorted(self, a: Any, proj: Any, table: Any, sorted_token_ids_S: Any,
                        expert_offsets: Any, out_SN: Any, gather_rows: bool) -> None:
        """Prefill: one grouped GEMM over the expert-sorted slots. Sorted row ``i`` of a local
        expert ``e`` reads ``a[sorted_token_ids[i]]`` (``gather_rows``) or ``a[i]``."""

    @abstractmethod
    def expert_linear(self, a_1K: Any, proj: Any, table: Any, local: int, out_1N: Any) -> None:
        """One expert's projection for one row (host-dispatch path)."""

    # ---- gate + up + SwiGLU in one step --------------------------------------------------------
    # Each writes gate, up and act exactly as the separate ops would (a backend may fuse them into
    # one launch). For routed slots, rows of remote slots are unspecified: ``down`` skips them.
    def gate_up_act(self, x_TK: Any, w: Any, limit: float, gate_TI: Any, up_TI: Any, act_TI: Any) -> Any:
        """``act = swiglu(linear(x, w.gate), linear(x, w.up))`` of a bf16 MLP."""
        self.linear(x_TK, w.gate, gate_TI)
        self.linear(x_TK, w.up, up_TI)
        return self.swiglu(gate_TI, up_TI, limit, act_TI)

    def moe_gate_up_act(self, a_1K: Any, table: Any, ids_K: Any, limit: float, gate_KM: Any, up_KM: Any,
                        act_KM: Any) -> None:
        """Decode: gate, up and SwiGLU of every slot of ONE row."""
        self.moe_gemv(a_1K, table.gate, table, ids_K, gate_KM, per_slot_input=False)
        self.moe_gemv(a_1K, table.up, table, ids_K, up_KM, per_slot_input=False)
        self.swiglu(gate_KM, up_KM, limit, act_KM)

    def moe_gate_up_act_union(self, a_RK: Any, table: Any, u_eid_U: Any, u_slot_UR: Any, limit: float,
                              gate_RKM: Any, up_RKM: Any, act_RKM: Any) -> None:
        """Verify: gate, up and SwiGLU of a row group, each union expert swept once."""
        self.moe_gemv_union(a_RK, table.gate, table, u_eid_U, u_slot_UR, gate_RKM, per_slot_input=False)
        self.moe_gemv_union(a_RK, table.up, table, u_eid_U, u_slot_UR, up_RKM, per_slot_input=False)
        self.swiglu(gate_RKM, up_RKM, limit, act_RKM)

    def moe_gate_up_act_sorted(self, x_TK: Any, table: Any, sorted_token_ids_S: Any, expert_offsets: Any,
                               limit: float, gate_SM: Any, up_SM: Any, act_SM: Any) -> None:
        """Prefill: gate, up and SwiGLU of the expert-sorted slots (token rows gathered through
        ``sorted_token_ids``). ``act`` as the separate ops write it; ``gate``/``up`` are scratch a
        fused backend may leave unwritten (each is still rounded to bf16 before the SwiGLU)."""
        self.moe_gemm_sorted(x_TK, table.gate, table, sorted_token_ids_S, expert_offsets, gate_SM, gather_rows=True)
        self.moe_gemm_sorted(x_TK, table.up, table, sorted_token_ids_S, expert_offsets, up_SM, gather_rows=True)
        self.swiglu(gate_SM, up_SM, limit, act_SM)

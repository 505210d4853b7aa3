"""The backend interface: every op an MLP site runs, with the numerics each must follow.

A backend is chosen once, at construction, and carries the array namespace (``xp``), its kernels
and nothing else; the site forward calls these ops and never asks which backend it has. Every op
writes into a caller-provided ``out`` (a workspace view), so a CUDA backend can capture the step
as a graph. Numerics (both backends): fp32 accumulation; bf16 rounding only at each projection
output, the activation, each routed expert's down output and the combine (ONE rounding); router
logits, scores and weights stay fp32.

Weights live on a backend as the resident structures below, shared by both backends and generic
over the backend's array type ``A`` (``numpy.ndarray``, ``cupy.ndarray``) and its form ``P`` of one
projection of every local expert (the NumPy tuple of ``Nvfp4Weight``, the CUDA pointer table).
A routed op takes ONE ``ExpertTable`` (one projection, with the id range it covers); a fused
gate + up op takes the site's ``RoutedExperts``.

Shape suffixes: T rows, H hidden, N/Kin a projection's out/in width, E experts, K top-k slots,
S slots (``T*K``), U union entries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Generic, Mapping, Sequence, TypeVar

import numpy as np

from glm_ep.config.model import SiteConfig
from glm_ep.errors import ConfigError
from glm_ep.mlp.routing import RouteParams
from glm_ep.mlp.workspace import Buffer
from glm_ep.config.topology import PathLevers
from glm_ep.checkpoint.weights import DenseWeights, ExpertWeights, MoeWeights

A = TypeVar("A")  # the backend's array type
P = TypeVar("P")  # the backend's form of one projection of every local expert


# ---- resident weights ---------------------------------------------------------------------------
@dataclass(frozen=True)
class DenseResident(Generic[A]):
    """A resident bf16 clamped-SwiGLU MLP (dense FFN or shared expert): this rank's TP shard."""

    gate: A  # bf16 [I, H]
    up: A  # bf16 [I, H]
    down: A  # bf16 [H, I]

    @property
    def width(self) -> int:
        return self.gate.shape[0]


@dataclass(frozen=True)
class ExpertTable(Generic[P]):
    """One projection (gate, up or down) of this rank's routed experts: ``weights`` holds local
    expert ``i`` = global id ``start + i`` for ``i < count``; a slot whose id is outside that range
    is remote (another rank owns it) and its output is left untouched."""

    weights: P
    start: int
    count: int

    def local(self, expert_id: int) -> int | None:
        i = int(expert_id) - self.start
        return i if 0 <= i < self.count else None


@dataclass(frozen=True)
class RoutedExperts(Generic[P]):
    """The three projections of this rank's routed experts, over one id range."""

    gate: ExpertTable[P]  # [M, H] per expert
    up: ExpertTable[P]  # [M, H]
    down: ExpertTable[P]  # [H, M]

    @classmethod
    def of(cls, gate: P, up: P, down: P, start: int, count: int) -> "RoutedExperts[P]":
        return cls(ExpertTable(gate, start, count), ExpertTable(up, start, count), ExpertTable(down, start, count))

    @property
    def start(self) -> int:
        return self.gate.start

    @property
    def count(self) -> int:
        return self.gate.count


@dataclass(frozen=True)
class MoeResident(Generic[A, P]):
    """A resident routed site: router, bias and experts; ``shared`` is None where this rank does not
    contribute the shared expert (and ``experts.count`` is 0 where it contributes no routed one)."""

    router: A  # [E, H] bf16 or fp32, as stored
    bias: A  # fp32 [E], selection only
    experts: RoutedExperts[P]
    shared: DenseResident[A] | None


# ---- what the stages of a sparse site hand each other ------------------------------------------
@dataclass(frozen=True)
class SharedGlu:
    """The shared expert's first half, to run beside the router on the same x: gate, up and the clamped
    SwiGLU of ``w`` (limit ``limit``) into ``gate``/``up``/``act`` [T, I]."""

    w: DenseResident[Any]
    limit: float
    gate_TI: Any
    up_TI: Any
    act_TI: Any


@dataclass(frozen=True)
class SharedHalf:
    """The shared expert up to its down projection, which the combine runs: ``act`` [T, I] and ``down``
    [H, I]; ``out`` [T, H] takes the down output where a backend computes it apart from the combine."""

    act_TI: Any
    down_HI: Any
    out_TH: Any


@dataclass(frozen=True)
class PendingDown:
    """ONE row's routed down projection, left to the combine: slot k runs expert ``ids[k]`` of ``table`` on
    ``act[k]`` ([K, M]), into that slot's routed row."""

    act_KM: Any
    table: ExpertTable[Any]
    ids_K: Any


@dataclass(frozen=True)
class RoutedRows:
    """What the routed experts hand the combine: ``rows`` [T*K, H] (a remote slot's row exactly zero), read
    through ``perm`` [T, K] where not None (expert-sorted order); ``down``, where not None, is ONE row's down
    projection still to run, which writes the local slots' rows."""

    rows_SH: Any
    perm_TK: Any = None
    down: PendingDown | None = None


# ---- what a backend can do ----------------------------------------------------------------------
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
        for key in ("prefill_gemm_min_rows", "nvfp4_dense_gemm_min_rows", "nvfp4_dense_dequant_min_rows"):
            if 0 < getattr(levers, key) <= self.max_row_group:  # (PathLevers allows 0 only where it means off)
                off = " or 0 (off)" if key == "nvfp4_dense_dequant_min_rows" else ""
                raise ConfigError(f"levers.{key} = {getattr(levers, key)}, expected >= {self.max_row_group + 1}{off} "
                                  f"{on} (rows up to {self.max_row_group} are one row group)")


#: What the path kernels can do, the one source both backends read: the CUDA kernels are compiled with these
#: numbers (``kernel_loader``'s ``-D`` constants are set from them) and the NumPy backend, which walks the same
#: paths, refuses what a GPU would. Neither records graphs here: a backend that captures says so in its own copy.
KERNEL_LIMITS = Capabilities(max_row_group=8, max_union_ids=64, max_gemv_rows=8, max_top_k=16, grouped_gemm=True,
                             capture=False)


# ---- the interface ------------------------------------------------------------------------------
class Backend(ABC, Generic[A, P]):
    name: str
    xp: Any  # numpy or cupy
    capabilities: Capabilities  # a class attribute: checked before the backend is built
    bound: Mapping[str, Any] | None = None  # the scratch ``bind`` was last handed (None: none yet)

    # ---- placement -------------------------------------------------------------------------
    @abstractmethod
    def asarray(self, host: np.ndarray) -> Any:
        """A resident copy of a host array."""

    @abstractmethod
    def to_host(self, a: Any, out: np.ndarray | None = None) -> np.ndarray:
        """A host copy (synchronises), into ``out`` (same shape and dtype, contiguous) if given."""

    def synchronize(self) -> None:  # noqa: B027 - a backend that queues work overrides it
        """Wait for all queued work."""

    def capture(self, fn):
        """Record ``fn``'s device work once; returns a callable that replays it."""
        raise NotImplementedError(f"backend {self.name!r} cannot capture graphs")

    def capturing(self) -> bool:
        """Whether the backend's stream is being captured already (a caller's own graph around ours): then
        a call runs its ops into that capture rather than starting one of its own."""
        return False

    def buffers(self, cfg: SiteConfig, levers: PathLevers) -> tuple[Buffer, ...]:
        """The scratch this backend's ops need for sites of ``cfg``'s geometry under ``levers``, stack buffers all
        (``glm_ep.mlp.workspace``): the workspace makes them at load and hands them over through ``bind``, so an op
        never allocates. None by default."""
        return ()

    def bind(self, scratch: Mapping[str, Any]) -> None:
        """Take the buffers ``buffers`` declared, as the workspace made them (by name; one that needs no element at
        the workspace's rows is absent). A backend that declares buffers extends it."""
        self.bound = scratch

    @abstractmethod
    def upload_dense(self, w: DenseWeights) -> DenseResident[A]:
        """Resident form of a bf16 MLP (each matrix usable by ``linear``)."""

    @abstractmethod
    def upload_experts(self, experts: Sequence[ExpertWeights], start: int, swiglu_limit: float,
                       what: str = "experts") -> RoutedExperts[P]:
        """Resident tables of NVFP4 experts, global ids ``start ..`` (a routed site's, or the one expert
        of a dense FFN stored NVFP4). ``swiglu_limit`` bounds the activations the down projections
        read: a backend may choose a narrower operand form from it. ``what`` names them in errors."""

    @abstractmethod
    def upload_moe(self, w: MoeWeights, swiglu_limit: float) -> MoeResident[A, P]:
        """Resident router, bias and expert tables of a routed site; the shared expert via
        ``upload_dense``. ``swiglu_limit`` (the site's) bounds the routed activations: a backend may
        choose a narrower operand form for the down projection from it."""

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
        """``glm_ep.mlp.routing.router_topk`` into ``ids``/``wts``; ids must match it exactly."""

    def route(self, x_TH: Any, router_EH: Any, bias_E: Any, p: RouteParams, logits_TE: Any, ids_TK: Any,
              wts_TK: Any, beside: SharedGlu | None = None) -> None:
        """``router_logits`` then ``router_topk``, with the same results (a backend may fuse them); given
        ``beside``, the shared expert's gate, up and SwiGLU on the same x too (``route_and_gate_up_act``)."""
        if beside is not None:
            self.route_and_gate_up_act(x_TH, router_EH, bias_E, p, logits_TE, ids_TK, wts_TK, beside.w, beside.limit,
                                       beside.gate_TI, beside.up_TI, beside.act_TI)
            return
        self.router_logits(x_TH, router_EH, logits_TE)
        self.router_topk(logits_TE, bias_E, p, ids_TK, wts_TK)

    def route_and_gate_up_act(self, x_TH: Any, router_EH: Any, bias_E: Any, p: RouteParams, logits_TE: Any,
                              ids_TK: Any, wts_TK: Any, w: DenseResident[A], limit: float, gate_TI: Any, up_TI: Any,
                              act_TI: Any) -> Any:
        """``route`` then ``gate_up_act(x, w, ...)`` on the same x (the shared expert's first half
        beside the router), with the same results; a backend may run both at once. Returns act."""
        self.route(x_TH, router_EH, bias_E, p, logits_TE, ids_TK, wts_TK)
        return self.gate_up_act(x_TH, w, limit, gate_TI, up_TI, act_TI)

    @abstractmethod
    def swiglu(self, gate: Any, up: Any, limit: float, out: Any) -> Any:
        """``out = bf16(silu(min(g, L)) * clamp(u, -L, L))`` elementwise, in fp32."""

    @abstractmethod
    def combine(self, routed_SH: Any, wts_TK: Any, shared_TH: Any | None, out_TH: Any,
                perm_TK: Any | None = None) -> Any:
        """``out[t] = bf16(sum_k wts[t,k] * routed[t*K+k] + shared[t])`` (one rounding). With
        ``perm``, slot ``(t, k)`` is read from ``routed[perm[t, k]]`` (expert-sorted order)."""

    def shared_down_combine(self, act_TI: Any, down_HI: Any, routed_SH: Any, wts_TK: Any, shared_TH: Any,
                            out_TH: Any, perm_TK: Any | None = None) -> Any:
        """``combine(routed, wts, linear(act, down), out, perm)``: the shared expert's down projection
        (into ``shared_TH``) then the combine. A backend may fuse the two and leave ``shared_TH``
        unwritten; ``out`` is the same either way."""
        self.linear(act_TI, down_HI, shared_TH)
        return self.combine(routed_SH, wts_TK, shared_TH, out_TH, perm_TK)

    def moe_down_shared_combine(self, act_KM: Any, table: ExpertTable[P], ids_K: Any, routed_KH: Any,
                                shared_act_1I: Any, shared_down_HI: Any, wts_1K: Any, shared_1H: Any,
                                out_1H: Any) -> Any:
        """The end of a ONE-row sparse site: the routed down projection (``moe_gemv`` with a per-slot
        input, into ``routed_KH``; its remote slots already zero), then ``shared_down_combine``. A
        backend may run all of it at once (``shared_1H`` then unwritten); ``routed`` and ``out`` are
        the same either way, up to the order in which the shared expert's sums are added."""
        self.moe_gemv(act_KM, table, ids_K, routed_KH, per_slot_input=True)
        return self.shared_down_combine(shared_act_1I, shared_down_HI, routed_KH, wts_1K, shared_1H, out_1H)

    def combine_site(self, routed: RoutedRows, wts_TK: Any, shared: SharedHalf | None, out_TH: Any) -> Any:
        """The end of a sparse site, before its all-reduce: ``out[t] = bf16(sum_k wts[t,k] * routed[t,k] +
        shared[t])``, ONE rounding, with ``shared`` the shared expert's down projection (None: no shared term).
        A pending one-row down projection runs first. Through the fused ops: ``moe_down_shared_combine`` (a
        pending down and the shared expert: all of it, one launch on CUDA's down ring), ``shared_down_combine``."""
        down = routed.down
        if down is not None and shared is not None:
            return self.moe_down_shared_combine(down.act_KM, down.table, down.ids_K, routed.rows_SH, shared.act_TI,
                                                shared.down_HI, wts_TK, shared.out_TH, out_TH)
        if down is not None:
            self.moe_gemv(down.act_KM, down.table, down.ids_K, routed.rows_SH, per_slot_input=True)
        if shared is None:
            return self.combine(routed.rows_SH, wts_TK, None, out_TH, routed.perm_TK)
        return self.shared_down_combine(shared.act_TI, shared.down_HI, routed.rows_SH, wts_TK, shared.out_TH, out_TH,
                                        routed.perm_TK)

    @abstractmethod
    def map_expert_ids(self, ids_TK: Any, table_EW: Any, nrep_E: Any, out_TK: Any) -> Any:
        """``glm_ep.mlp.expert_map.map_ids`` into ``out`` (global expert ids -> a placement's physical slots,
        int32; ``out`` may be ``ids`` itself); on a device, one launch and no host sync."""

    @abstractmethod
    def add(self, a: Any, b: Any, out: Any) -> Any:
        """``out = bf16(a + b)`` (the residual of a chained stack)."""

    def zero(self, a: Any) -> Any:
        a[...] = 0
        return a

    def copy(self, src: Any, dst: Any) -> Any:
        """``dst[...] = src`` (same shape and dtype), queued in order with the backend's other ops."""
        dst[...] = src
        return dst

    # ---- routed experts --------------------------------------------------------------------
    # ``table`` is one projection of the local experts; a slot whose id is outside
    # ``[table.start, table.start + table.count)`` is remote and its output is left untouched.
    @abstractmethod
    def moe_gemv(self, a: Any, table: ExpertTable[P], ids_K: Any, out_KN: Any, per_slot_input: bool) -> None:
        """Decode: every slot of ONE row in one launch. ``a`` is ``[1, Kin]`` (all slots read the
        same row) or ``[K, Kin]`` (``per_slot_input``)."""

    @abstractmethod
    def union_table(self, ids_RK: Any, u_eid_U: Any, u_slot_UR: Any) -> None:
        """``glm_ep.mlp.routing.union_table`` into the two buffers; must match it exactly."""

    @abstractmethod
    def moe_gemv_union(self, a: Any, table: ExpertTable[P], u_eid_U: Any, u_slot_UR: Any, out_RKN: Any,
                       per_slot_input: bool) -> None:
        """Verify: each union expert swept once for all rows of the group. ``a`` is ``[R, Kin]``
        or ``[R, K, Kin]`` (``per_slot_input``)."""

    @abstractmethod
    def sort_by_expert(self, ids_TK: Any, num_experts: int, sorted_token_ids_S: Any,
                       sorted_expert_ids_S: Any, expert_offsets: Any, token_to_perm_TK: Any) -> None:
        """``glm_ep.mlp.routing.sort_by_expert`` into the four buffers; must match it exactly."""

    @abstractmethod
    def moe_gemm_sorted(self, a: Any, table: ExpertTable[P], sorted_token_ids_S: Any, expert_offsets: Any,
                        out_SN: Any, gather_rows: bool, scratch: Any = None) -> None:
        """Prefill: one grouped GEMM over the expert-sorted slots. Sorted row ``i`` of a local
        expert ``e`` reads ``a[sorted_token_ids[i]]`` (``gather_rows``) or ``a[i]``. Both routing arrays
        None: the table's ONE expert takes every row of ``a`` in order (a dense FFN stored NVFP4).
        ``scratch``: a float32 buffer whose contents are dead, which a backend may fill with partial
        sums (a K split)."""

    @abstractmethod
    def expert_linear(self, a_1K: Any, table: ExpertTable[P], local: int, out_1N: Any) -> None:
        """Local expert ``local``'s projection for one row (host-dispatch path)."""

    @abstractmethod
    def dequant_linear(self, a_TK: Any, table: ExpertTable[P], local: int, w_NK: Any, out_TN: Any) -> None:
        """Local expert ``local``'s projection for every row of ``a`` through bf16 weights: ``w`` [n, k] (scratch,
        overwritten) takes the exact bf16 ``e2m1 * e4m3``, then ``out = bf16(scale_2 * (a @ w^T))`` with fp32 sums,
        the numerics of ``moe_gemm_sorted`` (a dense FFN stored NVFP4 at compute-bound widths)."""

    # ---- gate + up + SwiGLU in one step --------------------------------------------------------
    # Each writes gate, up and act exactly as the separate ops would (a backend may fuse them into
    # one launch). For routed slots, rows of remote slots are unspecified: ``down`` skips them.
    def gate_up_act(self, x_TK: Any, w: DenseResident[A], limit: float, gate_TI: Any, up_TI: Any,
                    act_TI: Any) -> Any:
        """``act = swiglu(linear(x, w.gate), linear(x, w.up))`` of a bf16 MLP."""
        self.linear(x_TK, w.gate, gate_TI)
        self.linear(x_TK, w.up, up_TI)
        return self.swiglu(gate_TI, up_TI, limit, act_TI)

    def moe_gate_up_act(self, a_1K: Any, experts: RoutedExperts[P], ids_K: Any, limit: float, gate_KM: Any,
                        up_KM: Any, act_KM: Any) -> None:
        """Decode: gate, up and SwiGLU of every slot of ONE row."""
        self.moe_gemv(a_1K, experts.gate, ids_K, gate_KM, per_slot_input=False)
        self.moe_gemv(a_1K, experts.up, ids_K, up_KM, per_slot_input=False)
        self.swiglu(gate_KM, up_KM, limit, act_KM)

    def moe_gate_up_act_union(self, a_RK: Any, experts: RoutedExperts[P], u_eid_U: Any, u_slot_UR: Any,
                              limit: float, gate_RKM: Any, up_RKM: Any, act_RKM: Any) -> None:
        """Verify: gate, up and SwiGLU of a row group, each union expert swept once."""
        self.moe_gemv_union(a_RK, experts.gate, u_eid_U, u_slot_UR, gate_RKM, per_slot_input=False)
        self.moe_gemv_union(a_RK, experts.up, u_eid_U, u_slot_UR, up_RKM, per_slot_input=False)
        self.swiglu(gate_RKM, up_RKM, limit, act_RKM)

    def moe_experts_sorted(self, x_TK: Any, experts: RoutedExperts[P], sorted_token_ids_S: Any,
                           expert_offsets: Any, limit: float, gate_SM: Any, up_SM: Any, act_SM: Any, out_SH: Any,
                           scratch: Any = None) -> None:
        """Prefill: the routed experts of the expert-sorted slots, gate + up + SwiGLU then down into ``out``.
        ``gate``/``up``/``act`` are its scratch: a backend may hold ``act`` in an order of its own between
        the two projections (the CUDA backend's wgmma engine reads x and act in a staged k order, and stages x
        in ``up``). ``scratch``: as ``moe_gemm_sorted``'s."""
        self.moe_gate_up_act_sorted(x_TK, experts, sorted_token_ids_S, expert_offsets, limit, gate_SM, up_SM, act_SM,
                                    scratch=scratch)
        self.moe_gemm_sorted(act_SM, experts.down, sorted_token_ids_S, expert_offsets, out_SH, gather_rows=False,
                             scratch=scratch)

    def moe_gate_up_act_sorted(self, x_TK: Any, experts: RoutedExperts[P], sorted_token_ids_S: Any,
                               expert_offsets: Any, limit: float, gate_SM: Any, up_SM: Any, act_SM: Any,
                               scratch: Any = None) -> None:
        """Prefill: gate, up and SwiGLU of the expert-sorted slots (token rows gathered through
        ``sorted_token_ids``). ``act`` as the separate ops write it; ``gate``/``up`` are scratch a
        fused backend may leave unwritten (each is still rounded to bf16 before the SwiGLU); ``scratch``:
        as ``moe_gemm_sorted``'s (it may hold ``gate``/``up``)."""
        self.moe_gemm_sorted(x_TK, experts.gate, sorted_token_ids_S, expert_offsets, gate_SM, gather_rows=True)
        self.moe_gemm_sorted(x_TK, experts.up, sorted_token_ids_S, expert_offsets, up_SM, gather_rows=True)
        self.swiglu(gate_SM, up_SM, limit, act_SM)

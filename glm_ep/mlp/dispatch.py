"""Routed-expert dispatch: which path runs a call's rows, and the path bodies, for a sparse site's routed
experts or for a dense FFN stored NVFP4 run as one expert that every row chooses (``ExpertShape``).

| rows            | path      | what runs                                                        |
|-----------------|-----------|------------------------------------------------------------------|
| 1               | `decode`  | grouped GEMV: all top_k slots per launch, ids stay on device      |
| 2..G            | `union`   | union table, each union expert swept once for the group           |
| > G, >= min     | `sorted`  | sort by expert, one grouped GEMM per projection, indexed combine  |
| > G, < min      | `union`   | even row groups of <= G (never a group of one)                    |
| >= D, 1 expert  | `dequant` | each projection dequantized to bf16 into a scratch, one bf16 GEMM  |
| lever           | `host`    | ids read to the host, one launch per (slot, projection)           |

G is the backend's widest row group (``Capabilities.max_row_group``: 8 on both backends), capped
by the levers (``group_cap``); min is the ``prefill_gemm_min_rows`` lever, or with ONE expert (a dense
FFN stored NVFP4, which every row group of the union path sweeps whole) ``nvfp4_dense_gemm_min_rows``; D is
``nvfp4_dense_dequant_min_rows`` (one expert only; 0: never): from there the weights' bytes no longer bound the
call, and the bf16 GEMM (cuBLAS on CUDA) outruns the grouped GEMM's W4A16 engines by more than one pass over a
projection as bf16 costs. Its scratch (``w_bf16``, a stack buffer of the workspace: ``expert_buffers``) holds one
projection, ``width * hidden`` bf16.

Every path writes ``[T*K, H]`` routed rows, remote slots exactly zero (zeroed up front only where some
experts are remote: otherwise every slot is written), and hands the combine a ``RoutedRows`` naming the
permutation to read them through (None when they are in ``(row, slot)`` order). ONE row on the decode path
whose shared expert ran beside the router (``Route.shared``) leaves its down projection to the combine
(``RoutedRows.down``), which a backend may run with the shared expert's down projection as one launch
(``Backend.combine_site``); nothing the call learns is kept on the dispatch but the paths it announced.
Shape suffixes: T rows, H hidden, K top-k, M an expert's width, S = T*K slots.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from glm_ep.backend.base import Backend, PendingDown, RoutedExperts, RoutedRows, SharedGlu
from glm_ep.config.model import SiteConfig
from glm_ep.errors import InputError
from glm_ep.mlp.routing import row_groups
from glm_ep.config.topology import PathLevers
from glm_ep.mlp.workspace import Buffer, Workspace

log = logging.getLogger(__name__)
BF16, I32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.int32)


@dataclass(frozen=True)
class ExpertShape:
    """What the dispatch knows of the experts it runs: ``num_experts`` ids a slot may name, ``top_k`` slots a row,
    each expert a clamped SwiGLU MLP (limit ``swiglu_limit``) of ``width`` over ``hidden``."""

    hidden: int
    width: int
    num_experts: int
    top_k: int
    swiglu_limit: float

    @classmethod
    def routed(cls, cfg: SiteConfig) -> "ExpertShape":
        """A sparse site's routed experts: every expert id the router ranks, top-k of them a row."""
        return cls(cfg.hidden, cfg.moe_intermediate, cfg.num_experts, cfg.top_k, cfg.swiglu_limit)

    @classmethod
    def nvfp4_dense(cls, cfg: SiteConfig) -> "ExpertShape":
        """A dense FFN stored NVFP4 run on the routed experts' paths: ONE expert (id 0, held by every rank that holds
        the FFN) of this rank's dense width, which every row chooses once."""
        return cls(cfg.hidden, cfg.local_dense_intermediate, 1, 1, cfg.swiglu_limit)


@dataclass(frozen=True)
class Route:
    """What the router decided for one call, which the later stages consume: ``ids`` / ``wts`` [T, K]; ``shared``:
    the shared expert's gate / up / SwiGLU where they ran beside the router (their activations then sit past the
    routed experts' in the workspace and outlive them), else None (the shared stage runs them after the experts,
    or this rank holds no shared expert)."""

    ids_TK: Any
    wts_TK: Any
    shared: SharedGlu | None = None


def expert_buffers(shape: ExpertShape, levers: PathLevers) -> tuple[Buffer, ...]:
    """The scratch of the routed-expert paths for experts of ``shape``, for calls of up to ``r`` rows:
    every slot's gate / up / act ``[r * top_k, width]``, the ids of a call that routes itself (one expert), the
    routed rows ``[r * top_k, hidden]``, the union table (``u_slot`` QUADRATIC in rows), the sort by expert; and,
    one for the stack, the dequant path's weights: one projection as bf16 where calls of ``r`` rows may take that
    path (one expert only)."""
    k, m, h, e = shape.top_k, shape.width, shape.hidden, shape.num_experts
    d = levers.nvfp4_dense_dequant_min_rows
    dequant = e == 1 and not levers.host_dispatch and d > 0
    return (
        *(Buffer(b, BF16, lambda r: r * k * m) for b in ("a_gate", "a_up", "a_act")),
        Buffer("ids", I32, lambda r: r * k),
        Buffer("expert_out", BF16, lambda r: r * k * h),
        Buffer("u_eid", I32, lambda r: r * k),
        Buffer("u_slot", I32, lambda r: r * k * r),
        Buffer("sorted_token_ids", I32, lambda r: r * k),
        Buffer("sorted_expert_ids", I32, lambda r: r * k),
        Buffer("expert_offsets", I32, lambda r: e + 1),
        Buffer("token_to_perm", I32, lambda r: r * k),
        Buffer("w_bf16", BF16, lambda r: m * h if dequant and r >= d else 0, stack="dequant scratch",
               note=f"the dense FFN stored NVFP4 from {d} rows: one projection as bf16, shared by its layers",
               hint="set levers.nvfp4_dense_dequant_min_rows = 0 or above workspace_rows to go without the dequant "
                    "scratch"),
    )


@dataclass
class ExpertDispatch:
    """Chooses and runs the routed-expert path for one rank; says once per row count which ran."""

    be: Backend
    shape: ExpertShape
    levers: PathLevers
    _announced: set[tuple[str, int]] = field(default_factory=set)

    @classmethod
    def routed(cls, be: Backend, cfg: SiteConfig, levers: PathLevers) -> "ExpertDispatch":
        return cls(be, ExpertShape.routed(cfg), levers)

    @classmethod
    def nvfp4_dense(cls, be: Backend, cfg: SiteConfig, levers: PathLevers) -> "ExpertDispatch":
        return cls(be, ExpertShape.nvfp4_dense(cfg), levers)

    @property
    def group_cap(self) -> int:
        """Widest row group of the union path: a union table holds ``union_max_ids`` ids."""
        return max(1, min(self.levers.row_batch_max, self.levers.union_max_ids // self.shape.top_k))

    @property
    def gemm_min_rows(self) -> int:
        """Rows from which the grouped GEMM runs (``prefill_gemm_min_rows``; with one expert, whose weights
        every row group would sweep whole, ``nvfp4_dense_gemm_min_rows``)."""
        lv = self.levers
        return lv.nvfp4_dense_gemm_min_rows if self.shape.num_experts == 1 else lv.prefill_gemm_min_rows

    def path_for(self, rows: int) -> str:
        lv, k = self.levers, self.shape.top_k
        if lv.host_dispatch:
            return "host"
        if rows == 1:
            return "decode"
        caps = self.be.capabilities
        d = lv.nvfp4_dense_dequant_min_rows
        # (never a captured width: past every row group and every width a step captures, since it calls cuBLAS)
        if self.shape.num_experts == 1 and d and rows >= d and rows > max(caps.max_row_group, caps.max_gemv_rows):
            return "dequant"
        if rows > caps.max_row_group and lv.prefill_gemm and rows >= self.gemm_min_rows and caps.grouped_gemm:
            return "sorted"
        groups = row_groups(rows, self.group_cap)
        if lv.row_batch and all(w >= 2 and w * k <= lv.union_max_ids for _, w in groups):
            return "union"
        return "decode"  # one grouped GEMV per row

    def __call__(self, x_TH: Any, route: Route, experts: RoutedExperts[Any], ws: Workspace) -> RoutedRows:
        """The routed experts of ``route``'s slots, their ``[T*K, H]`` rows in the workspace."""
        t, k, h = x_TH.shape[0], self.shape.top_k, self.shape.hidden
        leave_down = t == 1 and route.shared is not None  # the combine may end the site in one launch
        return self._run(x_TH, route.ids_TK, experts, ws, ws.view("expert_out", t * k, h), leave_down)

    def every_row(self, x_TH: Any, mlp: RoutedExperts[Any], ws: Workspace, out_TH: Any) -> Any:
        """``down(act(gate(x), up(x)))`` of an NVFP4 MLP that every row runs (a dense FFN stored NVFP4): ``mlp`` is
        ONE expert (id 0), one slot a row, so the routed rows ARE the output rows, in row order on every path (the
        sort by expert is stable): written straight into ``out``, rounded where a dense MLP's are."""
        if (self.shape.num_experts, self.shape.top_k) != (1, 1):
            raise ValueError(f"every_row: a dispatch of one expert chosen once a row, not {self.shape.num_experts} "
                             f"experts top-{self.shape.top_k}")
        ids_T1 = ws.view("ids", x_TH.shape[0], 1)
        if self.path_for(x_TH.shape[0]) not in ("sorted", "dequant"):  # one expert's GEMMs read no ids
            self.be.zero(ids_T1)
        self._run(x_TH, ids_T1, mlp, ws, out_TH, leave_down=False)
        return out_TH

    def _run(self, x_TH: Any, ids_TK: Any, experts: RoutedExperts[Any], ws: Workspace, routed_SH: Any,
             leave_down: bool) -> RoutedRows:
        t, k, h = x_TH.shape[0], self.shape.top_k, self.shape.hidden
        if tuple(routed_SH.shape) != (t * k, h) or not routed_SH.flags.c_contiguous:
            raise ValueError(f"routed outputs of shape {tuple(routed_SH.shape)} (contiguous: "
                             f"{routed_SH.flags.c_contiguous}), expected a contiguous {(t * k, h)}")
        if experts.count < self.shape.num_experts:  # remote slots must add exactly zero
            self.be.zero(routed_SH)  # (with every expert local, every slot is written)
        path = self.path_for(t)
        if (path, t) not in self._announced:
            self._announced.add((path, t))
            log.info("routed experts: %d rows -> %s path", t, path)
        if experts.count == 0:  # this rank contributes no routed experts
            return RoutedRows(routed_SH)
        if path == "decode" and leave_down:
            return self._decode_glu(x_TH, ids_TK, experts, ws, routed_SH)
        return getattr(self, f"_{path}")(x_TH, ids_TK, experts, ws, routed_SH)

    def _decode_views(self, ws: Workspace) -> tuple[Any, Any, Any]:
        k, m = self.shape.top_k, self.shape.width
        return tuple(ws.view(b, k, m) for b in ("a_gate", "a_up", "a_act"))

    def _decode_glu(self, x_TH, ids_TK, experts, ws, routed_SH) -> RoutedRows:
        """ONE row's gate, up and SwiGLU; its down projection is the combine's (``RoutedRows.down``)."""
        gate_KM, up_KM, act_KM = self._decode_views(ws)
        self.be.moe_gate_up_act(x_TH, experts, ids_TK[0], self.shape.swiglu_limit, gate_KM, up_KM, act_KM)
        return RoutedRows(routed_SH, down=PendingDown(act_KM, experts.down, ids_TK[0]))

    def _decode(self, x_TH, ids_TK, experts, ws, routed_SH) -> RoutedRows:
        be, k, lim = self.be, self.shape.top_k, self.shape.swiglu_limit
        gate_KM, up_KM, act_KM = self._decode_views(ws)
        for r in range(x_TH.shape[0]):
            x_1H, ids_K, routed_KH = x_TH[r:r + 1], ids_TK[r], routed_SH[r * k:(r + 1) * k]
            be.moe_gate_up_act(x_1H, experts, ids_K, lim, gate_KM, up_KM, act_KM)  # remote rows: unread
            be.moe_gemv(act_KM, experts.down, ids_K, routed_KH, per_slot_input=True)
        return RoutedRows(routed_SH)

    def _union(self, x_TH, ids_TK, experts, ws, routed_SH):
        be, k, m, h, lim = (self.be, self.shape.top_k, self.shape.width, self.shape.hidden,
                            self.shape.swiglu_limit)
        t = x_TH.shape[0]
        gate_TKM, up_TKM, act_TKM = (ws.view(b, t, k, m) for b in ("a_gate", "a_up", "a_act"))
        routed_TKH = routed_SH.reshape(t, k, h)
        for r0, w in row_groups(t, self.group_cap):
            rs = slice(r0, r0 + w)
            # the table is rebuilt per group; the previous group's sweeps are already queued
            u_eid, u_slot = ws.view("u_eid", w * k), ws.view("u_slot", w * k, w)
            be.union_table(ids_TK[rs], u_eid, u_slot)
            be.moe_gate_up_act_union(x_TH[rs], experts, u_eid, u_slot, lim, gate_TKM[rs], up_TKM[rs], act_TKM[rs])
            be.moe_gemv_union(act_TKM[rs], experts.down, u_eid, u_slot, routed_TKH[rs], per_slot_input=True)
        return RoutedRows(routed_SH)

    def _sorted(self, x_TH, ids_TK, experts, ws, routed_SH):
        be, k, m, lim = self.be, self.shape.top_k, self.shape.width, self.shape.swiglu_limit
        t = x_TH.shape[0]
        s = t * k
        if self.shape.num_experts == 1:  # one expert: every row, in order (no ids read, nothing to sort)
            tok_S = offsets = perm_TK = None
        else:
            tok_S, eid_S, offsets = ws.view("sorted_token_ids", s), ws.view("sorted_expert_ids", s), \
                ws.view("expert_offsets", self.shape.num_experts + 1)
            perm_TK = ws.view("token_to_perm", t, k)
            be.sort_by_expert(ids_TK, self.shape.num_experts, tok_S, eid_S, offsets, perm_TK)
        gate_SM, up_SM, act_SM = (ws.view(b, s, m) for b in ("a_gate", "a_up", "a_act"))
        # a_gate holds nothing live here (the shared expert keeps only its act; the fused GEMM writes only
        # act): all of it is the GEMMs' scratch for a K split, first the glu's, then the down projection's
        scratch = ws.as_f32("a_gate") if self.levers.prefill_k_split else None
        be.moe_experts_sorted(x_TH, experts, tok_S, offsets, lim, gate_SM, up_SM, act_SM, routed_SH, scratch=scratch)
        return RoutedRows(routed_SH, perm_TK)

    def _dequant(self, x_TH, ids_TK, experts, ws, routed_SH):
        be, t, m, lim = self.be, x_TH.shape[0], self.shape.width, self.shape.swiglu_limit
        gate_TM, up_TM, act_TM = (ws.view(b, t, m) for b in ("a_gate", "a_up", "a_act"))

        def proj(table, a_TK, out_TN):  # one slot a row: the routed rows are the output rows
            n, k = out_TN.shape[1], a_TK.shape[1]
            be.dequant_linear(a_TK, table, 0, ws.view("w_bf16", n, k), out_TN)

        proj(experts.gate, x_TH, gate_TM)
        proj(experts.up, x_TH, up_TM)
        be.swiglu(gate_TM, up_TM, lim, act_TM)
        proj(experts.down, act_TM, routed_SH)
        return RoutedRows(routed_SH)

    def _host(self, x_TH, ids_TK, experts, ws, routed_SH):
        be, shape = self.be, self.shape
        m, k, lim = shape.width, shape.top_k, shape.swiglu_limit
        gate_1M, up_1M, act_1M = (ws.view(b, 1, m) for b in ("a_gate", "a_up", "a_act"))
        ids = be.to_host(ids_TK)  # the deliberate stream sync of this debugging path
        for r, row in enumerate(ids.tolist()):
            for slot, e in enumerate(row):
                if not 0 <= e < shape.num_experts:
                    raise InputError(f"router selected expert {e} of {shape.num_experts} (row {r}, slot {slot})")
                local = experts.gate.local(e)
                if local is None:
                    continue  # another rank owns it; its zero row is in place
                x_1H = x_TH[r:r + 1]
                be.expert_linear(x_1H, experts.gate, local, gate_1M)
                be.expert_linear(x_1H, experts.up, local, up_1M)
                be.swiglu(gate_1M, up_1M, lim, act_1M)
                be.expert_linear(act_1M, experts.down, local, routed_SH[r * k + slot:r * k + slot + 1])
        return RoutedRows(routed_SH)

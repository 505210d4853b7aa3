"""The two MLP sites. Each forward is a short pipeline that ends in ONE visible all-reduce.

Sparse: route (with the shared expert's gate/up beside it where the workspace holds both) ->
experts -> shared (its down projection fused with the combine where the backend can; at one row,
both inside the routed down launch) -> combine -> all_reduce. The combine runs BEFORE the reduce,
so one collective sums both the EP partial (routed experts) and the TP partial (shared expert).
Dense: gate/up -> clamped SwiGLU -> down -> all_reduce (only when tp > 1); a dense FFN stored NVFP4 runs
the same on the routed experts' paths, as one expert that every row chooses.
Shape suffixes: T rows, H hidden, E experts, K top-k, I a projection width, S = T*K.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glm_ep.backend.base import Backend, DenseResident, MoeResident, RoutedExperts
from glm_ep.dist.comm import Communicator
from glm_ep.config.model import SiteConfig
from glm_ep.mlp.dispatch import ExpertDispatch, SharedTail
from glm_ep.mlp.expert_map import ExpertMap
from glm_ep.mlp.routing import RouteParams
from glm_ep.mlp.workspace import Workspace


def clamped_swiglu(be: Backend, w: DenseResident[Any], limit: float, x_TH: Any, ws: Workspace) -> Any:
    """``act(gate(x), up(x))`` of a bf16 MLP over this rank's TP shard, in the workspace."""
    t, width = x_TH.shape[0], w.width
    gate_TI, up_TI, act_TI = (ws.view(b, t, width) for b in ("a_gate", "a_up", "a_act"))
    return be.gate_up_act(x_TH, w, limit, gate_TI, up_TI, act_TI)


def clamped_swiglu_mlp(be: Backend, w: DenseResident[Any], limit: float, x_TH: Any, ws: Workspace,
                       out_TH: Any) -> Any:
    """``down(act(gate(x), up(x)))`` over this rank's TP shard (a partial sum when tp > 1)."""
    return be.linear(clamped_swiglu(be, w, limit, x_TH, ws), w.down, out_TH)


def nvfp4_mlp(be: Backend, dispatch: ExpertDispatch, mlp: RoutedExperts[Any], x_TH: Any, ws: Workspace,
              out_TH: Any) -> Any:
    """``down(act(gate(x), up(x)))`` of an NVFP4 MLP that every row runs (a dense FFN stored NVFP4), over
    this rank's TP shard: ``mlp`` is ONE expert (id 0) that every row chooses, run on the routed experts'
    paths (``dispatch`` has ``SiteConfig.dense_as_expert``'s geometry). With one slot a row, the routed
    rows ARE the output rows, in row order on every path (the sort by expert is stable), so they are
    written straight into ``out``, rounded where a dense MLP's are (gate, up, act, down)."""
    ids_T1 = ws.view("ids", x_TH.shape[0], 1)
    if dispatch.path_for(x_TH.shape[0]) not in ("sorted", "dequant"):  # one expert's GEMMs read no ids
        be.zero(ids_T1)
    dispatch(x_TH, ids_T1, mlp, ws, out_SH=out_TH)
    return out_TH


@dataclass
class DenseSite:
    be: Backend
    comm: Communicator
    cfg: SiteConfig
    mlp: DenseResident[Any] | RoutedExperts[Any] | None  # None on a replica that does not contribute
    nvfp4: ExpertDispatch | None = None  # the dispatch of an NVFP4 mlp (a one-expert RoutedExperts)

    sparse = False

    def __post_init__(self) -> None:
        if isinstance(self.mlp, RoutedExperts) != (self.nvfp4 is not None):
            raise ValueError("DenseSite: an NVFP4 mlp (RoutedExperts) comes with its dispatch, a bf16 one without")

    @property
    def reduces(self) -> bool:
        return self.cfg.reduces(sparse=False)

    def __call__(self, x_TH: Any, ws: Workspace, out_TH: Any) -> Any:
        if self.mlp is None:
            self.be.zero(out_TH)
        elif self.nvfp4 is not None:
            nvfp4_mlp(self.be, self.nvfp4, self.mlp, x_TH, ws, out_TH)
        else:
            clamped_swiglu_mlp(self.be, self.mlp, self.cfg.swiglu_limit, x_TH, ws, out_TH)
        return self.comm.all_reduce(out_TH) if self.reduces else out_TH


@dataclass
class MoeSite:
    be: Backend
    comm: Communicator
    cfg: SiteConfig
    moe: MoeResident[Any, Any]  # router, bias, expert tables; .shared may be None
    experts: ExpertDispatch
    expert_map: ExpertMap | None = None  # a placement's global id -> physical slot (None: the contiguous ranges)

    sparse = True

    @property
    def reduces(self) -> bool:
        return self.cfg.reduces(sparse=True)

    @property
    def route_params(self) -> RouteParams:
        c = self.cfg
        return RouteParams(c.top_k, c.routed_scale, c.renormalize, c.router_bf16)

    def route(self, x_TH: Any, ws: Workspace) -> tuple[Any, Any]:
        """Replicated on every rank (never sharded): the same ids everywhere, fp32 end to end."""
        t, e, k = x_TH.shape[0], self.cfg.num_experts, self.cfg.top_k
        ids_TK, wts_TK = ws.view("ids", t, k), ws.view("wts", t, k)
        self.be.route(x_TH, self.moe.router, self.moe.bias, self.route_params, ws.view("logits", t, e), ids_TK, wts_TK)
        return ids_TK, wts_TK

    def route_and_shared_glu(self, x_TH: Any, ws: Workspace) -> tuple[Any, Any, Any] | None:
        """``route`` and the shared expert's gate/up/SwiGLU together (one launch on CUDA at 1..8
        rows), the shared activations placed in ``a_gate``/``a_up``/``a_act`` PAST the routed
        experts' ``rows * top_k * moe_intermediate`` elements, so they outlive the routed experts.
        None where the buffers do not hold both (then the shared expert runs after the experts)."""
        t, e, k, width = x_TH.shape[0], self.cfg.num_experts, self.cfg.top_k, self.moe.shared.width
        start = t * k * self.cfg.moe_intermediate  # 16-byte aligned: NVFP4 widths are multiples of 16
        if not ws.fits("a_act", start + t * width):
            return None
        ids_TK, wts_TK = ws.view("ids", t, k), ws.view("wts", t, k)
        gate_TI, up_TI, act_TI = (ws.view(b, t, width, offset=start) for b in ("a_gate", "a_up", "a_act"))
        self.be.route_and_gate_up_act(x_TH, self.moe.router, self.moe.bias, self.route_params, ws.view("logits", t, e),
                                      ids_TK, wts_TK, self.moe.shared, self.cfg.swiglu_limit, gate_TI, up_TI, act_TI)
        return ids_TK, wts_TK, act_TI

    def __call__(self, x_TH: Any, ws: Workspace, out_TH: Any) -> Any:
        sh, t = self.moe.shared, x_TH.shape[0]
        early = self.route_and_shared_glu(x_TH, ws) if sh is not None else None
        ids_TK, wts_TK = early[:2] if early else self.route(x_TH, ws)
        if self.expert_map is not None:  # global ids -> this layer's physical slots, in place, on the device
            self.expert_map(self.be, ids_TK)
        shared_TH = ws.view("shared_out", t, self.cfg.hidden) if sh is not None else None
        # one row: the shared expert's down projection and the combine may run inside the routed down launch
        tail = SharedTail(early[2], sh.down, wts_TK, shared_TH, out_TH) if early and t == 1 else None
        routed_SH, perm_TK, tail_done = self.experts(x_TH, ids_TK, self.moe.experts, ws, tail)
        if sh is None:
            self.be.combine(routed_SH, wts_TK, None, out_TH, perm_TK)
        elif not tail_done:  # NOT scaled by routed_scaling_factor; its down projection ends in the combine
            act_TI = early[2] if early else clamped_swiglu(self.be, sh, self.cfg.swiglu_limit, x_TH, ws)
            self.be.shared_down_combine(act_TI, sh.down, routed_SH, wts_TK, shared_TH, out_TH, perm_TK)
        return self.comm.all_reduce(out_TH) if self.reduces else out_TH

"""The two MLP sites. Each forward is a short pipeline that ends in ONE visible all-reduce.

Sparse, as a straight pipeline: route -> experts -> shared -> combine -> all_reduce. Each stage hands
the next what it made (``Route``, ``RoutedRows``, ``SharedHalf``); the one-row fusions are the
backend's, decided inside its ops: the shared expert's gate/up beside the router (where the workspace
holds both), and its down projection with the combine (at one row inside the routed down launch). The
combine runs BEFORE the reduce, so one collective sums both the EP partial (routed experts) and the TP
partial (shared expert).
Dense: gate/up -> clamped SwiGLU -> down -> all_reduce (only when tp > 1). A dense FFN stored NVFP4 is a
site of its own (``Nvfp4DenseSite``): the same pipeline on the routed experts' paths, as one expert that
every row chooses.
Shape suffixes: T rows, H hidden, E experts, K top-k, I a projection width, S = T*K.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from glm_ep.backend.base import Backend, DenseResident, MoeResident, RoutedExperts, SharedGlu, SharedHalf
from glm_ep.dist.comm import Communicator
from glm_ep.config.model import SiteConfig
from glm_ep.config.topology import PathLevers
from glm_ep.mlp.dispatch import ExpertDispatch, ExpertShape, Route, expert_buffers
from glm_ep.mlp.expert_map import ExpertMap
from glm_ep.mlp.routing import RouteParams
from glm_ep.mlp.workspace import Buffer, Workspace, merged

BF16, F32, I32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.int32)


def mlp_buffers(width: int) -> tuple[Buffer, ...]:
    """gate, up and act of a bf16 MLP of ``width`` (a dense FFN's or a shared expert's TP shard): ``[rows, width]``."""
    return tuple(Buffer(b, BF16, lambda r: r * width) for b in ("a_gate", "a_up", "a_act"))


def site_buffers(cfg: SiteConfig, levers: PathLevers = PathLevers(), nvfp4_dense: bool = False) -> tuple[Buffer, ...]:
    """The scratch the sites of ``cfg``'s geometry declare, of every kind (one workspace serves any layer): the dense
    FFN's activations; the router's logits, ids and weights, the shared expert's activations and down output, the
    routed experts' paths (``expert_buffers``); with ``nvfp4_dense`` (this rank holds a dense FFN stored NVFP4), that
    FFN's paths too."""
    t_k, e, h = cfg.top_k, cfg.num_experts, cfg.hidden
    return merged((
        *mlp_buffers(cfg.local_dense_intermediate),
        Buffer("logits", F32, lambda r: r * e),
        Buffer("ids", I32, lambda r: r * t_k),
        Buffer("wts", F32, lambda r: r * t_k),
        *mlp_buffers(cfg.local_shared_intermediate),
        Buffer("shared_out", BF16, lambda r: r * h),
        *expert_buffers(ExpertShape.routed(cfg), levers),
        *(expert_buffers(ExpertShape.nvfp4_dense(cfg), levers) if nvfp4_dense else ()),
    ))


def clamped_swiglu(be: Backend, w: DenseResident[Any], limit: float, x_TH: Any, ws: Workspace) -> Any:
    """``act(gate(x), up(x))`` of a bf16 MLP over this rank's TP shard, in the workspace."""
    t, width = x_TH.shape[0], w.width
    gate_TI, up_TI, act_TI = (ws.view(b, t, width) for b in ("a_gate", "a_up", "a_act"))
    return be.gate_up_act(x_TH, w, limit, gate_TI, up_TI, act_TI)


def clamped_swiglu_mlp(be: Backend, w: DenseResident[Any], limit: float, x_TH: Any, ws: Workspace,
                       out_TH: Any) -> Any:
    """``down(act(gate(x), up(x)))`` over this rank's TP shard (a partial sum when tp > 1)."""
    return be.linear(clamped_swiglu(be, w, limit, x_TH, ws), w.down, out_TH)


class _DenseFrame:
    """What both dense sites do around their FFN: a replica that does not contribute (``mlp`` None) writes zeros,
    and the partial sums are all-reduced where the layout splits the dense FFN."""

    be: Backend
    comm: Communicator
    cfg: SiteConfig
    mlp: Any
    sparse = False

    @property
    def reduces(self) -> bool:
        return self.cfg.reduces(sparse=False)

    def __call__(self, x_TH: Any, ws: Workspace, out_TH: Any) -> Any:
        if self.mlp is None:
            self.be.zero(out_TH)
        else:
            self.ffn(x_TH, ws, out_TH)
        return self.comm.all_reduce(out_TH) if self.reduces else out_TH

    def ffn(self, x_TH: Any, ws: Workspace, out_TH: Any) -> None:
        raise NotImplementedError


@dataclass
class DenseSite(_DenseFrame):
    be: Backend
    comm: Communicator
    cfg: SiteConfig
    mlp: DenseResident[Any] | None  # None on a replica that does not contribute

    def ffn(self, x_TH: Any, ws: Workspace, out_TH: Any) -> None:
        clamped_swiglu_mlp(self.be, self.mlp, self.cfg.swiglu_limit, x_TH, ws, out_TH)


@dataclass
class Nvfp4DenseSite(_DenseFrame):
    """A dense FFN stored NVFP4 (ModelOpt's ``nvfp4_experts_dense_mlp`` exports): ``down(act(gate(x), up(x)))`` over
    this rank's TP shard on the routed experts' kernels, its ``mlp`` ONE expert that every row runs (``dispatch``:
    ``ExpertDispatch.nvfp4_dense``), rounded where a bf16 dense MLP's is (gate, up, act, down)."""

    be: Backend
    comm: Communicator
    cfg: SiteConfig
    mlp: RoutedExperts[Any] | None  # one expert, id 0; None on a replica that does not contribute
    dispatch: ExpertDispatch

    def __post_init__(self) -> None:
        if self.dispatch.shape != ExpertShape.nvfp4_dense(self.cfg):
            raise ValueError(f"Nvfp4DenseSite: a dispatch of {self.dispatch.shape}, expected the dense FFN's "
                             f"{ExpertShape.nvfp4_dense(self.cfg)}")

    def ffn(self, x_TH: Any, ws: Workspace, out_TH: Any) -> None:
        self.dispatch.every_row(x_TH, self.mlp, ws, out_TH)


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

    def route(self, x_TH: Any, ws: Workspace) -> Route:
        """Replicated on every rank (never sharded): the same ids everywhere, fp32 end to end. The shared
        expert's gate/up/SwiGLU run beside it (one launch on CUDA at 1..4 rows) where the workspace holds
        their activations PAST the routed experts' ``rows * top_k * moe_intermediate`` elements, so they
        outlive the routed experts."""
        t, e, k = x_TH.shape[0], self.cfg.num_experts, self.cfg.top_k
        ids_TK, wts_TK = ws.view("ids", t, k), ws.view("wts", t, k)
        beside = self._shared_beside(t, ws)
        self.be.route(x_TH, self.moe.router, self.moe.bias, self.route_params, ws.view("logits", t, e), ids_TK, wts_TK,
                      beside)
        return Route(ids_TK, wts_TK, beside)

    def _shared_beside(self, t: int, ws: Workspace) -> SharedGlu | None:
        """The shared expert's gate/up/act views past the routed experts' (16-byte aligned: NVFP4 widths are
        multiples of 16); None where the buffers do not hold both, or this rank holds no shared expert."""
        sh, start = self.moe.shared, t * self.cfg.top_k * self.cfg.moe_intermediate
        if sh is None or not ws.fits("a_act", start + t * sh.width):
            return None
        gate_TI, up_TI, act_TI = (ws.view(b, t, sh.width, offset=start) for b in ("a_gate", "a_up", "a_act"))
        return SharedGlu(sh, self.cfg.swiglu_limit, gate_TI, up_TI, act_TI)

    def shared(self, x_TH: Any, route: Route, ws: Workspace) -> SharedHalf | None:
        """The shared expert up to its down projection, which ends in the combine; NOT scaled by
        ``routed_scaling_factor``. Its activations as the router left them, or made now (in the routed
        experts' scratch, which they have finished with); None where this rank holds no shared expert."""
        sh, t = self.moe.shared, x_TH.shape[0]
        if sh is None:
            return None
        beside = route.shared  # made beside the router, or not yet
        act_TI = beside.act_TI if beside is not None else clamped_swiglu(self.be, sh, self.cfg.swiglu_limit, x_TH, ws)
        return SharedHalf(act_TI, sh.down, ws.view("shared_out", t, self.cfg.hidden))

    def __call__(self, x_TH: Any, ws: Workspace, out_TH: Any) -> Any:
        route = self.route(x_TH, ws)  # ids, wts [T, K]
        if self.expert_map is not None:  # a placement: global ids -> this layer's physical slots, in place, on device
            self.expert_map(self.be, route.ids_TK)
        routed = self.experts(x_TH, route, self.moe.experts, ws)  # [T*K, H] routed rows
        shared = self.shared(x_TH, route, ws)  # the shared expert's activations
        self.be.combine_site(routed, route.wts_TK, shared, out_TH)  # sum_k w_k * routed_k + shared: ONE rounding
        return self.comm.all_reduce(out_TH) if self.reduces else out_TH

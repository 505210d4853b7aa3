"""The CUDA backend: every op of ``Backend`` as a kernel of ``glm_ep/kernels`` on ONE stream.

| rows  | dense / shared MLP                         | router              | routed experts (NVFP4)                     |
|-------|--------------------------------------------|---------------------|--------------------------------------------|
| 1     | GEMV; gate + up + SwiGLU fused             | GEMV (fp32) + top-k, ONE launch, with the shared expert's gate + up | tensor-core GEMV, all slots in one persistent launch (whole-K warps, shared-memory ring), through the pointer table; gate + up + SwiGLU fused |
| 2..8  | batch-M GEMV, one weight read for all rows; from 5 rows the warp-streaming tensor-core GEMM (each warp its own rows and ring), gate + up + SwiGLU fused (the shared expert's gate + up then apart from the router's launch, its down apart from the combine) | same, one launch    | union table, each union expert swept once for all its rows (rows = the mma's B columns): on the decode ring's pipeline up to `ring_union_max_rows` rows, block kernels above |
| 9..64 | weights up to 2048 x 4096 (shared expert): gate + up in one batched cuBLAS call, then the SwiGLU; larger (dense FFN): gate + up + SwiGLU on the warp-streaming GEMM to 16 rows, cuBLAS otherwise; one projection (down): cuBLAS | cuBLAS, fp32 out (bf16 router) | below the crossover lever: row groups of <= 8; at or above it: sort by expert, ONE grouped tensor-core GEMM per projection (gate + up + SwiGLU in one; gemm_nvfp4.cu), indexed combine |
| > 64  | cuBLAS GemmEx (bf16, fp32 accumulation)    | cuBLAS, fp32 out    | the grouped GEMM                           |

Everything a step runs is queued on ``self.stream`` (non-blocking, current only inside each op:
CuPy's current stream is the caller's before and after), writes into the caller's buffers,
allocates nothing and never waits on the host for rows 1..8, so ``capture`` can record a whole
decode or verify step as one CUDA graph.
The wide prefill path (``sort_by_expert`` + ``moe_gemm_sorted``) sizes its grid from the slot
count on the host and never reads device data back, like every other op; a grid with fewer blocks
than SMs (one expert: a dense FFN stored NVFP4) splits K into the scratch the caller lends. How the one-row routed
kernels run is the frozen ``RingConfig`` the backend is built with (the topology's ring levers);
the operand form of each projection is fixed when its experts are uploaded. On sm_90 and later
every kernel is launched as a programmatic dependent of the one before it (``pdl``; the ``pdl``
lever), so a launch overlaps its predecessor's tail.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Mapping, Sequence

import numpy as np

from glm_ep.backend.base import Backend, DenseResident, ExpertTable, MoeResident, RoutedExperts
from glm_ep.backend.cuda import dense, elementwise, expert_ids, grouped, pdl, route_kernels as route
from glm_ep.backend.cuda import routed as NV
from glm_ep.backend.cuda.kernel_loader import BF16, CAPABILITIES, F32, GEMV_MAX_ROWS, MMA_ROWS, compute_capability, sm_count
from glm_ep.backend.cuda.routed import Nvfp4Pointers
from glm_ep.backend.cuda.ring import RingConfig, act_shift
from glm_ep.backend.cuda.scratch import scratch_buffers
from glm_ep.config.model import SiteConfig
from glm_ep.config.topology import PathLevers
from glm_ep.errors import ConfigError
from glm_ep.checkpoint.nvfp4 import Nvfp4Weight
from glm_ep.checkpoint.weights import DenseWeights, ExpertWeights, MoeWeights
from glm_ep.mlp.workspace import Buffer

log = logging.getLogger(__name__)

FUSED_TOPK_MAX_SMEM = 48 * 1024  # the fused router's top-k scratch within every device's default per block


def _on_stream(op):
    """Run the op with the backend's stream current (CuPy launches on the current stream) and its
    kernels launched as programmatic dependents where the backend uses them."""

    @functools.wraps(op)
    def run(self, *args, **kwargs):
        with self.stream, pdl.dependent_launches(self.pdl):
            return op(self, *args, **kwargs)

    return run


def _experts(expert_offsets: Any) -> int:
    """The experts a routing's offsets delimit (none: the one expert that takes every row)."""
    return 1 if expert_offsets is None else expert_offsets.size - 1


class CudaBackend(Backend[Any, Nvfp4Pointers]):
    name = "cuda"
    capabilities = CAPABILITIES

    def __init__(self, device: int = 0, ring: RingConfig = RingConfig(), stream: Any = None,
                 dependent_launch: bool = True):
        """``ring``: the one-row routed kernels' levers. ``stream``: the stream to queue on (default: a
        new non-blocking one; another backend's, to share its order). ``dependent_launch``: launch
        every kernel as a programmatic dependent of the one before it (``pdl``) where the device
        has it (sm_90 and later); elsewhere plain launches, said once in the log."""
        import cupy

        self.xp = cupy
        self.ring = ring
        self.device = cupy.cuda.Device(device)
        self.device.use()
        why_not = pdl.unsupported_reason(compute_capability(device)) if dependent_launch else None
        if why_not:
            log.info("programmatic dependent launch off: %s", why_not)
        self.pdl = dependent_launch and why_not is None
        # Every device op of the backend names this stream (``_on_stream``): it is never made CuPy's
        # current stream for good, since a ``with stream`` block (every op) ends by restoring the
        # stream below it on CuPy's stack, the default stream, whatever ``use()`` had set. A plain
        # CuPy op of the caller therefore runs on the caller's stream; ``interop.runtime_stream``
        # orders the two, and ``copy`` moves data on this one.
        self.stream = stream if stream is not None else cupy.cuda.Stream(non_blocking=True)
        # the kernels' scratch (``scratch_buffers``), made by the workspace and handed over by ``bind``: the fused
        # router's block counter, the counters of the K splits and the rings' claim counters stay zero between
        # launches (a launch on this stream touches memory only once the one before it has finished, with or without
        # programmatic dependent launch)
        self._route_done = self._wstream = self._down_combine = self._sort_counts = self._ring_claims = None
        self._said_unbound = False

    def buffers(self, cfg: SiteConfig, levers: PathLevers) -> tuple[Buffer, ...]:
        return scratch_buffers(self.ring, cfg, levers)

    def bind(self, scratch: Mapping[str, Any]) -> None:
        """The workspace's buffers of ``scratch_buffers``, made at load (zeroed counters zeroed on this stream): a call
        never allocates, and a graph captured after reads these (the workspaces that made them keep them alive). An
        op whose buffer is absent, or too small for its shapes, takes its unfused path."""

        def pair(name: str) -> tuple[Any, Any] | None:
            sums, counters = scratch.get(f"{name}_partials"), scratch.get(f"{name}_arrived")
            return None if sums is None or counters is None else (sums, counters)

        super().bind(scratch)
        self._route_done, self._wstream = scratch.get("route_done"), pair("wstream")
        self._down_combine, self._sort_counts = pair("down_combine"), scratch.get("sort_counts")
        self._ring_claims = scratch.get("ring_claims")

    def _has(self, scratch: Any, what: str) -> bool:
        """Whether ``scratch`` was bound; where no workspace bound any (ops called on a bare backend), say once that
        ``what`` and the other paths that need scratch take their unfused forms."""
        if scratch is None and self.bound is None and not self._said_unbound:
            self._said_unbound = True
            log.warning("CUDA backend used without a workspace (glm_ep.mlp.workspace.workspace_pool binds its "
                        "scratch): %s and the other paths that need scratch take their unfused forms", what)
        return scratch is not None

    def _claims(self) -> Any:
        """The rings' item counter where the ring claims items and a workspace bound one (else None: a fixed stride)."""
        c = self._ring_claims
        return c if self.ring.claims and c is not None and c.size >= 2 else None

    def _wstream_takes(self, x_RK, w_NK, glu: bool) -> bool:
        """``dense.wstream_takes`` with its split-K scratch bound."""
        return dense.wstream_takes(x_RK, w_NK, glu) and self._has(self._wstream, "the warp-streaming GEMM")

    @property
    def pci_bus_id(self) -> str:
        return self.xp.cuda.runtime.deviceGetPCIBusId(self.device.id)

    # ---- placement -------------------------------------------------------------------------
    @_on_stream
    def asarray(self, host: Any) -> Any:
        """A contiguous resident array: a copy of a host array (an array already on the device is
        only made contiguous)."""
        if isinstance(host, self.xp.ndarray):
            return self.xp.ascontiguousarray(host)
        src = np.ascontiguousarray(host)
        return self._upload(self.xp.empty(src.shape, dtype=src.dtype), src)

    def _upload(self, buf: Any, src: np.ndarray) -> Any:
        """``buf`` <- ``src`` (host, same shape and dtype), complete on return. A copy from pageable
        memory may still be reading ``src`` after the call that queued it returns (drivers that give
        the GPU access to pageable memory skip the pinned staging), and ``src`` is often a
        temporary: waiting for the stream here keeps it alive until the copy has read it."""
        buf.set(src, stream=self.stream)
        self.stream.synchronize()
        return buf

    def _bytes(self, a: Any) -> Any:
        """The raw bytes of a one-byte dtype (E4M3 scales) as a resident uint8 array."""
        if isinstance(a, self.xp.ndarray):
            return self.xp.ascontiguousarray(a).view(self.xp.uint8)
        return self.asarray(np.ascontiguousarray(a).view(np.uint8))

    def to_host(self, a: Any, out: np.ndarray | None = None) -> np.ndarray:
        return a.get(stream=self.stream, blocking=True, out=out)

    def pinned(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A page-locked host array (the host staging of the MPI all-reduce)."""
        import cupyx

        return cupyx.empty_pinned(shape, dtype=dtype)

    def from_host(self, buf: Any, host: np.ndarray) -> Any:
        """Copy ``host`` into the resident ``buf`` (same shape and dtype), complete on return."""
        return self._upload(buf, np.ascontiguousarray(host, dtype=buf.dtype))

    def synchronize(self) -> None:
        self.stream.synchronize()

    def capturing(self) -> bool:
        return self.stream.is_capturing()

    def capture(self, fn):
        with self.stream:
            self.stream.begin_capture()
            try:
                fn()
            except BaseException:
                self.stream.end_capture()
                raise
            graph = self.stream.end_capture()
        stream = self.stream
        return lambda: graph.launch(stream)

    @_on_stream
    def upload_dense(self, w: DenseWeights) -> DenseResident[Any]:
        """gate and up are the two halves of one allocation (up right after gate), so the wide path multiplies
        both in one batched GEMM (``dense.gemm_bf16_pair``)."""
        if w.gate.shape != w.up.shape or w.gate.dtype != w.up.dtype:
            raise ConfigError(f"dense mlp: gate {w.gate.dtype} {tuple(w.gate.shape)} and up {w.up.dtype} "
                              f"{tuple(w.up.shape)} differ")
        gate_up = self.xp.empty((2, *w.gate.shape), dtype=w.gate.dtype)
        for half, src in zip(gate_up, (w.gate, w.up)):
            if isinstance(src, self.xp.ndarray):
                half[...] = src
            else:
                self._upload(half, np.ascontiguousarray(src))
        return DenseResident(gate_up[0], gate_up[1], self.asarray(w.down))

    def _upload_proj(self, ws: list[Nvfp4Weight], what: str, form: str, xshift: int = 0) -> Nvfp4Pointers:
        shapes = {w.shape for w in ws}
        if len(shapes) > 1:
            raise ConfigError(f"{what}: experts disagree on the projection shape: {sorted(shapes)}")
        n, k = shapes.pop() if shapes else (0, 0)
        if ws:
            try:
                NV.check_nvfp4_k(k, what)
            except ValueError as e:  # a checkpoint's shape, or a TP split of it, the kernels cannot take
                raise ConfigError(f"{e}: the CUDA kernels read NVFP4 in 16-byte chunks (for a dense FFN stored "
                                  "NVFP4, intermediate_size / tp must be a multiple of 32)") from None
        packed = tuple(self.asarray(w.packed) for w in ws)
        scale = tuple(self._bytes(w.scale) for w in ws)
        s2 = tuple(float(w.scale_2) for w in ws)
        return Nvfp4Pointers(
            packed_ptrs=self.asarray(np.array([a.data.ptr for a in packed], dtype=np.uint64)),
            scale_ptrs=self.asarray(np.array([a.data.ptr for a in scale], dtype=np.uint64)),
            scale2=self.asarray(np.array(s2, dtype=np.float32)),
            n=n, k=k, packed=packed, scale=scale, scale2_host=s2, form=form, xshift=xshift)

    @_on_stream
    def upload_experts(self, experts: Sequence[ExpertWeights], start: int, swiglu_limit: float,
                       what: str = "experts") -> RoutedExperts[Nvfp4Pointers]:
        """The ring's operand form of each projection is fixed here, from ``swiglu_limit``
        (``RingConfig.forms``: a ConfigError where the levers ask for an fp16 form it does not bound)."""
        hidden_form, act_form = self.ring.forms(swiglu_limit)
        return RoutedExperts.of(self._upload_proj([e.gate for e in experts], f"{what}.gate_proj", hidden_form),
                                self._upload_proj([e.up for e in experts], f"{what}.up_proj", hidden_form),
                                self._upload_proj([e.down for e in experts], f"{what}.down_proj", act_form,
                                                  act_shift(swiglu_limit) if act_form == "placed" else 0),
                                start, len(experts))

    @_on_stream
    def upload_moe(self, w: MoeWeights, swiglu_limit: float) -> MoeResident[Any, Nvfp4Pointers]:
        if w.router.dtype not in (BF16, F32):
            raise ConfigError(f"router weight dtype {w.router.dtype}, expected bfloat16 or float32")
        experts = self.upload_experts(w.experts, w.expert_start, swiglu_limit)
        bias = self.asarray(w.bias).astype(np.float32, copy=False)
        return MoeResident(self.asarray(w.router), bias, experts,
                           self.upload_dense(w.shared) if w.shared is not None else None)

    # ---- dense ops -------------------------------------------------------------------------
    @_on_stream
    def linear(self, x_TK, w_NK, out_TN):
        if self._wstream_takes(x_TK, w_NK, glu=False):
            dense.wstream_gemm_bf16(x_TK, w_NK, out_TN, *self._wstream)
        elif x_TK.shape[0] <= GEMV_MAX_ROWS:
            dense.gemv_bf16(x_TK, w_NK, out_TN)
        else:  # cuBLAS, bf16 operands, fp32 accumulation (fastest from 9 rows: docs/perf/DESIGN-NOTES.md)
            dense.gemm_bf16(x_TK, w_NK, out_TN)
        return out_TN

    @_on_stream
    def router_logits(self, x_TH, router_EH, out_TE):
        if x_TH.shape[0] <= GEMV_MAX_ROWS:
            dense.router_gemv(x_TH, router_EH, out_TE)
        elif router_EH.dtype == BF16:  # cuBLAS: bf16 products are exact in fp32, fp32 sums and out
            dense.gemm_bf16(x_TH, router_EH, out_TE)
        else:  # an fp32 router: x upcast (a temporary: the wide path is never captured), fp32 GEMM
            x32 = self.xp.empty(x_TH.shape, dtype=np.float32)
            elementwise.bf16_to_f32(x_TH, x32)
            self.xp.matmul(x32, router_EH.T, out=out_TE)
        return out_TE

    @_on_stream
    def router_topk(self, logits_TE, bias_E, p, ids_TK, wts_TK):
        route.router_topk(logits_TE, bias_E, p, ids_TK, wts_TK)

    @staticmethod
    def _fused_route(logits_TE) -> bool:
        """Whether the router's GEMV and top-k run in one launch: 1..8 rows whose top-k scratch fits."""
        t, e = logits_TE.shape
        return t <= GEMV_MAX_ROWS and route.fused_topk_smem(t, e) <= FUSED_TOPK_MAX_SMEM

    @_on_stream
    def route(self, x_TH, router_EH, bias_E, p, logits_TE, ids_TK, wts_TK, beside=None):
        """1..8 rows: the router GEMV and its top-k in one launch (``route.router_topk_fused``); with ``beside``,
        the shared expert's gate + up in that launch too (``route_and_gate_up_act``)."""
        if beside is None and self._fused_route(logits_TE) and self._has(self._route_done, "the fused router"):
            route.router_topk_fused(x_TH, router_EH, bias_E, p, logits_TE, ids_TK, wts_TK, self._route_done)
        else:
            super().route(x_TH, router_EH, bias_E, p, logits_TE, ids_TK, wts_TK, beside)

    @_on_stream
    def route_and_gate_up_act(self, x_TH, router_EH, bias_E, p, logits_TE, ids_TK, wts_TK, w, limit, gate_TI, up_TI,
                              act_TI):
        """1..8 rows: the fused router and the GLU GEMV in one launch (``route.router_topk_glu_fused``); where the
        warp-streaming GEMM takes the GLU (``dense.wstream_takes``), the fused router alone, then that GEMM."""
        if (self._fused_route(logits_TE) and not self._wstream_takes(x_TH, w.gate, glu=True)
                and self._has(self._route_done, "the fused router")):
            route.router_topk_glu_fused(x_TH, router_EH, bias_E, p, logits_TE, ids_TK, wts_TK, self._route_done,
                                        w.gate, w.up, limit, gate_TI, up_TI, act_TI)
            return act_TI
        return super().route_and_gate_up_act(x_TH, router_EH, bias_E, p, logits_TE, ids_TK, wts_TK, w, limit,
                                             gate_TI, up_TI, act_TI)

    @_on_stream
    def swiglu(self, gate, up, limit, out):
        elementwise.swiglu(gate, up, limit, out)
        return out

    @_on_stream
    def combine(self, routed_SH, wts_TK, shared_TH, out_TH, perm_TK=None):
        elementwise.combine(routed_SH, wts_TK, shared_TH, out_TH, perm_TK)
        return out_TH

    @_on_stream
    def shared_down_combine(self, act_TI, down_HI, routed_SH, wts_TK, shared_TH, out_TH, perm_TK=None):
        """1..8 rows in (row, slot) order: one launch (``dense.gemv_combine_bf16``), unless the warp-streaming GEMM
        takes the down projection (``dense.wstream_takes``): that GEMM, then the combine."""
        if act_TI.shape[0] <= GEMV_MAX_ROWS and perm_TK is None and not self._wstream_takes(act_TI, down_HI, False):
            dense.gemv_combine_bf16(act_TI, down_HI, routed_SH, wts_TK, out_TH)
            return out_TH
        return super().shared_down_combine(act_TI, down_HI, routed_SH, wts_TK, shared_TH, out_TH, perm_TK)

    @_on_stream
    def moe_down_shared_combine(self, act_KM, table, ids_K, routed_KH, shared_act_1I, shared_down_HI, wts_1K,
                                shared_1H, out_1H):
        """One launch on the down ring (``routed.nvfp4_moe_down_combine``) where the ring takes the shapes and the bound
        scratch holds their sums; otherwise the routed down launch and ``shared_down_combine``."""
        proj = table.weights
        parts = self.ring.down_combine_parts(proj.n, proj.k, shared_down_HI.shape[1])
        sc = self._down_combine if parts and self._has(self._down_combine, "the one-row down ring's combine") else None
        if (sc is not None and sc[0].size >= parts * proj.n and sc[1].size >= proj.n // MMA_ROWS
                and NV.nvfp4_moe_down_combine(act_KM, table, ids_K, routed_KH, shared_act_1I, shared_down_HI, wts_1K,
                                              out_1H, *sc, self.ring, self._claims())):
            return out_1H
        return super().moe_down_shared_combine(act_KM, table, ids_K, routed_KH, shared_act_1I, shared_down_HI, wts_1K,
                                               shared_1H, out_1H)

    @_on_stream
    def add(self, a, b, out):
        elementwise.add(a, b, out)
        return out

    @_on_stream
    def map_expert_ids(self, ids_TK, table_EW, nrep_E, out_TK):
        expert_ids.map_expert_ids(ids_TK, table_EW, nrep_E, out_TK)
        return out_TK

    def zero(self, a):
        if not a.flags.c_contiguous:
            raise ValueError(f"zero: expected a contiguous buffer, got strides {a.strides}")
        if a.nbytes:
            self.xp.cuda.runtime.memsetAsync(a.data.ptr, 0, a.nbytes, self.stream.ptr)
        return a

    @_on_stream
    def copy(self, src, dst):
        """``dst[...] = src`` on the backend's stream, whatever stream CuPy has current."""
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(f"copy: {src.shape} {src.dtype} into {dst.shape} {dst.dtype}")
        dst[...] = src
        return dst

    @_on_stream
    def gate_up_act(self, x_TK, w, limit, gate_TI, up_TI, act_TI):
        if self._wstream_takes(x_TK, w.gate, glu=True):
            dense.wstream_glu_bf16(x_TK, w.gate, w.up, limit, gate_TI, up_TI, act_TI, *self._wstream)
        elif x_TK.shape[0] <= GEMV_MAX_ROWS:
            dense.glu_bf16(x_TK, w.gate, w.up, limit, gate_TI, up_TI, act_TI)
        elif w.gate.size <= dense.SMALL_WEIGHT_MAX:  # the shared expert's shape (or a dense FFN's tp >= 6 shard):
            # gate and up in one batched cuBLAS call
            dense.gemm_bf16_pair(x_TK, w.gate, w.up, gate_TI, up_TI)
            elementwise.swiglu(gate_TI, up_TI, limit, act_TI)
        else:  # the dense FFN's: two calls (measured level or faster than the pair, docs/perf/DESIGN-NOTES.md)
            return super().gate_up_act(x_TK, w, limit, gate_TI, up_TI, act_TI)
        return act_TI

    # ---- routed experts --------------------------------------------------------------------
    @_on_stream
    def moe_gemv(self, a, table: ExpertTable[Nvfp4Pointers], ids_K, out_KN, per_slot_input):
        NV.nvfp4_moe_gemv(a, per_slot_input, table, ids_K, out_KN, self.ring, self._claims())

    @_on_stream
    def moe_gate_up_act(self, a_1K, experts: RoutedExperts[Nvfp4Pointers], ids_K, limit, gate_KM, up_KM, act_KM):
        NV.nvfp4_moe_glu(a_1K, experts, ids_K, limit, gate_KM, up_KM, act_KM, self.ring, self._claims())

    @_on_stream
    def union_table(self, ids_RK, u_eid_U, u_slot_UR):
        route.union_table(ids_RK, u_eid_U, u_slot_UR)

    @_on_stream
    def moe_gemv_union(self, a, table: ExpertTable[Nvfp4Pointers], u_eid_U, u_slot_UR, out_RKN, per_slot_input):
        NV.nvfp4_moe_gemv_union(a, per_slot_input, table, u_eid_U, u_slot_UR, out_RKN, self.ring, self._claims())

    @_on_stream
    def moe_gate_up_act_union(self, a_RK, experts: RoutedExperts[Nvfp4Pointers], u_eid_U, u_slot_UR, limit, gate_RKM,
                              up_RKM, act_RKM):
        NV.nvfp4_moe_glu_union(a_RK, experts, u_eid_U, u_slot_UR, limit, gate_RKM, up_RKM, act_RKM, self.ring,
                               self._claims())

    @_on_stream
    def sort_by_expert(self, ids_TK, num_experts, sorted_token_ids_S, sorted_expert_ids_S, expert_offsets,
                       token_to_perm_TK):
        """Over several blocks where the slots fill them (``route.sort_blocks``), through the per-(block, expert)
        count scratch the workspace made for the sites' experts (``bind``: a call never allocates); one block where
        the scratch does not hold them (experts of another count than the workspace's sites')."""
        need = route.sort_blocks(ids_TK.size, sm_count()) * num_experts
        counts = self._sort_counts if self._sort_counts is not None and self._sort_counts.size >= need else None
        route.sort_by_expert(ids_TK, num_experts, sorted_token_ids_S, sorted_expert_ids_S, expert_offsets,
                             token_to_perm_TK, counts)

    @_on_stream
    def moe_gemm_sorted(self, a, table: ExpertTable[Nvfp4Pointers], sorted_token_ids_S, expert_offsets, out_SN,
                        gather_rows, scratch=None):
        grouped.nvfp4_gemm_sorted(a, gather_rows, sorted_token_ids_S, expert_offsets, _experts(expert_offsets),
                                  table, out_SN, scratch=scratch)

    @_on_stream
    def moe_gate_up_act_sorted(self, x_TK, experts: RoutedExperts[Nvfp4Pointers], sorted_token_ids_S, expert_offsets,
                               limit, gate_SM, up_SM, act_SM, scratch=None):
        grouped.nvfp4_gemm_sorted_glu(x_TK, sorted_token_ids_S, expert_offsets, _experts(expert_offsets), experts,
                                      limit, act_SM, scratch=scratch)

    @_on_stream
    def moe_experts_sorted(self, x_TK, experts: RoutedExperts[Nvfp4Pointers], sorted_token_ids_S, expert_offsets,
                           limit, gate_SM, up_SM, act_SM, out_SH, scratch=None):
        """One grouped-GEMM launch a projection (``grouped.nvfp4_experts_sorted``); where it takes the wgmma
        variant, x is staged into ``up`` (dead here: the fused gate + up launch writes only act) and act holds the
        staged k order."""
        grouped.nvfp4_experts_sorted(x_TK, sorted_token_ids_S, expert_offsets, _experts(expert_offsets), experts,
                                     limit, act_SM, out_SH, stage=up_SM, scratch=scratch)

    @_on_stream
    def expert_linear(self, a_1K, table: ExpertTable[Nvfp4Pointers], local, out_1N):
        w = table.weights
        NV.nvfp4_gemv(a_1K, w.packed[local], w.scale[local], w.scale2_host[local], out_1N)

    @_on_stream
    def dequant_linear(self, a_TK, table: ExpertTable[Nvfp4Pointers], local, w_NK, out_TN):
        """The weights dequantized by one launch (``grouped.nvfp4_dequant_bf16``), then ONE cuBLAS GemmEx with
        ``scale_2`` as its alpha (never captured: a wide path)."""
        grouped.nvfp4_dequant_bf16(table.weights, local, w_NK)
        dense.gemm_bf16(a_TK, w_NK, out_TN, alpha=table.weights.scale2_host[local])

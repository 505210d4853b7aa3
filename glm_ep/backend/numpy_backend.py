"""The NumPy reference backend: every op of ``Backend`` on the CPU, following the numerics
contract exactly (fp32 accumulation, bf16 only at the contract's rounding points).

Each path op walks the same data structure its CUDA twin does (the id list, the union table,
the expert-sorted order), so CI exercises the dispatch logic, not just the math.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import ml_dtypes
import numpy as np

from glm_ep.checkpoint import nvfp4
from glm_ep.mlp import expert_map, routing
from glm_ep.backend.base import KERNEL_LIMITS, Backend, DenseResident, ExpertTable, MoeResident, RoutedExperts
from glm_ep.checkpoint.nvfp4 import Nvfp4Weight
from glm_ep.checkpoint.weights import DenseWeights, ExpertWeights, MoeWeights

BF16 = ml_dtypes.bfloat16
#: one projection of every local expert, as read: local expert i is ``[i]``
Projection = tuple[Nvfp4Weight, ...]


def _f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float32, copy=False)


class NumpyBackend(Backend[np.ndarray, Projection]):
    name = "cpu"
    xp = np
    # the kernels' limits (it computes what they compute, so CI walks the same paths and refuses what a GPU
    # would); it records no graphs
    capabilities = KERNEL_LIMITS

    def asarray(self, host: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(host)

    def to_host(self, a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return np.array(a, copy=True)
        out[...] = a
        return out

    def upload_dense(self, w: DenseWeights) -> DenseResident[np.ndarray]:
        return DenseResident(w.gate, w.up, w.down)

    def upload_experts(self, experts: Sequence[ExpertWeights], start: int, swiglu_limit: float,
                       what: str = "experts") -> RoutedExperts[Projection]:
        # fp32 everywhere: no operand form to choose from the limit
        return RoutedExperts.of(tuple(e.gate for e in experts), tuple(e.up for e in experts),
                                tuple(e.down for e in experts), start, len(experts))

    def upload_moe(self, w: MoeWeights, swiglu_limit: float) -> MoeResident[np.ndarray, Projection]:
        experts = self.upload_experts(w.experts, w.expert_start, swiglu_limit)
        shared = self.upload_dense(w.shared) if w.shared is not None else None
        return MoeResident(w.router, _f32(w.bias), experts, shared)

    # ---- dense ops -------------------------------------------------------------------------
    def linear(self, x_TK, w_NK, out_TN):
        out_TN[...] = (_f32(x_TK) @ _f32(w_NK).T).astype(BF16)
        return out_TN

    def router_logits(self, x_TH, router_EH, out_TE):
        out_TE[...] = _f32(x_TH) @ _f32(router_EH).T
        return out_TE

    def router_topk(self, logits_TE, bias_E, p, ids_TK, wts_TK):
        ids, wts = routing.router_topk(logits_TE, bias_E, p)
        ids_TK[...] = ids
        wts_TK[...] = wts

    def swiglu(self, gate, up, limit, out):
        lim = np.float32(limit)
        g = np.minimum(_f32(gate), lim)
        u = np.clip(_f32(up), -lim, lim)
        with np.errstate(all="ignore"):  # remote slots activate unwritten scratch nobody reads
            silu = g / (np.float32(1.0) + np.exp(-g))
            out[...] = (silu * u).astype(BF16)
        return out

    def combine(self, routed_SH, wts_TK, shared_TH, out_TH, perm_TK=None):
        t, k = wts_TK.shape
        idx = (np.arange(t * k).reshape(t, k) if perm_TK is None else np.asarray(perm_TK))
        acc = np.zeros(out_TH.shape, dtype=np.float32)
        for slot in range(k):  # slot order is the accumulation order of the CUDA kernel
            acc += _f32(wts_TK[:, slot])[:, None] * _f32(routed_SH[idx[:, slot]])
        if shared_TH is not None:
            acc += _f32(shared_TH)
        out_TH[...] = acc.astype(BF16)
        return out_TH

    def map_expert_ids(self, ids_TK, table_EW, nrep_E, out_TK):
        out_TK[...] = expert_map.map_ids(ids_TK, table_EW, nrep_E)
        return out_TK

    def add(self, a, b, out):
        out[...] = (_f32(a) + _f32(b)).astype(BF16)
        return out

    # ---- routed experts --------------------------------------------------------------------
    @staticmethod
    def _expert_mm(a_MK: np.ndarray, w: Nvfp4Weight) -> np.ndarray:
        return (_f32(a_MK) @ nvfp4.dequantize(w).T).astype(BF16)

    def moe_gemv(self, a, table: ExpertTable[Projection], ids_K, out_KN, per_slot_input):
        for slot, e in enumerate(np.asarray(ids_K).reshape(-1).tolist()):
            local = table.local(e)
            if local is None:
                continue
            row = a[slot:slot + 1] if per_slot_input else a[0:1]
            out_KN[slot:slot + 1] = self._expert_mm(row, table.weights[local])

    def union_table(self, ids_RK, u_eid_U, u_slot_UR):
        u_eid, u_slot = routing.union_table(ids_RK)
        u_eid_U[...] = u_eid
        u_slot_UR[...] = u_slot

    def moe_gemv_union(self, a, table: ExpertTable[Projection], u_eid_U, u_slot_UR, out_RKN, per_slot_input):
        for u, e in enumerate(np.asarray(u_eid_U).tolist()):
            local = table.local(e) if e >= 0 else None
            if local is None:
                continue
            w = nvfp4.dequantize(table.weights[local])  # one weight sweep for every row that chose it
            for r, slot in enumerate(np.asarray(u_slot_UR[u]).tolist()):
                if slot < 0:
                    continue
                row = a[r, slot] if per_slot_input else a[r]
                out_RKN[r, slot] = (_f32(row)[None, :] @ w.T).astype(BF16)[0]

    def sort_by_expert(self, ids_TK, num_experts, sorted_token_ids_S, sorted_expert_ids_S,
                       expert_offsets, token_to_perm_TK):
        s = routing.sort_by_expert(ids_TK, num_experts)
        sorted_token_ids_S[...] = s.sorted_token_ids
        sorted_expert_ids_S[...] = s.sorted_expert_ids
        expert_offsets[...] = s.expert_offsets
        token_to_perm_TK[...] = s.token_to_perm

    def moe_gemm_sorted(self, a, table: ExpertTable[Projection], sorted_token_ids_S, expert_offsets, out_SN,
                        gather_rows, scratch=None):
        if expert_offsets is None:  # one expert, every row in order
            if table.count != 1 or sorted_token_ids_S is not None or a.shape[0] != out_SN.shape[0]:
                raise ValueError(f"moe_gemm_sorted without expert_offsets: one local expert (got {table.count}), no "
                                 f"sorted ids, and a row of a for each of the {out_SN.shape[0]} output rows (got "
                                 f"{a.shape[0]})")
            out_SN[...] = self._expert_mm(a, table.weights[0])
            return
        offsets = np.asarray(expert_offsets)
        for local in range(table.count):
            lo, hi = int(offsets[table.start + local]), int(offsets[table.start + local + 1])
            if lo == hi:
                continue
            rows = a[np.asarray(sorted_token_ids_S[lo:hi])] if gather_rows else a[lo:hi]
            out_SN[lo:hi] = self._expert_mm(rows, table.weights[local])

    def expert_linear(self, a_1K, table: ExpertTable[Projection], local, out_1N):
        out_1N[...] = self._expert_mm(a_1K, table.weights[local])

    def dequant_linear(self, a_TK, table: ExpertTable[Projection], local, w_NK, out_TN):
        w = table.weights[local]
        if tuple(w_NK.shape) != w.shape or w_NK.dtype != BF16:
            raise ValueError(f"dequant_linear: weight scratch {w_NK.dtype} {tuple(w_NK.shape)}, expected bfloat16 "
                             f"{w.shape}")
        w_NK[...] = nvfp4.dequantize_unscaled(w).astype(BF16)  # exact
        out_TN[...] = ((_f32(a_TK) @ _f32(w_NK).T) * np.float32(w.scale_2)).astype(BF16)


def _ieee(op: Callable[..., Any]) -> Callable[..., Any]:
    """``op`` under IEEE arithmetic without NumPy's warnings: an overflow is Inf or NaN in the outputs, as the CUDA
    kernels give it, which the callers report by name (``forward`` and ``run``: the layer and rows), never a
    RuntimeWarning quoting this file."""
    @functools.wraps(op)
    def quiet(*args: Any, **kwargs: Any) -> Any:
        with np.errstate(all="ignore"):
            return op(*args, **kwargs)
    return quiet


for _name, _op in list(vars(NumpyBackend).items()):  # every op (plain functions), and the base class's that call them
    if inspect.isfunction(_op) and not _name.startswith("_"):
        setattr(NumpyBackend, _name, _ieee(_op))

"""Pure routing math on NumPy: the router's top-k, row groups, the union table, sort by expert.

Naming convention (as in the CUDA kernels that mirror these):

* ``logits``: ``x @ router^T`` in fp32, ``[T, E]``.
* ``scores``: ``sigmoid(logits)``, unbiased; the chosen experts' weights come from these.
* ``choice``: ``scores + bias``: used ONLY to select experts.
* ``ids`` / ``wts``: ``[T, K]`` int32 global expert ids and fp32 weights per slot.

Shape suffixes: T rows, E experts, K top-k slots, R rows of one group, U union entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

RENORM_EPS = np.float32(1e-20)


@dataclass(frozen=True)
class RouteParams:
    top_k: int
    routed_scale: float
    renormalize: bool
    bf16_ladder: bool = False


def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def sigmoid_f32(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):
        return (np.float32(1.0) / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


def router_topk(logits_TE: np.ndarray, bias_E: np.ndarray, p: RouteParams) -> tuple[np.ndarray, np.ndarray]:
    """Top-k by ``scores + bias``; weights are the UNBIASED scores, renormalised, then scaled.

    Ties go to the lower expert id; a NaN choice ranks below every number, so NaN scores never
    produce an out-of-range or duplicate id. ``bf16_ladder`` rounds the logits, the scores and
    each weight stage to bf16 (the bias stays fp32 in both modes).
    """
    logits = np.asarray(logits_TE, dtype=np.float32)
    if p.bf16_ladder:
        logits = _bf16(logits)
    scores_TE = sigmoid_f32(logits)
    if p.bf16_ladder:
        scores_TE = _bf16(scores_TE)
    choice_TE = scores_TE + np.asarray(bias_E, dtype=np.float32)[None, :]
    key_TE = np.where(np.isnan(choice_TE), -np.inf, choice_TE)
    # stable sort of the negated key: among equal keys the lower id comes first
    ids_TK = np.argsort(-key_TE, axis=1, kind="stable")[:, : p.top_k].astype(np.int32)
    wts_TK = np.take_along_axis(scores_TE, ids_TK, axis=1).astype(np.float32)
    if p.renormalize:
        denom_T1 = np.sum(wts_TK, axis=1, keepdims=True, dtype=np.float32) + RENORM_EPS
        wts_TK = (wts_TK / denom_T1).astype(np.float32)
        if p.bf16_ladder:
            wts_TK = _bf16(wts_TK)
    wts_TK = (wts_TK * np.float32(p.routed_scale)).astype(np.float32)
    if p.bf16_ladder:
        wts_TK = _bf16(wts_TK)
    return ids_TK, wts_TK


def row_groups(rows: int, cap: int) -> list[tuple[int, int]]:
    """Split ``rows`` into consecutive ``(start, width)`` groups of at most ``cap``, as evenly as the
    count allows: 9 rows at cap 8 is 5 + 4, never 8 + 1 (there is no one-row batched tier)."""
    n = max(-(-rows // max(cap, 1)), 1)
    out, start = [], 0
    for i in range(n):
        w = -(-(rows - start) // (n - i))
        out.append((start, w))
        start += w
    return out


def union_table(ids_RK: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of a row group's chosen experts, in first-occurrence (row-major) order.

    Returns ``u_eid [R*K]`` (expert id per union entry, -1 unused) and ``u_slot [R*K, R]`` (the
    slot in which row r chose that expert, -1 if it did not)."""
    ids = np.asarray(ids_RK, dtype=np.int32)
    r, k = ids.shape
    flat = ids.reshape(-1)
    u_eid = np.full(r * k, -1, dtype=np.int32)
    u_slot = np.full((r * k, r), -1, dtype=np.int32)
    seen: dict[int, int] = {}
    for t, e in enumerate(flat.tolist()):
        if e not in seen:
            seen[e] = len(seen)
            u_eid[seen[e]] = e
        u_slot[seen[e], t // k] = t % k
    return u_eid, u_slot


@dataclass(frozen=True)
class SortedRoute:
    """Slots grouped by expert (a stable counting sort of the flat ``(row, slot)`` order)."""

    sorted_token_ids: np.ndarray  # [T*K] row of each sorted entry
    sorted_expert_ids: np.ndarray  # [T*K] expert of each sorted entry
    expert_offsets: np.ndarray  # [E+1] prefix sum over experts
    token_to_perm: np.ndarray  # [T, K] sorted position of each slot


def sort_by_expert(ids_TK: np.ndarray, num_experts: int) -> SortedRoute:
    ids = np.asarray(ids_TK, dtype=np.int32)
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable").astype(np.int32)
    counts = np.bincount(flat, minlength=num_experts)[:num_experts]
    offsets = np.zeros(num_experts + 1, dtype=np.int32)
    offsets[1:] = np.cumsum(counts)
    perm = np.empty(t * k, dtype=np.int32)
    perm[order] = np.arange(t * k, dtype=np.int32)
    return SortedRoute((order // k).astype(np.int32), flat[order].astype(np.int32), offsets,
                       perm.reshape(t, k))

"""Wrappers of the routing kernels: the router's top-k (``router.cu``; fused with the router GEMV of
1..8 rows in ``gemv_bf16.cu``), the union table of a row group and the counting sort by expert
(``moe_route.cu``). Each must match its NumPy twin in ``glm_ep.mlp.routing`` exactly, for the expert ids a router
writes (in [0, E): the sort does not place others, where the NumPy twin puts ids past E last).

Shape suffixes: T rows, R rows of one group, E experts, K top-k, S slots (T*K), U union entries.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from glm_ep.backend.cuda import dense as D
from glm_ep.backend.cuda.kernel_loader import (F32, I32, ROUTER_MAX_TOP_K, SORT_THREADS, U32, UNION_MAX_IDS, check,
                                        check_shape, i32, i64, launch, sm_count)
from glm_ep.errors import ConfigError
from glm_ep.mlp.routing import RouteParams

ROUTER_THREADS = 32  # one warp per row


# ---- router top-k ---------------------------------------------------------------------------------
def topk_args(what: str, t: int, e: int, bias_E: Any, p: RouteParams, ids_TK: Any, wts_TK: Any) -> tuple:
    """The top-k's checked arguments after the logits: bias, ids, wts, then ``TopkParams`` but E."""
    if not 1 <= p.top_k <= min(ROUTER_MAX_TOP_K, e):
        raise ValueError(f"{what}: top_k = {p.top_k}, expected 1..{min(ROUTER_MAX_TOP_K, e)}")
    check("bias", bias_E, F32, 4), check_shape("bias", bias_E, (e,))
    check("ids", ids_TK, I32, 4), check("wts", wts_TK, F32, 4)
    check_shape("ids", ids_TK, (t, p.top_k)), check_shape("wts", wts_TK, (t, p.top_k))
    return (bias_E, ids_TK, wts_TK, i32(p.top_k), np.float32(p.routed_scale), i32(int(p.renormalize)),
            i32(int(p.bf16_ladder)))


def router_topk(logits_TE: Any, bias_E: Any, p: RouteParams, ids_TK: Any, wts_TK: Any) -> None:
    t, e = logits_TE.shape
    check("logits", logits_TE, F32, 4)
    bias, ids, wts, *params = topk_args("router_topk", t, e, bias_E, p, ids_TK, wts_TK)
    launch("router.cu", "router_topk", (t, 1, 1), (ROUTER_THREADS, 1, 1),
           (logits_TE, bias, ids, wts, i32(e), *params), smem=8 * e)


def router_topk_fused(x_RH: Any, router_EH: Any, bias_E: Any, p: RouteParams, logits_RE: Any, ids_RK: Any,
                      wts_RK: Any, done: Any) -> None:
    """``router_gemv`` and ``route.router_topk`` in ONE launch (the same logits, ids and weights bit
    for bit): the block that finishes last runs the top-k. ``done``: one uint32, zero between
    launches (each launch leaves it zero), private to the stream."""
    r, k, e, grid_x, ksplit, wtag = D.router_geometry(x_RH, router_EH, logits_RE, "router_topk_fused")
    check("done", done, U32, 4), check_shape("done", done, (1,))
    topk = topk_args("router_topk_fused", r, e, bias_E, p, ids_RK, wts_RK)
    launch(D.GEMV, f"router_topk_{wtag}_r{r}", (grid_x, 1, 1), D.GEMV_BLOCK,
           (x_RH, i64(k), router_EH, logits_RE, i32(e), i32(k), i32(ksplit), *topk, done), smem=fused_topk_smem(r, e))


def router_topk_glu_fused(x_RH: Any, router_EH: Any, bias_E: Any, p: RouteParams, logits_RE: Any, ids_RK: Any,
                          wts_RK: Any, done: Any, wg_NH: Any, wu_NH: Any, limit: float, gate_RN: Any, up_RN: Any,
                          act_RN: Any) -> None:
    """``router_topk_fused`` and ``dense.glu_bf16`` on the same x in ONE launch (each output as the
    separate launches give it): the router's blocks first, then the GLU's."""
    r, k, e, router_blocks, ksplit, wtag = D.router_geometry(x_RH, router_EH, logits_RE, "router_topk_glu_fused")
    _, _, n, glu_blocks, glu_ksplit = D.glu_geometry(x_RH, wg_NH, wu_NH, gate_RN, up_RN, act_RN,
                                                     "router_topk_glu_fused")
    check("done", done, U32, 4), check_shape("done", done, (1,))
    bias, ids, wts, *params = topk_args("router_topk_glu_fused", r, e, bias_E, p, ids_RK, wts_RK)
    launch(D.GEMV, f"router_topk_glu_{wtag}_r{r}", (router_blocks + glu_blocks, 1, 1), D.GEMV_BLOCK,
           (x_RH, i64(k), router_EH, logits_RE, i32(e), i32(k), i32(ksplit), i32(router_blocks), bias, ids, wts,
            *params, done, wg_NH, wu_NH, gate_RN, up_RN, act_RN, i32(n), i32(glu_ksplit), np.float32(limit)),
           smem=fused_topk_smem(r, e))


def fused_topk_smem(rows: int, num_experts: int) -> int:
    """Dynamic shared memory of ``router_topk_fused``: a key and a score per expert and row."""
    return 8 * num_experts * rows


# ---- routing tables -----------------------------------------------------------------------------------
def union_table(ids_RK: Any, u_eid_U: Any, u_slot_UR: Any) -> None:
    r, k = ids_RK.shape
    if r * k > UNION_MAX_IDS:
        raise ValueError(f"union_table: rows * top_k = {r * k} exceeds the {UNION_MAX_IDS} ids of one block")
    check("ids", ids_RK, I32, 4), check("u_eid", u_eid_U, I32, 4), check("u_slot", u_slot_UR, I32, 4)
    check_shape("u_eid", u_eid_U, (r * k,)), check_shape("u_slot", u_slot_UR, (r * k, r))
    launch("moe_route.cu", "moe_union_table", (1, 1, 1), (r * k, 1, 1), (ids_RK, u_eid_U, u_slot_UR, i32(r), i32(k)))


SORT_CHUNK = 1024  # slots a block of the multi-block sort takes at least
# fewer slots take the one-block kernel: its device time there is about what the second launch costs an eager
# call (docs/perf/DESIGN-NOTES.md)
SORT_MULTI_MIN_SLOTS = 8192


def sort_smem(num_experts: int) -> int:
    """Dynamic shared memory of a sort block: a count per expert for the block and for each of its warps."""
    return 4 * num_experts * (1 + SORT_THREADS // 32)


SORT_STATIC_SMEM = 4 * (SORT_THREADS // 32)  # scan_starts' per-warp totals


def check_sort_fits(num_experts: int, limit: int, arch: str) -> None:
    """A ConfigError where a sort block for ``num_experts`` experts would need more shared memory than ``limit``
    (the device's opt-in limit a block), naming the largest expert count that fits and the lever that avoids
    the sort (wide calls then run as row groups)."""
    need = sort_smem(num_experts) + SORT_STATIC_SMEM
    if need > limit:
        most = (limit - SORT_STATIC_SMEM) // sort_smem(1)
        raise ConfigError(f"n_routed_experts = {num_experts}: the sort by expert of wide calls needs {need} bytes of "
                          f"shared memory a block, this device ({arch}) allows {limit} (at most {most} experts); "
                          "expected fewer experts, or levers.prefill_gemm = false (wide calls as row groups)")


def sort_blocks(slots: int, sms: int) -> int:
    """Blocks of the sort: 1 (the one-block kernel) below SORT_MULTI_MIN_SLOTS slots, else one per SORT_CHUNK
    slots, at most one an SM."""
    return 1 if slots < SORT_MULTI_MIN_SLOTS else max(1, min(-(-slots // SORT_CHUNK), sms))


def sort_by_expert(ids_TK: Any, num_experts: int, sorted_token_ids_S: Any, sorted_expert_ids_S: Any,
                   expert_offsets: Any, token_to_perm_TK: Any, counts: Any = None) -> None:
    """The stable counting sort by expert (``glm_ep.mlp.routing.sort_by_expert`` exactly, for ids in [0, E)). ONE
    block, or where ``counts`` (int32, at least blocks x experts, contents dead) is given and the slots fill several
    blocks, two launches: each block's per-expert counts, then each block places its chunk."""
    t, k = ids_TK.shape
    check("ids", ids_TK, I32, 4)
    for name, a, shape in (("sorted_token_ids", sorted_token_ids_S, (t * k,)),
                           ("sorted_expert_ids", sorted_expert_ids_S, (t * k,)),
                           ("expert_offsets", expert_offsets, (num_experts + 1,)),
                           ("token_to_perm", token_to_perm_TK, (t, k))):
        check(name, a, I32, 4), check_shape(name, a, shape)
    s, e = t * k, num_experts
    smem = sort_smem(e)
    blocks = sort_blocks(s, sm_count()) if counts is not None else 1
    if blocks > 1:
        check("counts", counts, I32, 4)
        if counts.size < blocks * e:
            raise ValueError(f"sort_by_expert: counts of {counts.size} int32, {blocks} blocks of {e} experts need "
                             f"{blocks * e}")
        launch("moe_route.cu", "moe_sort_count", (blocks, 1, 1), (SORT_THREADS, 1, 1),
               (ids_TK, i32(s), i32(e), counts), smem=smem)
        launch("moe_route.cu", "moe_sort_place", (blocks, 1, 1), (SORT_THREADS, 1, 1),
               (ids_TK, i32(s), i32(k), i32(e), counts, sorted_token_ids_S, sorted_expert_ids_S, expert_offsets,
                token_to_perm_TK), smem=smem)
        return
    launch("moe_route.cu", "moe_sort_by_expert", (1, 1, 1), (SORT_THREADS, 1, 1),
           (ids_TK, i32(s), i32(k), i32(e), sorted_token_ids_S, sorted_expert_ids_S,
            expert_offsets, token_to_perm_TK), smem=smem)

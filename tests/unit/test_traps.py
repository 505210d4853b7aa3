"""One test per trap of DESIGN §1, each built so that the tempting wrong implementation fails."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.config.model import RankLayout, SiteConfig
from glm_ep.mlp.dispatch import ExpertDispatch, Route
from glm_ep.checkpoint.nvfp4 import quantize
from glm_ep.mlp.routing import RENORM_EPS, RouteParams, router_topk, sort_by_expert, union_table
from glm_ep.config.topology import PathLevers
from glm_ep.checkpoint.weights import ExpertWeights, MoeWeights

from helpers import (BF16, RefParams, bf16_ulps, build_stack, mlp64, random_weights, random_x, ref64_layers, rel_l2,
                     route64, shard_layer, site64, tiny_model, workspace)


def _p(k: int, scale: float = 1.0, renorm: bool = False, ladder: bool = False) -> RouteParams:
    return RouteParams(top_k=k, routed_scale=scale, renormalize=renorm, bf16_ladder=ladder)


def _sig(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def test_bias_selects_but_weights_are_unbiased_scores() -> None:
    logits = np.array([[0.0, 1.0, 2.0, -1.0]], dtype=np.float32)
    bias = np.array([3.0, 0.0, 0.0, 0.0], dtype=np.float32)  # steers expert 0 in
    ids, wts = router_topk(logits, bias, _p(2))
    assert ids.tolist() == [[0, 2]]
    assert wts[0].tolist() == pytest.approx([_sig(0.0), _sig(2.0)], rel=1e-6)  # not 3.5, not 0.88 + 0
    ids, wts = router_topk(logits, bias, _p(2, scale=2.5, renorm=True))
    s0, s2 = _sig(0.0), _sig(2.0)
    assert wts[0].tolist() == pytest.approx([2.5 * s0 / (s0 + s2), 2.5 * s2 / (s0 + s2)], rel=1e-6)


@pytest.mark.parametrize("ladder", [False, True])
def test_bias_stays_fp32_near_7(ladder: bool) -> None:
    # bf16 spacing near 7 is 1/32: 7.012 rounds to 7.0, which hands the top-1 to expert 1
    bias = np.array([7.012, 7.0], dtype=np.float32)
    assert float(bias.astype(ml_dtypes.bfloat16)[0]) == 7.0
    logits = np.array([[0.0, math.log(0.51 / 0.49)]], dtype=np.float32)  # scores 0.5 and 0.51
    ids, _ = router_topk(logits, bias, _p(1, ladder=ladder))
    assert ids.tolist() == [[0]]
    rounded, _ = router_topk(logits, bias.astype(ml_dtypes.bfloat16).astype(np.float32), _p(1, ladder=ladder))
    assert rounded.tolist() == [[1]]  # the flip the fp32 bias exists to prevent


def test_bf16_router_rounds_the_logits_the_scores_and_each_weight_stage() -> None:
    """``moe_router_dtype = "bfloat16"`` (the ladder): hand values where each rounding shows. The logit 0.3 is
    0.30078125 in bf16, so its score is sigmoid(0.30078125) (0.57463...), itself rounded to bf16 (0.57421875);
    the renormalised weights and the scaled ones are rounded again. The fp32 router keeps every stage exact to
    fp32, and its choice among near-equal scores can differ."""
    def b(v: float) -> float:
        return float(np.float32(v).astype(ml_dtypes.bfloat16))

    logits = np.array([[0.3, -0.2, 1.1]], dtype=np.float32)
    bias = np.zeros(3, dtype=np.float32)
    ids, wts = router_topk(logits, bias, _p(2, scale=2.5, renorm=True, ladder=True))
    assert ids.tolist() == [[2, 0]]
    s2, s0 = b(_sig(b(1.1))), b(_sig(b(0.3)))
    assert (b(0.3), s0) == (0.30078125, 0.57421875)
    want = [b(b(s / (s2 + s0)) * 2.5) for s in (s2, s0)]
    assert wts[0].tolist() == pytest.approx(want, rel=1e-6, abs=0)
    assert all(float(np.float32(w).astype(ml_dtypes.bfloat16)) == w for w in wts[0].tolist())  # bf16 values
    _, exact = router_topk(logits, bias, _p(2, scale=2.5, renorm=True))
    assert exact[0].tolist() != wts[0].tolist()  # the fp32 router's weights are not those
    # the logit's own rounding shows in the weight: 1.004 is 1.0078125 in bf16, whose score rounds to 0.734375
    # where sigmoid(1.004) would round to 0.73046875
    one = np.array([[1.004]], dtype=np.float32)
    assert router_topk(one, np.zeros(1, np.float32), _p(1, ladder=True))[1].tolist() == [[0.734375]]
    assert b(_sig(1.004)) == 0.73046875
    # a rounding that changes the choice: scores 0.5 and sigmoid(0.003) = 0.50075 differ in fp32, tie in bf16
    tie = np.array([[0.0, 0.003]], dtype=np.float32)
    assert router_topk(tie, np.zeros(2, np.float32), _p(1))[0].tolist() == [[1]]
    assert router_topk(tie, np.zeros(2, np.float32), _p(1, ladder=True))[0].tolist() == [[0]]  # equal: lower id


def test_renorm_eps_is_1e20() -> None:
    assert RENORM_EPS == np.float32(1e-20)
    # all-zero scores (sigmoid of -inf): weights are 0, not NaN
    ids, wts = router_topk(np.full((2, 4), -np.inf, dtype=np.float32), np.zeros(4, np.float32),
                           _p(2, scale=2.5, renorm=True))
    assert wts.tolist() == [[0.0, 0.0], [0.0, 0.0]] and ids.tolist() == [[0, 1], [0, 1]]
    # a score of ~1e-20: the eps is half the denominator, so its exact value shows in the weight
    s = 1.0 / (1.0 + math.exp(46.0))
    _, wts = router_topk(np.array([[-46.0, -60.0]], dtype=np.float32), np.zeros(2, np.float32),
                         _p(1, renorm=True))
    assert wts[0, 0] == pytest.approx(s / (s + 1e-20), rel=1e-5)  # ~0.51; eps 0 gives 1, 1e-6 gives 0


def test_exact_ties_go_to_the_lower_id() -> None:
    ids, _ = router_topk(np.zeros((1, 8), np.float32), np.zeros(8, np.float32), _p(3))
    assert ids.tolist() == [[0, 1, 2]]
    # a wide tie (an unstable sort reorders these) and a tie that straddles the k-th slot
    ids, _ = router_topk(np.zeros((3, 288), np.float32), np.full(288, 7.0, np.float32), _p(8))
    assert ids.tolist() == [list(range(8))] * 3
    bias = np.zeros(64, np.float32)
    bias[[60, 41, 40, 9, 3]] = 1.0
    ids, _ = router_topk(np.zeros((1, 64), np.float32), bias, _p(4))
    assert ids.tolist() == [[3, 9, 40, 41]]
    levels = np.random.default_rng(0).integers(0, 3, size=288).astype(np.float32)  # 3 values, many ties
    ids, _ = router_topk(np.zeros((1, 288), np.float32), levels, _p(8))
    assert ids.tolist() == [np.flatnonzero(levels == levels.max())[:8].tolist()]
    bias = np.array([0, 0.25, 0, 0.25, 0, 0.25], dtype=np.float32)
    ids, _ = router_topk(np.zeros((1, 6), np.float32), bias, _p(2))
    assert ids.tolist() == [[1, 3]]
    # equal choices from different (score, bias) pairs: 0.75 + 0.25 == 0.5 + 0.5 exactly
    logits = np.array([[math.log(3.0), 0.0, 0.0]], dtype=np.float32)
    bias = np.array([0.25, 0.5, 0.0], dtype=np.float32)
    choice = 1 / (1 + np.exp(-logits[0])) + bias
    assert choice[0] == choice[1]
    assert router_topk(logits, bias, _p(1))[0].tolist() == [[0]]


def test_nan_scores_never_give_bad_or_duplicate_ids() -> None:
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((6, 32)).astype(np.float32)
    logits[0, :] = np.nan
    logits[1, ::2] = np.nan
    logits[2, 3] = np.nan
    ids, _ = router_topk(logits, np.full(32, 7.0, np.float32), _p(8, renorm=True))
    for r in range(6):
        row = ids[r].tolist()
        assert all(0 <= e < 32 for e in row) and len(set(row)) == 8, (r, row)
    assert not set(ids[1].tolist()) & set(range(0, 32, 2))  # NaN ranks below every number
    assert 3 not in ids[2].tolist() or np.sum(~np.isnan(logits[2])) < 8


def test_union_table_and_sort_by_expert_on_hand_examples() -> None:
    ids = np.array([[3, 1], [1, 2]], dtype=np.int32)
    u_eid, u_slot = union_table(ids)
    assert u_eid.tolist() == [3, 1, 2, -1]
    assert u_slot.tolist() == [[0, -1], [1, 0], [-1, 1], [-1, -1]]
    s = sort_by_expert(ids, num_experts=5)
    assert s.sorted_expert_ids.tolist() == [1, 1, 2, 3]
    assert s.sorted_token_ids.tolist() == [0, 1, 1, 0]  # stable: row 0's slot before row 1's
    assert s.expert_offsets.tolist() == [0, 0, 2, 3, 4, 4]
    assert s.token_to_perm.tolist() == [[3, 0], [1, 2]]
    u_eid, u_slot = union_table(np.array([[7, 2, 5], [5, 7, 0], [2, 9, 7]], dtype=np.int32))
    assert u_eid.tolist() == [7, 2, 5, 0, 9] + [-1] * 4
    assert u_slot[:5].tolist() == [[0, 1, 2], [1, -1, 0], [2, 0, -1], [-1, 2, -1], [-1, -1, 1]]


@pytest.mark.parametrize("limit,g,u,expected", [
    (10.0, 20.0, 0.5, 10 / (1 + math.exp(-10)) * 0.5),  # gate clamped from above
    (10.0, -20.0, 3.0, -20 / (1 + math.exp(20)) * 3.0),  # ... but NOT from below
    (10.0, 1.0, -30.0, 1 / (1 + math.exp(-1)) * -10.0),  # up clamped both ways
    (10.0, 1.0, 30.0, 1 / (1 + math.exp(-1)) * 10.0),
    (1.0, 5.0, 1.0, 1 / (1 + math.exp(-1))),  # clamp BEFORE the silu (after would give 1.0)
    (1.0, -3.0, 0.5, -3 / (1 + math.exp(3)) * 0.5),
    (10.0, 0.5, -2.0, 0.5 / (1 + math.exp(-0.5)) * -2.0),  # inside the limits: plain SwiGLU
])
def test_swiglu_clamp_is_asymmetric(limit: float, g: float, u: float, expected: float) -> None:
    out = np.empty((1, 1), dtype=BF16)
    NumpyBackend().swiglu(np.array([[g]], BF16), np.array([[u]], BF16), limit, out)
    assert float(out[0, 0]) == pytest.approx(expected, rel=2 ** -8)


def _one_sparse(**overrides):
    return tiny_model(num_hidden_layers=1, mlp_layer_types=["sparse"], **overrides)


def test_routed_scale_applies_to_routed_experts_not_to_the_shared_expert() -> None:
    model = _one_sparse()
    assert model.routed_scaling_factor == 2.5
    full = random_weights(model, seed=21)
    x = random_x(22, 6, model.hidden_size)
    p = RefParams.of(model)
    ref = ref64_layers(full)[0]
    # zero routed experts: the site is exactly the shared expert, unscaled
    zero = quantize(np.zeros((64, 128), np.float32)), quantize(np.zeros((128, 64), np.float32))
    no_routed = MoeWeights(full[0].router, full[0].bias, 0, (ExpertWeights(zero[0], zero[0], zero[1]),) * 32,
                           full[0].shared)
    y = build_stack([no_routed], model).site_output(0, x)
    assert rel_l2(y, mlp64(ref.mlp, p.limit, x.astype(np.float64))) < 1e-2
    # the whole site: shared + 2.5 * sum w * expert; scaling the shared output too would be 2.5x off
    y = build_stack(full, model).site_output(0, x)
    assert rel_l2(y, site64(ref, p, x)) < 1e-2
    # routed only (no shared expert): the scale is on the routed weights
    model0 = _one_sparse(n_shared_experts=0)
    routed = MoeWeights(full[0].router, full[0].bias, 0, full[0].experts, None)
    y = build_stack([routed], model0).site_output(0, x)
    ref.mlp = None
    assert rel_l2(y, site64(ref, p, x)) < 1e-2


def test_router_ranks_all_experts_on_an_ep_rank() -> None:
    model = _one_sparse()
    full = random_weights(model, seed=31, bias_spread=0.1)
    x = random_x(32, 12, model.hidden_size)
    whole = build_stack(full, model).sites[0]
    rank1 = build_stack(full, model, RankLayout(2, 1, 2, 2)).sites[0]
    assert rank1.cfg.num_experts == 32 and rank1.cfg.local_experts == 16
    r1, r2 = whole.route(x, build_stack(full, model).workspaces[0]), rank1.route(x, workspace(rank1.cfg, 12))
    ids1, wts1, ids2, wts2 = r1.ids_TK.copy(), r1.wts_TK.copy(), r2.ids_TK, r2.wts_TK
    np.testing.assert_array_equal(ids1, ids2)
    np.testing.assert_array_equal(wts1, wts2)  # renormalised over all top_k slots, local or not
    assert (ids2 < 16).any() and (ids2 >= 16).any()


@pytest.mark.parametrize("rows,levers", [
    (1, PathLevers()), (5, PathLevers()), (20, PathLevers(prefill_gemm=False)),
    (20, PathLevers(prefill_gemm_min_rows=9)), (5, PathLevers(host_dispatch=True)),
    (20, PathLevers(row_batch=False, prefill_gemm=False)),
], ids=["decode", "union", "row-groups", "sorted", "host", "decode-per-row"])
def test_remote_slots_are_exactly_zero(rows: int, levers: PathLevers) -> None:
    model = _one_sparse()
    full = random_weights(model, seed=41, bias_spread=0.1)
    layout = RankLayout(2, 1, 2, 2)  # EP rank 1 owns experts 16..31
    cfg = SiteConfig.for_rank(model, layout)
    be = NumpyBackend()
    moe = be.upload_moe(shard_layer(full[0], layout), cfg.swiglu_limit)
    ws = workspace(cfg, rows)
    ws.view("expert_out", rows * 8, model.hidden_size)[...] = np.nan  # stale bytes must never survive
    x = random_x(42, rows, model.hidden_size)
    route = build_stack(full, model).sites[0].route(x, workspace(cfg, rows))
    ids = route.ids_TK.copy()
    dispatch = ExpertDispatch.routed(be, cfg, levers)
    out = dispatch(x, Route(ids, route.wts_TK), moe.experts, ws)
    assert out.down is None  # no shared expert beside the router: every path ends with its down projection
    routed = out.rows_SH
    perm = np.arange(rows * 8).reshape(rows, 8) if out.perm_TK is None else np.asarray(out.perm_TK)
    remote = ids < 16
    assert remote.any() and (~remote).any()
    rows_remote = np.asarray(routed)[perm[remote]]
    assert (rows_remote.view(np.uint16) == 0).all()  # bitwise +0.0
    rows_local = np.asarray(routed, dtype=np.float32)[perm[~remote]]
    assert np.isfinite(rows_local).all() and (np.abs(rows_local).sum(axis=1) > 0).all()


def _route64_bf16(router: np.ndarray, bias: np.ndarray, p: RefParams, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bf16 router (``moe_router_dtype = "bfloat16"``) in float64, from its definition: the logits and the
    scores rounded to bf16 (nearest even), the fp32 bias added to select only, the chosen unbiased scores
    renormalised and rounded, then scaled and rounded again."""
    def bf16(a: np.ndarray) -> np.ndarray:
        return np.asarray(a, np.float64).astype(np.float32).astype(BF16).astype(np.float64)

    scores = bf16(1.0 / (1.0 + np.exp(-bf16(x.astype(np.float64) @ router.astype(np.float64).T))))
    ids = np.argsort(-(scores + bias.astype(np.float64)[None, :]), axis=1, kind="stable")[:, : p.top_k]
    wts = np.take_along_axis(scores, ids, axis=1)
    if p.renormalize:
        wts = bf16(wts / wts.sum(axis=1, keepdims=True))
    return ids, bf16(wts * p.routed_scale)


@pytest.mark.parametrize("rows", [1, 4])
def test_a_bf16_router_site_routes_as_the_bf16_router(rows: int) -> None:
    """``moe_router_dtype = "bfloat16"`` reaches the site: rows whose fp32 and bf16 choices differ (an expert whose
    score sigmoid(0.003) = 0.50075 beats 0.5 in fp32 and ties with it in bf16, where the lower id wins) take the
    bf16 router's experts and weights, on the route beside the shared expert and on the one after the experts."""
    model = _one_sparse(moe_router_dtype="bfloat16")
    assert model.router_bf16
    p, e, h = RefParams.of(model), model.n_routed_experts, model.hidden_size
    full = random_weights(model, seed=51)[0]
    # row r reads only column r of the router (x[r, 0:4] is one-hot), so its logits are that column exactly:
    # top-7 clear experts, the 8th slot between a 0.003 logit and the zero logits of the rest
    router = np.zeros((e, h), np.float32)
    tie = float(np.float32(0.003).astype(BF16))
    for r, (clear, near) in enumerate([(range(7), 31), (range(10, 17), 20), (range(20, 27), 29), (range(7), 8)]):
        router[list(clear), r] = 2.0 + 0.125 * np.arange(7)
        router[near, r] = tie
    bias = np.full(e, 7.0, np.float32)  # equal: the scores alone decide, as in a tie of the choices
    moe = MoeWeights(router.astype(BF16), bias, 0, full.experts, full.shared)
    x = random_x(52, 4, h).astype(np.float32)
    x[:, :4] = np.eye(4, dtype=np.float32)
    x = x.astype(BF16)[:rows]
    ids64, wts64 = _route64_bf16(router, bias, p, x)
    ref = ref64_layers([moe])[0]
    fp32_ids, _ = route64(ref, p, x.astype(np.float64))
    assert (np.sort(ids64, axis=1) != np.sort(fp32_ids, axis=1)).any(axis=1).all()  # every row's choice differs
    want = mlp64(ref.mlp, p.limit, x.astype(np.float64))
    for t in range(rows):
        for k in range(p.top_k):
            want[t] += wts64[t, k] * mlp64(ref.experts[ids64[t, k]], p.limit, x[t:t + 1].astype(np.float64))[0]
    for max_rows in (32, rows):  # shared gate/up beside the router, then after the experts
        stack = build_stack([moe], model, max_rows=max_rows)
        beside = stack.sites[0].route(x, stack.workspaces[0]).shared is not None
        assert beside == (max_rows == 32), max_rows
        y = stack.site_output(0, x).copy()
        ids = np.asarray(stack.workspaces[0].view("ids", rows, p.top_k)).copy()
        wts = np.asarray(stack.workspaces[0].view("wts", rows, p.top_k), np.float64).copy()
        np.testing.assert_array_equal(ids, ids64, err_msg=f"workspace of {max_rows} rows")
        assert (wts.astype(np.float32).astype(BF16).astype(np.float64) == wts).all(), wts  # bf16 values
        assert bf16_ulps(wts, wts64).max() <= 1, (wts, wts64)  # float64 vs fp32 sums may round a step apart
        assert rel_l2(y, want) < 1e-2, (max_rows, rel_l2(y, want))

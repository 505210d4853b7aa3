"""Balance by counting (``glm_ep.balance.counting``): slots and routed bytes per rank for a layout, from ids.

Hand-counted cases, the replica rule, and the decode figure at the GLM-5.3-Flash routing shape: 1000 seeded
one-row calls through a synthetic checkpoint's router at world 2, the busiest rank's routed bytes against the
mean, ~1.27 with ep 2 (a hypergeometric draw) and exactly 1 with moe_tp 2.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from glm_ep.balance.counting import ExpertLayout, Imbalance, expert_slice_bytes, rank_bytes, rank_slots
from glm_ep.checkpoint.synth import synthetic_router
from glm_ep.config.presets import preset
from glm_ep.mlp.expert_map import map_ids, replica_table
from glm_ep.mlp.routing import RouteParams, router_topk


def test_slots_and_bytes_per_rank_by_hand() -> None:
    ids = np.array([[0, 1, 5], [1, 2, 7]])  # 8 experts, ep 2: experts 0..3 on group 0, 4..7 on group 1
    ep2 = ExpertLayout.contiguous(8, 2)
    phys = ep2.physical(ids)
    assert phys.tolist() == ids.tolist()
    assert rank_slots(phys, ep2).tolist() == [4, 2]
    assert rank_bytes(phys, ep2, 10).tolist() == [30, 20]  # experts {0, 1, 2} and {5, 7}, each read once
    tp2 = ExpertLayout.contiguous(8, 1, 2)  # one group of two ranks: each runs every slot at half the width
    assert rank_slots(phys, tp2).tolist() == [6, 6]
    assert rank_bytes(phys, tp2, 5).tolist() == [25, 25]
    mixed = ExpertLayout.contiguous(8, 2, 2)  # ranks 0, 1: group 0; ranks 2, 3: group 1
    assert rank_slots(phys, mixed).tolist() == [4, 4, 2, 2]


def test_expert_slice_bytes_at_the_glm_shape() -> None:
    whole = expert_slice_bytes(4096, 2048)
    assert whole == 3 * (2048 * 4096 // 2 + 2048 * 4096 // 16 + 4)  # 14.16 MB: nibbles, block scales, scale_2
    assert expert_slice_bytes(4096, 2048, 2) == 3 * (1024 * 4096 // 2 + 1024 * 4096 // 16 + 4)


def test_the_replica_rule_is_round_robin_over_a_calls_slots() -> None:
    phys_expert = np.array([0, 1, 2, 3, 0, 4, 5, 0])  # expert 0 in slots 0, 4 and 7
    table, nrep = replica_table(phys_expert, 6)
    assert nrep.tolist() == [3, 1, 1, 1, 1, 1] and table[0].tolist() == [0, 4, 7]
    ids = np.array([[0, 1], [0, 2], [0, 3], [3, 0]])  # expert 0 at flat slots 0, 2, 4 and 7
    assert map_ids(ids, table, nrep).tolist() == [[0, 1], [7, 2], [4, 3], [3, 4]]  # 0 % 3, 2 % 3, 4 % 3, 7 % 3
    with pytest.raises(ValueError, match=r"experts \[5\] have no slot"):
        replica_table(np.array([0, 1, 2, 3, 4]), 6)


def test_imbalance_keeps_the_per_call_and_the_summed_figure() -> None:
    im = Imbalance()
    im.add(np.array([3, 1]))
    im.add(np.array([1, 3]))
    assert im.per_call == pytest.approx(1.5) and im.aggregate == pytest.approx(1.0)
    assert (im.busiest, im.mean) == (3.0, 2.0)


def _glm_decode_ids(rows: int, seed: int = 0) -> np.ndarray:
    """ids [rows, 8] of one-row calls at the GLM-5.3-Flash shape: the synthetic checkpoint's first sparse router
    (288 experts x 4096, bf16) on seeded unit-variance rows, the NumPy router."""
    cfg = preset("glm-5.3-flash")
    router_EH, bias_E = synthetic_router(cfg, cfg["first_k_dense_replace"], seed=seed)
    x_TH = np.random.default_rng(seed + 1).standard_normal((rows, cfg["hidden_size"])).astype(ml_dtypes.bfloat16)
    logits_TE = x_TH.astype(np.float32) @ router_EH.astype(np.float32).T
    ids, _ = router_topk(logits_TE, bias_E, RouteParams(cfg["num_experts_per_tok"], 2.5, True))
    return ids


def test_one_row_decode_at_world_2_moe_tp_is_balanced_ep_is_not() -> None:
    """The busiest rank's routed bytes / mean over 1000 one-row calls: 1.00 with moe_tp 2, ~1.27 with ep 2."""
    ids = _glm_decode_ids(1000)
    figures = {}
    for name, layout in (("ep 2", ExpertLayout.contiguous(288, 2)), ("moe_tp 2", ExpertLayout.contiguous(288, 1, 2))):
        im = Imbalance()
        for row in ids:
            im.add(rank_bytes(layout.physical(row[None]), layout, expert_slice_bytes(4096, 2048, layout.moe_tp)))
        figures[name] = im
    assert figures["moe_tp 2"].per_call == 1.0
    assert 1.22 < figures["ep 2"].per_call < 1.32, figures["ep 2"].per_call  # hypergeometric: E[max] / 4 = 1.27
    # a row's 8 experts over two ranks: 4 whole experts a rank on average, or 8 halves each (scale_2 in both halves)
    assert figures["ep 2"].mean == 4 * expert_slice_bytes(4096, 2048)
    assert figures["moe_tp 2"].mean == 8 * expert_slice_bytes(4096, 2048, 2)

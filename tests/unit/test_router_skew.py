"""``glm-ep synth --router-skew S``: routers whose expert load falls off Zipf-like along a seeded order of the
experts, written as the checkpoint holds them (``synthetic_router`` gives the same bits without writing)."""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.checkpoint.layers import load_layer
from glm_ep.checkpoint.reader import Checkpoint
from glm_ep.checkpoint.synth import skew_offsets, synthetic_router, write_synthetic
from glm_ep.config.model import RankLayout, SiteConfig
from glm_ep.config.presets import preset
from glm_ep.errors import InputError
from glm_ep.mlp.routing import RouteParams, router_topk


def _loads(router_EH: np.ndarray, bias_E: np.ndarray, rows: int = 4000) -> np.ndarray:
    x = np.random.default_rng(5).standard_normal((rows, router_EH.shape[1])).astype(np.float32)
    ids, _ = router_topk(x @ router_EH.astype(np.float32).T, bias_E, RouteParams(8, 2.5, True))
    return np.bincount(ids.reshape(-1), minlength=router_EH.shape[0])


def test_the_written_router_is_the_synthetic_router(tmp_path) -> None:
    cfg = preset("tiny")
    ckpt = write_synthetic(tmp_path / "skewed", cfg, seed=4, router_skew=1.5)
    with Checkpoint(ckpt) as ck:
        w = load_layer(ck, SiteConfig.for_rank(ck.config, RankLayout(1, 0, 1, 1)), 2)
    router, bias = synthetic_router(cfg, 2, seed=4, router_skew=1.5)
    assert np.array_equal(w.router.view(np.uint16), router.view(np.uint16))
    assert np.array_equal(w.bias.view(np.uint32), bias.view(np.uint32)) and bias.dtype == np.float32
    plain = synthetic_router(cfg, 2, seed=4)[1]  # no skew: the biases lowered by nothing but the skew's offsets
    np.testing.assert_array_equal(bias, (plain + skew_offsets(32, 1.5, 4, 2)).astype(np.float32))
    with pytest.raises(InputError, match="router skew -1.0, expected a finite number >= 0"):
        write_synthetic(tmp_path / "bad", cfg, router_skew=-1.0)


def test_the_load_falls_off_along_the_seeded_order() -> None:
    """At skew 2 the expert ranked j in the seeded order takes less the larger j (rank correlation < -0.8), and the
    hottest quarter of the experts takes more than 0.32 of the slots; without a skew neither holds."""
    cfg = preset("tiny")
    order = np.argsort(-skew_offsets(32, 1.0, 0, 1), kind="stable")  # hottest first
    flat, skewed = (_loads(*synthetic_router(cfg, 1, router_skew=s))[order] for s in (0.0, 2.0))
    rank_corr = np.corrcoef(np.arange(32), np.argsort(np.argsort(-skewed)))[0, 1]
    assert rank_corr > 0.8, rank_corr  # the j-th in the order is about the j-th hottest
    assert skewed[:8].sum() > 0.32 * skewed.sum() > flat[:8].sum(), (skewed[:8].sum(), flat[:8].sum())

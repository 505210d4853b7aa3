"""What one rank reads of a site (``glm_ep.checkpoint.layers``): its TP slices and EP ranges tile the full
tensors, replicas that do not contribute hold nothing, NVFP4 column slices sit on block boundaries."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from glm_ep.checkpoint.layers import load_layer, read_nvfp4
from glm_ep.checkpoint.reader import Checkpoint
from glm_ep.checkpoint.weights import DenseWeights, ExpertWeights, MoeWeights
from glm_ep.config.model import RankLayout, SiteConfig
from glm_ep.errors import ConfigError

LAYOUTS = [(1, 0, 1, 1), (2, 0, 2, 2), (2, 1, 2, 2), (2, 1, 1, 2), (2, 1, 2, 1)]
SPARSE = "model.layers.1.mlp"


def _site(ck: Checkpoint, layout: tuple[int, int, int, int]) -> SiteConfig:
    return SiteConfig.for_rank(ck.config, RankLayout(*layout))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "w%dr%dtp%dep%d" % l)
def test_load_layer_holds_this_ranks_share(tiny_checkpoint: Path, layout: tuple[int, int, int, int]) -> None:
    world, rank, tp, ep = layout
    with Checkpoint(tiny_checkpoint) as ck:
        m, cfg = ck.config, _site(ck, layout)
        h, il, sl = m.hidden_size, m.intermediate_size // tp, m.shared_intermediate // tp
        for i, kind in enumerate(m.mlp_layer_types):
            w = load_layer(ck, cfg, i)
            if kind == "dense":
                assert isinstance(w, DenseWeights)  # tp = 1 or first replica: every layout here computes it
                assert (w.gate.shape, w.up.shape, w.down.shape) == ((il, h), (il, h), (h, il))
                assert all(a.dtype == ml_dtypes.bfloat16 and a.flags.c_contiguous for a in (w.gate, w.up, w.down))
                continue
            assert isinstance(w, MoeWeights)
            assert w.router.shape == (m.n_routed_experts, h) and w.router.dtype == ml_dtypes.bfloat16
            assert w.bias.shape == (m.n_routed_experts,) and w.bias.dtype == np.float32
            assert w.expert_start == rank % ep * m.n_routed_experts // ep
            contributes_experts = ep == world or rank < ep
            assert len(w.experts) == (m.n_routed_experts // ep if contributes_experts else 0)
            for e in w.experts:
                assert e.gate.shape == e.up.shape == (m.moe_intermediate_size, h)
                assert e.down.shape == (h, m.moe_intermediate_size)
                assert e.gate.scale.dtype == ml_dtypes.float8_e4m3fn and e.gate.packed.dtype == np.uint8
            contributes_shared = not (tp > 1 or ep > 1) or rank < tp
            if contributes_shared:
                assert (w.shared.gate.shape, w.shared.down.shape) == ((sl, h), (h, sl))
            else:
                assert w.shared is None


def test_replicas_that_do_not_contribute(tiny_checkpoint: Path) -> None:
    with Checkpoint(tiny_checkpoint) as ck:
        w = load_layer(ck, _site(ck, (2, 1, 1, 2)), 1)
        assert w.shared is None and len(w.experts) == 16 and w.expert_start == 16
        w = load_layer(ck, _site(ck, (2, 1, 2, 1)), 1)
        assert w.experts == () and w.expert_start == 0 and w.shared is not None


def test_tp_slices_and_ep_ranges_tile_the_full_tensors(tiny_checkpoint: Path) -> None:
    with Checkpoint(tiny_checkpoint) as ck:
        full = [load_layer(ck, _site(ck, LAYOUTS[0]), i) for i in range(2)]
        parts = [[load_layer(ck, _site(ck, (2, r, 2, 2)), i) for r in range(2)] for i in range(2)]
    for whole, (r0, r1) in ((full[0], parts[0]), (full[1].shared, [p.shared for p in parts[1]])):
        for proj, axis in (("gate", 0), ("up", 0), ("down", 1)):
            cat = np.concatenate([getattr(r0, proj), getattr(r1, proj)], axis=axis)
            assert np.array_equal(cat.view(np.uint16), getattr(whole, proj).view(np.uint16))
    experts = parts[1][0].experts + parts[1][1].experts
    assert len(experts) == len(full[1].experts)
    for a, b in zip(experts, full[1].experts):
        for proj in ("gate", "up", "down"):
            pa, pb = getattr(a, proj), getattr(b, proj)
            assert np.array_equal(pa.packed, pb.packed) and pa.scale_2 == pb.scale_2
            assert np.array_equal(pa.scale.view(np.uint8), pb.scale.view(np.uint8))
    for p in parts[1]:
        assert np.array_equal(p.bias, full[1].bias)
        assert np.array_equal(p.router.view(np.uint16), full[1].router.view(np.uint16))


def test_nvfp4_dense_tp_slices_tile_the_full_projections(tiny_checkpoint_dense_nvfp4: Path) -> None:
    """A dense FFN stored NVFP4 loads as ``ExpertWeights``: gate/up split by rows, down by columns, whose
    packed bytes (K / 2) and block scales (K / 16) the two ranks' slices tile exactly, scale_2 whole."""
    with Checkpoint(tiny_checkpoint_dense_nvfp4) as ck:
        whole = load_layer(ck, _site(ck, LAYOUTS[0]), 0)
        parts = [load_layer(ck, _site(ck, (2, r, 2, 2)), 0) for r in range(2)]
        assert isinstance(load_layer(ck, _site(ck, LAYOUTS[0]), 1), MoeWeights)
    assert isinstance(whole, ExpertWeights) and all(isinstance(p, ExpertWeights) for p in parts)
    inter, hidden = ck.config.intermediate_size, ck.config.hidden_size
    assert whole.gate.shape == (inter, hidden) and whole.down.shape == (hidden, inter)
    assert parts[0].down.shape == (hidden, inter // 2)
    for proj, axis in (("gate", 0), ("up", 0), ("down", 1)):
        w, (a, b) = getattr(whole, proj), (getattr(p, proj) for p in parts)
        assert np.array_equal(np.concatenate([a.packed, b.packed], axis=axis), w.packed), proj
        assert np.array_equal(np.concatenate([a.scale, b.scale], axis=axis).view(np.uint8), w.scale.view(np.uint8))
        assert a.scale_2 == b.scale_2 == w.scale_2


def test_nvfp4_column_slices_must_sit_on_block_boundaries(tiny_checkpoint_dense_nvfp4: Path) -> None:
    with Checkpoint(tiny_checkpoint_dense_nvfp4) as ck:
        name, (inter, hidden) = f"{ck.layer_prefix(0)}.mlp.down_proj", (ck.config.intermediate_size,
                                                                        ck.config.hidden_size)
        assert read_nvfp4(ck, name, hidden, inter, cols=slice(16, 48)).shape == (hidden, 32)
        for bad in (slice(8, 40), slice(0, 40), slice(0, 64, 2)):
            with pytest.raises(ConfigError, match=r"expected a contiguous slice on 16-column block boundaries"):
                read_nvfp4(ck, name, hidden, inter, cols=bad)
        # a TP split of the dense width off those boundaries is named with the width
        odd = SiteConfig(**{**_site(ck, (2, 0, 2, 2)).__dict__, "local_dense_intermediate": inter // 2 - 8})
        with pytest.raises(ConfigError, match=r"TP slice of \d+ of the NVFP4 dense FFN's width"):
            load_layer(ck, odd, 0)

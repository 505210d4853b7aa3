"""Expert tensor parallelism (``moe_tp``): the rank layout, the refusals, and the partial sums.

Each routed expert's width is split over ``moe_tp`` consecutive ranks (gate/up rows, down columns, on
16-element NVFP4 blocks), the experts over ``ep`` groups of them. The ranks' partial site outputs, summed in
rank order with a bf16 rounding per add (the all-reduce's semantics), must give the one-rank output within
bf16 rounding on every path, and each (expert, slice) must be contributed by exactly one rank.
"""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.config.model import RankLayout, SiteConfig
from glm_ep.config.topology import PathLevers, Topology
from glm_ep.errors import ConfigError

from helpers import BF16, build_stack, random_weights, random_x, rel_l2, tiny_model

LAYOUTS = [(2, 2, 1, 2), (2, 1, 1, 2), (4, 2, 2, 2), (4, 4, 1, 4), (4, 1, 1, 2), (8, 2, 2, 2)]  # world, tp, ep, moe_tp


@pytest.mark.parametrize("world,tp,ep,moe_tp", LAYOUTS)
def test_each_expert_slice_is_contributed_by_exactly_one_rank(world: int, tp: int, ep: int, moe_tp: int) -> None:
    m = tiny_model()
    cfgs = [SiteConfig.for_rank(m, RankLayout(world, r, tp, ep, moe_tp)) for r in range(world)]
    held = sorted((e, c.moe_slice.start) for c in cfgs if c.ep_active()
                  for e in range(c.expert_start, c.expert_start + c.local_experts))
    width = m.moe_intermediate_size // moe_tp
    assert held == [(e, s * width) for e in range(m.n_routed_experts) for s in range(moe_tp)]
    assert all(c.moe_intermediate == width and c.reduces(True) for c in cfgs)


def test_expert_groups_are_moe_tp_consecutive_ranks() -> None:
    layouts = [RankLayout(8, r, 2, 2, 2) for r in range(8)]
    assert [(lay.ep_rank, lay.moe_tp_rank) for lay in layouts] == [(0, 0), (0, 1), (1, 0), (1, 1)] * 2
    assert [RankLayout(4, r, 4, 4).ep_rank for r in range(4)] == [0, 1, 2, 3]  # moe_tp = 1: rank % ep, as before


@pytest.mark.parametrize("make,named", [
    (lambda: RankLayout(4, 0, 1, 4, 2), "ep * moe_tp = 4 * 2 = 8 does not divide the world size 4"),
    (lambda: RankLayout(4, 0, 1, 1, 3), "moe_tp = 3 does not divide the world size 4"),
    (lambda: Topology(world=4, ep=4, moe_tp=2), "ep * moe_tp = 8 does not divide world = 4"),
    (lambda: Topology(world=2, moe_tp=0), "moe_tp = 0 does not divide world = 2"),
    (lambda: SiteConfig.for_rank(tiny_model(), RankLayout(8, 0, 1, 1, 8)),
     "moe_tp = 8: moe_intermediate_size 64 does not split into 8 slices on 16-element NVFP4 block boundaries"),
])
def test_a_layout_that_does_not_split_is_refused_by_name(make, named: str) -> None:
    with pytest.raises(ConfigError) as e:
        make()
    assert named in str(e.value), str(e.value)


def test_cuda_refuses_an_expert_slice_its_kernels_cannot_take_before_touching_a_device() -> None:
    """64 / 2 = 32 columns: a multiple of the 16-element block, not of the grouped GEMM's 64-k stage."""
    from glm_ep.backend import make_backend
    from glm_ep.dist.placement import Placement

    here = Placement(rank=0, world=2, node=0, local_rank=0, local_size=2, host="here")
    cfg = SiteConfig.for_rank(tiny_model(), RankLayout(2, 0, 2, 1, 2))
    with pytest.raises(ConfigError, match=r"moe_tp = 2: each rank's slice of a routed expert is 32 wide .* multiples "
                                          r"of 64"):
        make_backend(Topology(world=2, tp=2, moe_tp=2, backend="cuda"), here, cfg)


def _summed(outs: list[np.ndarray]) -> np.ndarray:
    """The all-reduce's sum: rank order, each add rounded to bf16."""
    acc = outs[0]
    for o in outs[1:]:
        acc = (acc.astype(np.float32) + o.astype(np.float32)).astype(BF16)
    return acc


@pytest.mark.parametrize("levers", [PathLevers(prefill_gemm_min_rows=24), PathLevers(host_dispatch=True)],
                         ids=["paths", "host"])
@pytest.mark.parametrize("world,tp,ep,moe_tp", LAYOUTS[:5])
def test_partial_sums_over_the_ranks_are_the_one_rank_site(world, tp, ep, moe_tp, levers) -> None:
    """Decode (1 row), union (5), sorted grouped GEMM (40), or the host path: every sparse and dense site."""
    m = tiny_model()
    full = random_weights(m, seed=3)
    one = build_stack(full, m, levers=levers, max_rows=40)
    stacks = [build_stack(full, m, RankLayout(world, r, tp, ep, moe_tp), levers=levers, max_rows=40)
              for r in range(world)]
    for rows in (1, 5, 40):
        x = random_x(rows, rows, m.hidden_size)
        for i in range(m.num_hidden_layers):
            want = np.array(one.site_output(i, x), copy=True)
            outs = [np.array(s.site_output(i, x), copy=True) for s in stacks]
            for got in [_summed(outs)] if stacks[0].sites[i].reduces else outs:  # else every rank computes it whole
                err = rel_l2(got, want)
                assert err < 1e-2, f"site {i}, {rows} rows: relative L2 {err:.3e}"
            if m.mlp_layer_types[i] == "sparse":  # each rank's routed part really is a part, not the whole
                part = np.array(stacks[0].sites[i].moe.experts.gate.weights[0].packed.shape)
                assert part[0] == m.moe_intermediate_size // moe_tp, part

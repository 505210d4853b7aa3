"""The load-aware placement (``glm_ep.balance.eplb``): EPLB per layer, its file, and the refusals.

Equal expert counts per rank, heaviest first onto the least-loaded rank, replicas of the hottest experts on
distinct ranks; a file that does not cover every expert exactly, names a rank outside ep, holds another layer
count or another model's experts is refused by name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from glm_ep.balance.eplb import balanced_placement, pack, read, replicate, spread
from glm_ep.errors import ConfigError

from helpers import tiny_model


def test_replicas_go_to_the_largest_load_per_replica() -> None:
    assert replicate(np.array([100, 10, 60, 1]), 3).tolist() == [3, 1, 2, 1]  # 100, 60, 50: 100/2=50 ties 60/1 next
    assert replicate(np.array([5, 5]), 0).tolist() == [1, 1]


def test_packing_gives_equal_counts_heaviest_first_and_balances() -> None:
    load = np.array([90, 80, 70, 60, 10, 10, 10, 10])
    phys = pack(load, np.ones(8, np.int64), 2)
    groups = [set(phys[:4].tolist()), set(phys[4:].tolist())]
    assert sorted(phys.tolist()) == list(range(8)) and all(len(g) == 4 for g in groups)
    sums = sorted(int(load[list(g)].sum()) for g in groups)
    assert sums == [170, 170], sums  # 90 + 60 + 10 + 10 against 80 + 70 + 10 + 10
    # replicas of one expert land on distinct ranks
    nrep = replicate(np.array([1000, 1, 1, 1, 1, 1]), 2)
    phys = pack(np.array([1000, 1, 1, 1, 1, 1]), nrep, 2)
    assert nrep[0] == 3 and phys.tolist().count(0) == 3 and (0 in phys[:4]) and (0 in phys[4:])


def test_a_placement_from_skewed_load_evens_the_ranks(tmp_path) -> None:
    rng = np.random.default_rng(0)
    counts = np.stack([rng.zipf(1.6, 32).clip(max=500) * 10 for _ in range(3)])  # [3 layers, 32 experts]
    placed = balanced_placement(counts, (1, 2, 3), ep=4, redundant=4)
    for j, phys in enumerate(placed.phys_expert):
        nrep = np.bincount(phys, minlength=32)
        share = counts[j] / nrep
        per_rank = [share[phys[g * 9:(g + 1) * 9]].sum() for g in range(4)]
        contiguous = [counts[j][g * 8:(g + 1) * 8].sum() for g in range(4)]
        assert max(per_rank) / np.mean(per_rank) <= max(contiguous) / np.mean(contiguous), (j, per_rank, contiguous)
    again = read(placed.save(tmp_path / "p.json"), tiny_model(), 4)
    assert again.digest == placed.digest and again.held(2, 1) == placed.phys_expert[1][9:18].tolist()
    with pytest.raises(ConfigError, match=r"--ep 5 --redundant 4: 32 experts \+ 4 replicas = 36 slots"):
        balanced_placement(counts, (1, 2, 3), ep=5, redundant=4)


def _file(tmp_path, layers: dict, ep: int = 2, redundant: int = 0, experts: int = 32):
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"format": "glm_ep expert placement 1", "ep": ep, "num_experts": experts,
                                "redundant": redundant, "layers": layers}))
    return path


def _halves(swap: tuple[int, int] | None = None) -> list[list[int]]:
    ranks = [list(range(16)), list(range(16, 32))]
    if swap:
        ranks[0][swap[0]] = swap[1]
    return ranks


@pytest.mark.parametrize("layers,kw,named", [
    ({"1": _halves((3, 20)), "2": _halves(), "3": _halves()}, {},
     "layer 1: experts [3] are missing, experts [20] placed more than once; expected every expert 0..31 exactly once"),
    ({"1": _halves(), "2": _halves((0, 1)), "3": _halves()}, {},
     "layer 2, rank 0: expert 1 twice on one rank"),
    ({"1": _halves(), "2": _halves()}, {},
     "layers ['1', '2'] (2 layers); expected the model's 3 sparse layers ['1', '2', '3']"),
    ({"1": _halves() + [[]], "2": _halves(), "3": _halves()}, {},
     "layer 1: 3 ranks (rank 2 is outside ep = 2); expected one list of experts for each of the ep = 2 ranks"),
    ({"1": _halves(), "2": _halves(), "3": _halves()}, {"experts": 16},
     "num_experts = 16, the model has 32; expected a placement of this model"),
    ({"1": _halves(), "2": _halves(), "3": [list(range(15)) + [40], list(range(16, 32))]}, {},
     "layer 3, rank 0: [0, 1, 2"),
    ({"1": _halves(), "2": _halves(), "3": _halves()}, {"ep": 4},
     "ep = 4, the topology has ep = 2; expected a placement made for ep = 2"),
    ({"1": _halves(), "2": _halves(), "3": _halves()}, {"redundant": 1},
     "redundant = 1: 32 experts + replicas do not split evenly over ep = 2"),
])
def test_a_bad_placement_is_refused_by_name(tmp_path, layers, kw, named: str) -> None:
    with pytest.raises(ConfigError) as e:
        read(_file(tmp_path, layers, **kw), tiny_model(), 2)
    assert named in str(e.value) and "placement.json" in str(e.value), str(e.value)


def test_a_placement_that_is_not_one_is_refused(tmp_path) -> None:
    (tmp_path / "x.json").write_text('{"layers": {}}')
    with pytest.raises(ConfigError, match=r"x.json: not an expert placement \(format None\)"):
        read(tmp_path / "x.json", tiny_model(), 2)
    with pytest.raises(ConfigError, match="nothing.json: expert placement file not found"):
        read(tmp_path / "nothing.json", tiny_model(), 2)
    (tmp_path / "d").mkdir()
    with pytest.raises(ConfigError, match=r"d: expert placement file is a folder \(topology expert_placement\); "
                       "expected a file written by glm-ep balance"):
        read(tmp_path / "d", tiny_model(), 2)


def test_replicas_stop_at_one_a_rank_and_every_count_up_to_the_bound_gives_a_valid_file(tmp_path) -> None:
    """An expert takes at most ep replicas (one copy a rank): the rest go to the next load per replica. Up to
    E x (ep - 1) replicas every placement is one ``read`` accepts (no expert twice on a rank); past the bound
    ``balance`` refuses by name, before any work (it wrote files ``run`` refused, and took minutes on huge counts)."""
    assert replicate(np.array([1000, 1, 1, 1]), 5, most=3).tolist() == [3, 2, 2, 2]
    with pytest.raises(ValueError):
        replicate(np.array([1, 1]), 3, most=2)
    rng = np.random.default_rng(1)
    counts = np.stack([rng.zipf(1.3, 32).clip(max=10_000) for _ in range(3)])
    for ep, redundant in ((2, 32), (2, 30), (4, 96), (4, 40), (8, 224)):
        placed = balanced_placement(counts, (1, 2, 3), ep=ep, redundant=redundant)
        again = read(placed.save(tmp_path / f"p{ep}_{redundant}.json"), tiny_model(), ep)
        for layer in (1, 2, 3):
            for g in range(ep):
                held = again.held(layer, g)
                assert len(set(held)) == len(held), (ep, redundant, layer, g, held)
    with pytest.raises(ConfigError, match=r"--ep 2 --redundant 34: a rank holds an expert at most once, so 32 "
                                          r"experts take at most 32 x \(ep - 1\) = 32 replicas"):
        balanced_placement(counts, (1, 2, 3), ep=2, redundant=34)



def test_a_replica_the_greedy_packing_put_twice_on_a_rank_moves_to_one_that_lacks_it() -> None:
    """``spread``: each copy past the first of an expert in a group swaps with an expert of a group without it, one
    the first group lacks; every expert keeps its count, every group its size."""
    for groups in ([[0, 0, 1], [2, 3, 4], [5, 6, 7]], [[3, 3, 3], [3, 1, 2], [4, 5, 6], [7, 8, 9]],
                   [[1, 2], [1, 1], [3, 4]]):
        before = sorted(x for g in groups for x in g)
        sizes = [len(g) for g in groups]
        out = spread([list(g) for g in groups])
        assert all(len(set(g)) == len(g) for g in out), out
        assert sorted(x for g in out for x in g) == before and [len(g) for g in out] == sizes, out
    rng = np.random.default_rng(3)
    for _ in range(300):  # whatever the loads, up to the bound: one copy of an expert a rank
        ep = int(rng.choice([3, 5, 6]))
        redundant = ep * int(rng.integers(-(-32 // ep), 33)) - 32  # slots a multiple of ep, up to 32 x ep
        phys = balanced_placement(rng.integers(0, 5, (1, 32)) ** 3, (1,), ep, redundant).phys_expert[0]
        per = phys.size // ep
        assert all(len(set(phys[g * per:(g + 1) * per].tolist())) == per for g in range(ep)), (ep, redundant)

"""``glm-ep run``'s float64 check, bounded: what each mode checks, the memory it takes on a
medium checkpoint, and that a sampled check still catches one wrong expert (FAIL, exit 3)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from glm_ep.app import jobs as jobs_module
from glm_ep.check import reference as reference_module
from glm_ep.check.plan import plan_check
from glm_ep.app.cli import build_parser
from glm_ep.config.model import ModelConfig
from glm_ep.errors import EXIT_FAIL, EXIT_OK
from glm_ep.dist.ranks import Ranks
from glm_ep.check.reference import Reference
from glm_ep.checkpoint.synth import write_synthetic

from ckpt_writer import read_f64
from cli_jobs import copy_checkpoint, glm_ep, set_bits, write_topology
from helpers import random_x, site64, tiny_dict

MEDIUM = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=6,
              n_routed_experts=64, num_experts_per_tok=4, mlp_layer_types=["dense"] + ["sparse"] * 5)
SAMPLED_PEAK_BOUND = 32e6  # bytes of float64 memory a sampled check of the medium checkpoint may take
MB = {"MB": 1e6, "GB": 1e9}


@pytest.fixture(scope="module")
def medium_checkpoint(tmp_path_factory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("medium") / "medium", tiny_dict(**MEDIUM), seed=1,
                           shard_bytes=8 * 2**20)


def _bytes(text: str, what: str) -> float:
    m = re.search(rf"{what} ([\d.]+) ([MG]B)", text)
    assert m, text[-3000:]
    return float(m[1]) * MB[m[2]]


def test_sampled_check_stays_small_where_the_full_check_would_not(medium_checkpoint) -> None:
    model = ModelConfig.from_file(medium_checkpoint / "config.json")
    calls = [16, 1, 1, 1, 3]
    full = plan_check(model, "full", calls, seed=0, world=2, budget_bytes=0)
    assert full.estimate_bytes > 10 * SAMPLED_PEAK_BOUND  # resident float64 experts: ~600 MB per rank
    r = glm_ep(2, "run", "--model", str(medium_checkpoint), "--check", "sampled", "--prefill", "16",
               "--decode", "3", "--verify", "3", timeout=300)
    assert r.returncode == EXIT_OK, r.stdout[-2000:] + r.stderr[-3000:]
    out = r.stdout
    assert re.search(r"^check: float64 sampled: layers \[0, 1, (\d, )*5\] of 6, \d+ of 22 rows over 5 calls", out,
                     re.M), out
    estimate, peak = _bytes(out, "memory estimate"), _bytes(out, "memory peak")
    assert 0 < peak <= estimate < SAMPLED_PEAK_BOUND, (peak, estimate)
    assert out.strip().splitlines()[-1] == "PASS"


def test_plan_modes() -> None:
    model = ModelConfig.from_dict(tiny_dict(**MEDIUM), source="medium")
    calls = [16, 1, 1, 3]
    full = plan_check(model, "full", calls, seed=0, world=2, budget_bytes=0)
    assert full.layers == tuple(range(6)) and full.rows == (tuple(range(16)), (0,), (0,), (0, 1, 2))
    assert plan_check(model, "auto", calls, 0, 2, budget_bytes=full.estimate_bytes).mode == "full"
    auto = plan_check(model, "auto", calls, 0, 2, budget_bytes=full.estimate_bytes - 1)
    assert auto.mode == "sampled" and auto.estimate_bytes < full.estimate_bytes / 10
    assert {0, 1, 5} <= set(auto.layers) and len(auto.layers) == 5  # first dense, first/last sparse, 2 more
    assert len(auto.rows[0]) == 4 and auto.rows[1:] == ((0,), (0,), (0, 1, 2))  # every decode row


@pytest.mark.parametrize("mode", ["full", "sampled"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_checked_layers_are_shared_out_over_the_ranks(mode: str, world: int) -> None:
    """Every checked layer is evaluated by exactly one rank: the ranks' shares are disjoint, together they are the
    plan's layers, and they are even (in turn: no rank takes two layers more than another)."""
    model = ModelConfig.from_dict(tiny_dict(**MEDIUM), source="medium")
    plan = plan_check(model, mode, [16, 1, 3], seed=3, world=world, budget_bytes=0)
    assert plan.mode == mode and len(plan.layers) == (6 if mode == "full" else 5)
    shares = [plan.layers_of(rank) for rank in range(world)]
    every = [i for share in shares for i in share]
    assert len(every) == len(set(every)), f"world {world}: a layer checked twice: {shares}"
    assert sorted(every) == list(plan.layers), f"world {world}: {shares} vs {plan.layers}"
    assert max(map(len, shares)) - min(map(len, shares)) <= 1, f"world {world}: uneven {shares}"


#: dense layers at 1, 3 and 6, so the first dense layer is neither layer 0 nor the only or last dense one
MIXED = ["sparse", "dense", "sparse", "dense", "sparse", "sparse", "dense", "sparse"]


@pytest.mark.parametrize("types", [MEDIUM["mlp_layer_types"], MIXED], ids=["medium", "mixed"])
def test_sampled_layers_are_the_first_dense_first_and_last_sparse_and_two_seeded(types: list[str]) -> None:
    """README: ``sampled`` checks the first dense layer, the first and last sparse layers and two seeded others;
    those three found here from the model's layer types."""
    model = ModelConfig.from_dict(tiny_dict(**{**MEDIUM, "num_hidden_layers": len(types), "mlp_layer_types": types}),
                                  source="mixed")
    first_dense = types.index("dense")
    sparse = [i for i, t in enumerate(types) if t == "sparse"]
    fixed = {first_dense, sparse[0], sparse[-1]}
    extras = {}
    for seed in range(8):
        layers = plan_check(model, "sampled", [16, 1], seed=seed, world=1, budget_bytes=0).layers
        assert list(layers) == sorted(set(layers)) and set(layers) <= set(range(len(types))), (seed, layers)
        assert fixed <= set(layers), f"seed {seed}: {layers} lacks one of {sorted(fixed)}"
        extras[seed] = tuple(sorted(set(layers) - fixed))
        assert len(extras[seed]) == 2, f"seed {seed}: {layers}, expected {sorted(fixed)} and two others"
        # every rank plans on its own: the same seed must give the same layers
        assert plan_check(model, "sampled", [16, 1], seed=seed, world=1, budget_bytes=0).layers == layers
    assert len(set(extras.values())) > 1, f"the two other layers do not follow the seed: {extras}"


GiB = 2**30


class _FakeRanks:
    """``Ranks`` as ``memory_budget`` uses it: ``allgather`` hands back every rank's (host, physical memory bytes),
    after checking that this rank gave its own."""

    def __init__(self, rank: int, every: list[tuple[str, int]]):
        self.rank, self.every = rank, every

    def allgather(self, site: str, value):
        assert value == self.every[self.rank], (self.rank, value)
        return list(self.every)


@pytest.mark.parametrize("every,budget", [
    ([("a", 64 * GiB), ("a", 64 * GiB), ("b", 48 * GiB)], 8 * GiB),  # host a's two ranks: 64 / 4 / 2
    ([("a", 64 * GiB), ("a", 64 * GiB), ("b", 24 * GiB)], 6 * GiB),  # host b's one rank: 24 / 4 / 1
], ids=["shared-host-least", "lone-host-least"])
def test_memory_budget_is_a_quarter_of_a_hosts_memory_per_rank_on_it(monkeypatch, every, budget) -> None:
    """README: ``auto`` is ``full`` where the estimate fits a quarter of the physical memory per rank of a node.
    Three ranks, two on host a, one on host b: each rank's budget is a quarter of its host's memory over the ranks
    on that host, the least over the ranks, the same on every rank."""
    from glm_ep.check import plan as check_plan

    real_sysconf = check_plan.os.sysconf
    for rank, (host, phys) in enumerate(every):
        sysconf = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": phys // 4096}
        monkeypatch.setattr(check_plan.os, "sysconf", lambda name, s=sysconf: s[name] if name in s
                            else real_sysconf(name))
        monkeypatch.setattr(check_plan.socket, "gethostname", lambda h=host: h)
        assert check_plan.memory_budget(_FakeRanks(rank, every)) == budget, (rank, host)


def test_the_sampled_check_of_the_tiny_model_stays_within_its_estimate(tiny_checkpoint) -> None:
    """At the tiny model's size the parsed checkpoint headers are most of the check's memory: their estimate per
    entry must cover the parse's peak (the sampled check measured 2.00 MB against an estimate of 1.41)."""
    r = glm_ep(2, "run", "--model", str(tiny_checkpoint), "--check", "sampled", "--prefill", "16", "--decode", "2",
               "--verify", "3")
    assert r.returncode == EXIT_OK, r.stderr[-3000:]
    assert 0 < _bytes(r.stdout, "memory peak") <= _bytes(r.stdout, "memory estimate"), r.stdout


def test_auto_checks_the_tiny_model_fully_and_none_skips(tiny_checkpoint) -> None:
    r = glm_ep(2, "run", "--model", str(tiny_checkpoint), "--prefill", "9", "--decode", "2", "--verify", "3")
    assert r.returncode == EXIT_OK, r.stderr[-3000:]
    assert "check: float64 full: layers [0, 1, 2, 3] of 4, 14 of 14 rows over 4 calls (16 site calls)" in r.stdout
    assert 0 < _bytes(r.stdout, "memory peak") <= _bytes(r.stdout, "memory estimate"), r.stdout  # an honest estimate
    assert r.stdout.strip().splitlines()[-1] == "PASS"
    for flag in (["--check", "none"], ["--no-check"]):
        skip = glm_ep(2, "run", "--model", str(tiny_checkpoint), "--prefill", "9", "--decode", "2", "--verify", "3",
                      *flag)
        assert skip.returncode == EXIT_OK and "check:" not in skip.stdout and "PASS" not in skip.stdout, skip.stdout


def test_the_check_runs_and_passes_on_nvfp4_dense_layers(tiny_checkpoint_dense_nvfp4) -> None:
    """The float64 reference decodes a dense FFN stored NVFP4 (it matches the tests' own decoder and site), and
    ``run``'s check over a checkpoint of them PASSes on 2 ranks (tp = ep = 2: the dense down projection's TP
    columns)."""
    x = random_x(6, 5, 128)
    layers, params = read_f64(tiny_checkpoint_dense_nvfp4)
    with Reference(tiny_checkpoint_dense_nvfp4) as ref:
        np.testing.assert_allclose(ref.site(0, x), site64(layers[0], params, x), rtol=1e-9, atol=1e-9)
    r = glm_ep(2, "run", "--model", str(tiny_checkpoint_dense_nvfp4), "--prefill", "9", "--decode", "2", "--verify",
               "3", "--tp", "2", "--ep", "2")
    assert r.returncode == EXIT_OK, r.stderr[-3000:]
    assert "check: float64 full: layers [0, 1, 2, 3] of 4" in r.stdout and r.stdout.strip().endswith("PASS"), r.stdout


def test_four_ranks_where_two_hold_the_nvfp4_dense_ffns(tiny_checkpoint_dense_nvfp4, tmp_path) -> None:
    """world 4, tp 2: ranks 2 and 3 hold no dense FFN, yet every rank takes part in the load's agreement on the
    dequant scratch (one collective each; a rank that skipped it hung the job), and the run's check PASSes with the
    dense sites on their dequant path (from 9 rows)."""
    topo = write_topology(tmp_path / "four.toml", {"nvfp4_dense_dequant_min_rows": 9}, name="four", world=4, tp=2,
                          ep=4, workspace_rows=16)
    r = glm_ep(4, "run", "--model", str(tiny_checkpoint_dense_nvfp4), "--prefill", "9", "--decode", "1",
               "--topology", str(topo))
    assert r.returncode == EXIT_OK, r.stderr[-3000:]
    assert r.stdout.strip().endswith("PASS"), r.stdout
    assert "dequant scratch:" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]


def test_sampled_reference_reads_only_the_chosen_experts(tiny_checkpoint, monkeypatch) -> None:
    read: list[str] = []
    real = reference_module.read_nvfp4
    monkeypatch.setattr(reference_module, "read_nvfp4",
                        lambda ck, prefix, *a: read.append(prefix) or real(ck, prefix, *a))
    x = random_x(4, 3, 128)
    with Reference(tiny_checkpoint, block_bytes=4096) as ref:  # blocks of 4 weight rows
        y = ref.site(2, x)
        ids, _ = ref.route(2, x)
    chosen = {f"model.layers.2.mlp.experts.{e}.{p}" for e in ids.ravel()
              for p in ("gate_proj", "up_proj", "down_proj")}
    assert set(read) == chosen and len(chosen) < 3 * 32
    layers, params = read_f64(tiny_checkpoint)  # the tests' own decoder and float64 site
    np.testing.assert_allclose(y, site64(layers[2], params, x), rtol=1e-9, atol=1e-9)


def test_sampled_check_fails_when_a_checked_expert_differs(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    """After the load, the scales of one expert a checked row chose change on disk: the float64
    sites no longer match what the runtime computed, so the sampled check FAILs with exit 3."""
    from mpi4py import MPI

    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "tiny")
    real = jobs_module.check_run
    corrupted: list[str] = []

    def corrupt_then_check(model_dir, plan, steps, traces, ranks, check_weights, loaded):
        layer = next(i for i in plan.layers if plan_layer_is_sparse(model_dir, i))
        rows = list(plan.rows[0])
        with Reference(model_dir) as ref:
            ids, _ = ref.route(layer, traces[0][layer][0][rows])
        key = f"model.layers.{layer}.mlp.experts.{int(ids[0, 0])}.down_proj.weight_scale"
        set_bits(Path(model_dir), key, (...,), 0x40)  # every block scale 2.0
        corrupted.append(key)
        # without the load's file stamps: the check must see the other numbers itself (with them, the rewrite is
        # refused as such: test_cli_reads)
        return real(model_dir, plan, steps, traces, ranks, check_weights)

    argv = ["run", "--model", str(ckpt), "--check", "sampled", "--prefill", "12", "--decode", "2", "--verify", "3"]
    assert jobs_module.run_job(build_parser().parse_args(argv), Ranks(MPI.COMM_SELF)) == EXIT_OK  # untouched
    monkeypatch.setattr(jobs_module, "check_run", corrupt_then_check)
    assert jobs_module.run_job(build_parser().parse_args(argv), Ranks(MPI.COMM_SELF)) == EXIT_FAIL
    assert corrupted


def plan_layer_is_sparse(model_dir: str, layer: int) -> bool:
    return ModelConfig.from_file(Path(model_dir) / "config.json").mlp_layer_types[layer] == "sparse"


@pytest.mark.parametrize("mode", ["full", "sampled"])
def test_a_bf16_router_model_passes_its_check(tiny_checkpoint, tmp_path, mode: str) -> None:
    """``moe_router_dtype: bfloat16``: the model routes on bf16 logits and scores, so the float64 evaluation the run
    checks against must choose as that model does (it routed in float64 and chose other experts: a FAIL at ~0.2
    relative L2 on a correct run)."""
    import json

    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "bf16-router")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | {"moe_router_dtype": "bfloat16"}))
    r = glm_ep(2, "run", "--model", str(ckpt), "--check", mode, "--decode", "4", "--prefill", "40")
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    err = float(re.search(r"max relative L2 error of a site vs float64 = ([\d.e+-]+)", r.stdout).group(1))
    assert err < 1e-2

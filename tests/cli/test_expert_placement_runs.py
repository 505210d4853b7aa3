"""Runs with a load-aware placement (the topology's ``expert_placement``), end to end on the NumPy backend.

A load recorded by ``forward --expert-load``, a placement from it (``glm-ep balance``), and ``run`` with that
placement passes its float64 check on every path (decode, union, sorted, host) at ep 2 with replicas and at
ep 2 x moe_tp 2, while the slots each rank counted itself equal what ``glm_ep.balance.counting`` says of the
recorded choices. Counted, not timed: at ep 8 (8 ranks, 256-row calls) on a checkpoint of GLM-5.3-Flash's
routing shape (288 experts, top-8) with skewed routers, the placement made from one recorded load brings the
busiest rank's slots over the mean of a fresh load to <= 1.05. A bad placement is an error on every rank.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np

from glm_ep.balance import expert_load
from glm_ep.balance.counting import ExpertLayout, rank_slots
from glm_ep.checkpoint.synth import write_synthetic
from glm_ep.config.presets import preset

from cli_jobs import fails, glm_ep, mpi_env, save_hidden, write_topology
from helpers import REPO, random_x

#: GLM-5.3-Flash's routing shape (288 experts, top-8, its scaling) on narrow widths, one dense + one sparse layer
GLM_ROUTING = dict(preset("glm-5.3-flash"), hidden_size=256, intermediate_size=256, moe_intermediate_size=32,
                   num_hidden_layers=2, first_k_dense_replace=1)


def _balance(load, ep: int, out, redundant: int = 0) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "glm_ep", "balance", "--load", str(load), "--ep", str(ep),
                        "--redundant", str(redundant), "--out", str(out)], capture_output=True, text=True,
                       timeout=120, env=mpi_env(), cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def _record(world: int, model, x, path, tmp_path, **topology) -> expert_load.ExpertLoad:
    topo = write_topology(tmp_path / f"{path.stem}.toml", world=world, tp=topology.pop("tp", world),
                          ep=topology.pop("ep", world), **topology)
    r = glm_ep(world, "forward", "--model", str(model), "--input", str(save_hidden(tmp_path / f"{path.stem}-x.st", x)),
               "--output", str(tmp_path / f"{path.stem}-y.st"), "--topology", str(topo), "--expert-load", str(path),
               timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return expert_load.read(path)


def _counted(load: expert_load.ExpertLoad) -> np.ndarray:
    """[layers, ranks]: the slots counting gives each rank for the recorded calls under the recorded layout."""
    lay = load.layout
    out = np.zeros(load.rank_slots.shape, np.int64)
    for j, ids in enumerate(load.choices):
        phys = load.placement[j] if load.placement is not None else np.arange(load.num_experts)
        layout, start = ExpertLayout(lay["ep"], lay["moe_tp"], phys), 0
        for rows in load.call_rows[j].tolist():
            out[j, :layout.ranks] += rank_slots(layout.physical(ids[start:start + rows]), layout)
            start += rows
    return out


def test_runs_with_a_placement_pass_their_check_on_every_path(tiny_checkpoint, tmp_path) -> None:
    first = _record(2, tiny_checkpoint, random_x(1, 300, 128), tmp_path / "load.safetensors", tmp_path)
    _balance(tmp_path / "load.safetensors", 2, tmp_path / "p2.json", redundant=2)
    runs = {"ep2-r2": (2, dict(tp=2, ep=2, expert_placement="p2.json"), {}),
            "ep2-moetp2-host": (4, dict(tp=2, ep=2, moe_tp=2, expert_placement="p2.json"), {"host_dispatch": True})}
    for name, (world, values, levers) in runs.items():
        topo = write_topology(tmp_path / f"{name}.toml", levers or None, world=world, backend="cpu", **values)
        r = glm_ep(world, "run", "--model", str(tiny_checkpoint), "--topology", str(topo), "--prefill", "40",
                   "--decode", "2", "--verify", "4", "--check", "full", "--expert-load", str(tmp_path / f"{name}.st"),
                   timeout=300)
        assert r.returncode == 0 and r.stdout.rstrip().endswith("PASS"), (name, r.stdout[-2000:], r.stderr[-2000:])
        assert "expert placement: " in r.stderr and "(34 slots over ep = 2, 2 redundant;" in r.stderr, r.stderr
        load = expert_load.read(tmp_path / f"{name}.st")
        assert load.placement is not None and load.layout["expert_placement"]
        np.testing.assert_array_equal(load.rank_slots, _counted(load), err_msg=name)  # the ranks ran what counting says
    assert first.placement is None


def test_a_bad_placement_is_an_error_on_every_rank(tiny_checkpoint, tmp_path) -> None:
    _record(2, tiny_checkpoint, random_x(2, 8, 128), tmp_path / "load.safetensors", tmp_path)
    _balance(tmp_path / "load.safetensors", 2, tmp_path / "p.json")
    text = (tmp_path / "p.json").read_text()
    (tmp_path / "p.json").write_text(text.replace("[0, ", "[1, ", 1))  # expert 0 gone from layer 1, 1 twice
    topo = write_topology(tmp_path / "t.toml", world=2, tp=2, ep=2, expert_placement="p.json")
    r = glm_ep(2, "run", "--model", str(tiny_checkpoint), "--topology", str(topo), "--no-check")
    fails(r, "p.json: layer 1", "expected every expert 0..31 exactly once")


def test_a_placement_from_recorded_load_balances_ep_8(tmp_path) -> None:
    """8 ranks, NumPy backend, 256-row calls, router skew 2: the busiest rank's slots over the mean, summed over
    a fresh load's calls, with the placement (counted by the ranks themselves) and before it (the same calls
    under the contiguous ranges, counted). The load is recorded at world 1: the router's choices are the same
    on every layout."""
    model = write_synthetic(tmp_path / "glm-routing", GLM_ROUTING, seed=0, router_skew=2.0)
    _record(1, model, random_x(10, 8192, 256), tmp_path / "recorded.safetensors", tmp_path, workspace_rows=256)
    r = _balance(tmp_path / "recorded.safetensors", 8, tmp_path / "p8.json")
    after = _record(8, model, random_x(11, 8192, 256), tmp_path / "after.safetensors", tmp_path, workspace_rows=256,
                    expert_placement="p8.json")
    assert after.call_rows[0].tolist() == [256] * 32
    contiguous = dict(after.layout, expert_placement="")
    before = _counted(dataclasses.replace(after, layout=contiguous, placement=None))
    ratio = {"before": float(before.max() / before.mean()), "after": float(after.rank_slots.max() /
                                                                             after.rank_slots.mean())}
    print(f"ep 8, 256-row calls, a fresh load: busiest rank's slots / mean {ratio['before']:.3f} contiguous, "
          f"{ratio['after']:.3f} placed\n{r.stdout}")
    assert ratio["after"] <= 1.05 < 1.3 < ratio["before"], ratio

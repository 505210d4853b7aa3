"""``glm-ep bench --topology``: the levers a card's topology gives its timed sites, named in the results file,
and the topologies and benches it is refused with before any device is touched (no GPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from glm_ep.bench import bench_levers
from glm_ep.bench.common import bench_meta, results_header
from glm_ep.config.topology import PathLevers, Topology
from glm_ep.errors import EXIT_USER, ConfigError

from helpers import REPO


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glm_ep", "bench", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_a_one_rank_topology_gives_its_levers_and_names_what_differs():
    levers, note = bench_levers("h100-1")
    assert levers == Topology.load("h100-1").levers != PathLevers()
    assert note.startswith("topology 'h100-1': ") and note.endswith(", the rest built-in"), note
    for key in ("prefill_gemm_min_rows", "ring_union_max_rows"):
        assert f"{key} = {getattr(levers, key)!r}" in note, note
    assert "ring_warps_per_sm" not in note, note  # a lever the topology leaves at its default is not named


def test_without_a_topology_the_levers_are_the_built_in_ones():
    assert bench_levers(None) == (PathLevers(), "built-in")


def test_a_topology_file_with_booleans_and_lists(tmp_path):
    f = tmp_path / "card.toml"
    f.write_text('world = 1\nbackend = "cuda"\n[levers]\npdl = false\nring_union_slab = [4, 4]\n'
                 'ring_union_depth = [2, 2]\n')
    levers, note = bench_levers(str(f))
    assert not levers.pdl and levers.ring_union_slab == (4, 4)
    assert "pdl = false" in note and "ring_union_slab = (4, 4)" in note, note
    same = tmp_path / "same.toml"
    same.write_text("world = 1\n")
    assert bench_levers(str(same))[1] == "topology 'same': the built-in levers"


def test_a_topology_of_more_ranks_is_refused():
    with pytest.raises(ConfigError, match=r"topology 'gb10-2' is for 2 ranks .*expected a one-rank topology"):
        bench_levers("gb10-2")


def test_the_results_file_names_the_levers():
    meta = {**bench_meta("NVIDIA H100", 3000.0, "topology 'h100-1': ring_union_max_rows = 8, the rest built-in")}
    head = results_header("glm-ep bench", meta)
    assert "Levers: topology 'h100-1': ring_union_max_rows = 8, the rest built-in  " in head
    assert head.index(next(h for h in head if h.startswith("Levers:"))) < len(head) - 1  # before the bandwidth line
    assert not any(h.startswith("Levers:") for h in results_header("glm-ep bench", bench_meta("NVIDIA H100", 3000.0)))


def test_topology_flags_are_checked_before_any_device():
    r = _bench("--topology", "gb10-2")
    assert r.returncode == EXIT_USER and "is for 2 ranks" in r.stderr and "needs a CUDA GPU" not in r.stderr, r.stderr
    r = _bench("--topology", "no-such-card")
    assert r.returncode == EXIT_USER and "no-such-card" in r.stderr, r.stderr
    for flags in (["--sweep", "union"], ["--moe-tp", "2"]):
        r = _bench(*flags, "--topology", "h100-1")
        assert r.returncode == EXIT_USER and "--topology sets the levers of decode and verify" in r.stderr, \
            (flags, r.stderr)


def test_levers_the_cuda_backend_refuses_are_refused_before_any_device(tmp_path):
    f = tmp_path / "wide.toml"
    f.write_text("world = 1\n[levers]\nrow_batch_max = 99\n")
    with pytest.raises(ConfigError, match=r"glm-ep bench --topology .*wide.toml: levers.row_batch_max = 99, expected "
                                          r"1..8 on backend 'cuda'"):
        bench_levers(str(f))
    r = _bench("--topology", str(f))
    assert r.returncode == EXIT_USER and "row_batch_max = 99" in r.stderr and "CUDA GPU" not in r.stderr, r.stderr
    f.write_text("world = 1\n[levers]\nhost_dispatch = true\n")
    with pytest.raises(ConfigError, match="host_dispatch = true reads each call's ids to the host, which a CUDA graph"):
        bench_levers(str(f))

"""What a person reads: lines every rank would print alike come once (rank 0), an agreed error once
and whole, one load line with the slowest rank's time, and ``bench`` refusing cleanly without a GPU."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from glm_ep.checkpoint.reader import Checkpoint
from glm_ep.checkpoint.layers import layer_read_bytes, load_layer
from glm_ep.config.model import RankLayout, SiteConfig
from glm_ep.errors import EXIT_USER

from cli_jobs import fails, glm_ep, mpi_env
from helpers import REPO


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
        return False


def _glm_ep_single(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glm_ep", *args], capture_output=True, text=True, timeout=120,
                          env=mpi_env(), cwd=REPO)


@pytest.mark.skipif(_has_gpu(), reason="a GPU is visible: bench would run")
def test_bench_without_a_gpu_is_a_clear_user_error(tmp_path) -> None:
    r = _glm_ep_single("bench", "--out", str(tmp_path / "perf"), "--iters", "1")
    fails(r, "glm-ep bench needs", "CUDA GPU", agreed=False)
    assert r.stderr.count("glm-ep: error:") == 1, r.stderr
    assert not (tmp_path / "perf").exists()


def test_bench_takes_only_its_own_flags() -> None:
    for flag in (["--tp", "2"], ["--ep", "2"], ["--backend", "cuda"]):  # --topology: only for its levers
        r = _glm_ep_single("bench", *flag)
        assert r.returncode == EXIT_USER and "unrecognized arguments" in r.stderr, (flag, r.stderr[-1000:])


def test_run_prints_shared_lines_once_and_the_load_time(tiny_checkpoint) -> None:
    r = glm_ep(2, "run", "--model", str(tiny_checkpoint), "--prefill", "12", "--decode", "2", "--verify", "3",
               "--check", "none")
    assert r.returncode == 0, r.stderr[-3000:]
    paths = re.findall(r"^\[rank (\d)\] INFO glm_ep.mlp.dispatch: routed experts: (\d+) rows -> .* path$", r.stderr, re.M)
    assert sorted(int(rows) for _, rows in paths) == [1, 3, 12], r.stderr[-3000:]  # one line per row count
    assert {rank for rank, _ in paths} == {"0"}, r.stderr[-3000:]
    load = re.findall(r"^\[rank 0\] INFO glm_ep.mlp.runtime: load: [\d.]+ [MG]B read by 2 rank\(s\) in [\d.]+ s "
                      r"\(slowest rank\), [\d.]+ [MG]B/s$", r.stderr, re.M)
    assert len(load) == 1, r.stderr[-3000:]
    assert r.stderr.count("[rank 0] INFO glm_ep.backend: all-reduce: MPI over 2 rank(s)\n") == 1, r.stderr[-3000:]
    assert "[rank 1] INFO" not in r.stderr, r.stderr[-3000:]
    verbose = glm_ep(2, "run", "--model", str(tiny_checkpoint), "--prefill", "12", "--decode", "1", "--verify", "3",
                     "--check", "none", "-v")
    assert verbose.returncode == 0 and "[rank 1] INFO glm_ep.mlp.dispatch: routed experts" in verbose.stderr
    # the synthetic checkpoint carries input_scale tensors, as a W4A4 export does: said once, by rank 0
    assert verbose.stderr.count("carry static input scales (a W4A4 export): they are not used") == 1, verbose.stderr


@pytest.mark.parametrize("checkpoint", ["tiny_checkpoint", "tiny_checkpoint_dense_nvfp4"])
@pytest.mark.parametrize("layout", [(1, 0, 1, 1), (2, 1, 2, 2), (2, 0, 1, 2), (2, 1, 2, 1)])
def test_load_progress_counts_exactly_the_bytes_read(request, checkpoint, layout) -> None:
    """The bar's total (from the headers) is what ``load_layer`` reads, for every layout (dense FFNs
    stored bf16 or NVFP4)."""
    with Checkpoint(request.getfixturevalue(checkpoint)) as ck:
        cfg = SiteConfig.for_rank(ck.config, RankLayout(*layout))
        for i in range(ck.config.num_hidden_layers):
            read: list[int] = []
            ck.on_read = read.append
            load_layer(ck, cfg, i)
            assert sum(read) == layer_read_bytes(ck, cfg, i), (i, layout)


def test_python_warnings_carry_the_rank_prefix() -> None:
    """A warning (NumPy's overflow on a huge input) is a log line with the rank's prefix, as every line is."""
    code = ("import warnings; from glm_ep.dist.ranks import setup_logging; setup_logging(1)\n"
            "warnings.warn('overflow encountered in exp', RuntimeWarning)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("[rank 1] WARNING py.warnings: ") and "RuntimeWarning: overflow encountered in exp" \
        in r.stderr, r.stderr

"""What the commands say and do agrees with itself and with the README: run chunks wide calls as forward and the
library do, footprint reports the workspace the runtime builds and prints once under mpiexec, make-input writes
what forward reads, progress goes to a terminal as a bar and to a log as plain lines, and every exit code is in
--help and in the README."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys

import numpy as np
import pytest

from glm_ep import errors
from glm_ep.dist.progress import progress

from cli_jobs import fails, glm_ep, load_outputs, mpi_env, mpiexec, write_topology
from helpers import BF16, REPO


def test_run_wider_than_the_workspace_runs_in_chunks(tiny_checkpoint, tmp_path) -> None:
    """README: wider inputs run in workspace-sized chunks; ``run --prefill`` past ``workspace_rows`` was refused."""
    topo = write_topology(tmp_path / "narrow.toml", world=2, tp=2, ep=2, workspace_rows=8)
    r = glm_ep(2, "run", "--model", str(tiny_checkpoint), "--topology", str(topo), "--prefill", "20", "--decode", "1",
               "--verify", "11")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert re.search(r"^prefill\s+1\s+20\s", r.stdout, re.M) and re.search(r"^verify\s+1\s+11\s", r.stdout, re.M)
    assert "check: float64 full: layers [0, 1, 2, 3] of 4, 32 of 32 rows over 3 calls" in r.stdout, r.stdout
    assert "timed step vs site-by-site chain: relative L2 0.000e+00" in r.stdout, r.stdout
    assert r.stdout.strip().splitlines()[-1] == "PASS"


def test_footprint_reports_the_workspace_the_runtime_builds(tmp_path) -> None:
    def footprint(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "glm_ep", "footprint", "--preset", "glm-5.3-flash", *args],
                           capture_output=True, text=True, timeout=60, env=mpi_env(), cwd=REPO)
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert "97.16 MB per workspace at 512 rows" in footprint("--tp", "2", "--ep", "2")  # the runtime's default
    topo = write_topology(tmp_path / "t.toml", world=4, tp=2, ep=4, workspace_rows=256)
    out = footprint("--topology", str(topo))
    assert "world 4, tp 2, ep 4" in out and " at 256 rows " in out and "weights: rank 3 holds" in out, out
    assert "world 2, tp 2, ep 2" in footprint("--topology", "h200-2") and " at 1024 rows" in footprint(
        "--topology", str(topo), "--rows", "1024")


def test_footprint_under_mpiexec_prints_once() -> None:
    r = glm_ep(2, "footprint", "--preset", "tiny")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("model: 4 layers") == 1 and r.stdout.count("weights: rank 0 holds") == 1, r.stdout
    fails(glm_ep(2, "footprint", "--preset", "nope"), "unknown preset 'nope'")  # its error too


def test_make_input_writes_what_forward_reads(tiny_checkpoint, tmp_path) -> None:
    x_file, again = tmp_path / "in.safetensors", tmp_path / "again.safetensors"
    r = subprocess.run([sys.executable, "-m", "glm_ep", "make-input", "--model", str(tiny_checkpoint), "--rows", "5",
                        "--out", str(x_file), "--seed", "3"], capture_output=True, text=True, timeout=60,
                       env=mpi_env(), cwd=REPO)
    assert r.returncode == 0 and f"wrote {x_file}: hidden_states bf16 [5, 128] (seed 3)" in r.stdout, r.stderr
    subprocess.run([sys.executable, "-m", "glm_ep", "make-input", "--hidden", "128", "--rows", "5", "--out",
                    str(again), "--seed", "3"], check=True, capture_output=True, env=mpi_env(), cwd=REPO)
    x = load_outputs(x_file)["hidden_states"]
    assert x.dtype == BF16 and x.shape == (5, 128) and np.isfinite(x.astype(np.float32)).all()
    assert np.array_equal(x.view(np.uint16), load_outputs(again)["hidden_states"].view(np.uint16))
    out = tmp_path / "out.safetensors"
    run = glm_ep(2, "forward", "--model", str(tiny_checkpoint), "--input", str(x_file), "--output", str(out))
    assert run.returncode == 0 and sorted(load_outputs(out)) == [f"layers.{i}" for i in range(4)], run.stderr[-2000:]


@pytest.mark.parametrize("argv,needles", [
    (["make-input", "--hidden", "128", "--rows", "2", "--out", "{tmp}"], ["the output path exists and is a folder"]),
    (["make-input", "--model", "{tmp}/none", "--rows", "2", "--out", "{tmp}/x.safetensors"],
     ["config.json not found"]),
    (["make-input", "--rows", "2", "--out", "{tmp}/x.safetensors"],
     ["one of the arguments --model --hidden is required"]),
    (["make-input", "--hidden", "4096", "--rows", "99999999999", "--out", "{tmp}/x.safetensors"],
     ["--rows 99999999999: 99999999999 rows of hidden 4096, drawn in float64, do not fit in memory", "expected fewer "
      "rows"]),
], ids=["out-is-a-folder", "no-model", "no-width", "rows-past-memory"])
def test_make_input_refusals(tmp_path, argv: list[str], needles: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "glm_ep", *(a.format(tmp=tmp_path) for a in argv)],
                       capture_output=True, text=True, timeout=60, env=mpi_env(), cwd=REPO)
    fails(r, *needles)


def test_make_input_under_mpiexec_is_refused(tmp_path) -> None:
    r = mpiexec(2, "-m", "glm_ep", "make-input", "--hidden", "128", "--rows", "2", "--out",
                str(tmp_path / "x.safetensors"))
    assert r.returncode == errors.EXIT_USER and "expected it run without mpiexec" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "x.safetensors").exists()


def test_progress_in_a_log_is_plain_lines(caplog: pytest.LogCaptureFixture) -> None:
    """Not a terminal: the meter as log lines, no carriage returns, the same count never twice (the close)."""
    log = logging.getLogger("glm_ep.test")
    with caplog.at_level(logging.INFO, logger="glm_ep.test"):
        with progress(4, "forward", unit="chunks", log=log, stream=io.StringIO(), interval_s=0, delay_s=0) as bar:
            for _ in range(4):
                bar.update()
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all("\r" not in line and "|" not in line for line in lines), lines
    assert lines[-1].startswith("forward: 100% (4 of 4 chunks) [") and sum("(4 of 4" in line for line in lines) == 1


def test_progress_on_a_terminal_is_a_bar() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    with progress(4, "loading weights", unit="B", stream=term, delay_s=0) as bar:
        bar.update(4)
    assert term.getvalue().startswith("\rloading weights:") and "4/4" in term.getvalue()
    quiet = Terminal()
    with progress(4, "loading weights", stream=quiet, enabled=False) as bar:  # a rank that does not report
        bar.update(4)
    assert quiet.getvalue() == ""


def test_forward_shows_progress_over_its_chunks(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    """A forward of many chunks reports each (layer, chunk) it finishes to rank 0's progress."""
    from mpi4py import MPI

    from glm_ep.app import jobs
    from glm_ep.app.cli import build_parser
    from glm_ep.dist.ranks import Ranks

    from cli_jobs import save_hidden
    from helpers import random_x

    seen: list = []
    real = jobs.progress

    def recording(total, desc, **kw):
        bar = real(total, desc, **kw)
        seen.append((total, desc, kw.get("enabled"), bar))
        return bar

    monkeypatch.setattr(jobs, "progress", recording)
    topo = write_topology(tmp_path / "narrow.toml", workspace_rows=8)
    x = save_hidden(tmp_path / "x.safetensors", random_x(0, 20, 128))
    args = build_parser().parse_args(["forward", "--model", str(tiny_checkpoint), "--input", str(x), "--output",
                                      str(tmp_path / "out.safetensors"), "--topology", str(topo)])
    assert jobs.forward_job(args, Ranks(MPI.COMM_SELF)) == 0
    (total, desc, enabled, bar), = seen
    assert (total, desc, enabled, bar.n) == (4 * 3, "forward", True, 4 * 3)  # 4 layers x 3 chunks of <= 8 rows


def test_every_exit_code_is_in_help_and_the_readme() -> None:
    codes = {v for k, v in vars(errors).items() if k.startswith("EXIT_")}
    r = subprocess.run([sys.executable, "-m", "glm_ep", "--help"], capture_output=True, text=True, timeout=60,
                       env=mpi_env(), cwd=REPO)
    epilog = " ".join(r.stdout[r.stdout.index("Exit codes:"):].split())
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Exit codes"):]
    for code in sorted(codes):
        assert re.search(rf"(: |, ){code} ", epilog), f"exit {code} is not in --help: {epilog}"
        assert re.search(rf"^\| {code} \|", table, re.M), f"exit {code} is not in the README's table"
    assert "kill -9" in epilog and "kill -9" in table[:table.index("\n\n", table.index("| 4 |"))]
    assert "glm-ep make-input" in readme  # how to make a forward input


def test_the_synthetic_glm_shape_keeps_a_sparse_layer(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """``synth --preset glm-5.3-flash --layers 2`` wrote two dense layers (the preset's first three are dense): no
    MoE at all. The cut keeps one sparse layer, and the log says so."""
    from glm_ep.app.local_jobs import cut_layers
    from glm_ep.config.model import ModelConfig
    from glm_ep.config.presets import preset

    cfg = preset("glm-5.3-flash")
    with caplog.at_level(logging.INFO):
        cut_layers(cfg, 2)
    assert ModelConfig.from_dict(cfg).mlp_layer_types == ("dense", "sparse")
    assert "--layers 2: layer 1 is sparse" in caplog.text

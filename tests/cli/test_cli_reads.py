"""Which files the jobs read, as two ranks see them: HF transformers' rule where a folder holds both weight
layouts (and the log says which was read), an index entry outside the folder, files that are not files (a FIFO
is never opened: no rank waits on a writer), and a checkpoint rewritten between the load and the check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from glm_ep.checkpoint.reader import INDEX_FILE, SINGLE_FILE
from glm_ep.checkpoint.synth import write_synthetic
from glm_ep.config.presets import preset

from ckpt_writer import read_safetensors, write_safetensors
from cli_jobs import MPI_TIMEOUT_S, copy_checkpoint, fails, glm_ep, load_outputs, mpi_env, save_hidden, shard_of
from helpers import REPO, random_x

ROUTER = "model.layers.1.mlp.gate.weight"


@pytest.fixture
def ckpt(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    return copy_checkpoint(tiny_checkpoint, tmp_path / "tiny")


@pytest.fixture
def x_file(tmp_path: Path) -> Path:
    return save_hidden(tmp_path / "x.safetensors", random_x(0, 3, 128))


def _forward(model: Path, x_file: Path, out: Path, *extra: str):
    return glm_ep(2, "forward", "--model", str(model), "--input", str(x_file), "--output", str(out), *extra)


def test_both_layouts_read_the_single_file_and_say_so(ckpt: Path, x_file: Path, tmp_path: Path) -> None:
    other = write_synthetic(tmp_path / "other", preset("tiny"), seed=1)
    merged: dict = {}
    for shard in sorted(other.glob("model-*.safetensors")):
        merged.update(read_safetensors(shard))
    write_safetensors(ckpt / SINGLE_FILE, merged)  # seed 1's values beside seed 0's index and shards
    both = _forward(ckpt, x_file, tmp_path / "both.safetensors")
    assert both.returncode == 0, both.stderr[-3000:]
    assert both.stderr.count(f"reading {SINGLE_FILE}, as HF transformers does") == 1, both.stderr[-3000:]
    single = _forward(other, x_file, tmp_path / "single.safetensors")
    assert single.returncode == 0, single.stderr[-3000:]
    got, want = load_outputs(tmp_path / "both.safetensors"), load_outputs(tmp_path / "single.safetensors")
    assert all(np.array_equal(got[k].view(np.uint16), want[k].view(np.uint16)) for k in want)


def test_index_entry_outside_the_folder_is_refused(ckpt: Path, x_file: Path, tmp_path: Path) -> None:
    shard = shard_of(ckpt, ROUTER)
    shard.rename(tmp_path / shard.name)
    index = json.loads((ckpt / INDEX_FILE).read_text())
    index["weight_map"] = {k: f"../{v}" if v == shard.name else v for k, v in index["weight_map"].items()}
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    fails(_forward(ckpt, x_file, tmp_path / "out.safetensors"), f"names the shard '../{shard.name}', outside the "
          "model folder")


def test_config_json_that_is_a_fifo_is_named_not_opened(ckpt: Path, x_file: Path, tmp_path: Path) -> None:
    (ckpt / "config.json").unlink()
    os.mkfifo(ckpt / "config.json")
    fails(_forward(ckpt, x_file, tmp_path / "out.safetensors"), "config.json: config.json is a FIFO")


def test_topology_that_is_a_folder_is_named(ckpt: Path, x_file: Path, tmp_path: Path) -> None:
    fails(_forward(ckpt, x_file, tmp_path / "out.safetensors", "--topology", str(tmp_path)),
          f"{tmp_path}: the topology is a folder, not a file")


def test_checkpoint_rewritten_after_the_load_is_named_not_failed(ckpt: Path, tmp_path: Path) -> None:
    """Other values of the same shapes renamed over the shards once the load is done: the check reports the
    change (exit 2), not a numeric FAIL (exit 3) from weights the run never held."""
    other = write_synthetic(tmp_path / "other", preset("tiny"), seed=1, shard_bytes=256 * 1024)
    assert sorted(p.name for p in other.iterdir()) == sorted(p.name for p in ckpt.iterdir())
    local = Path(sys.executable).parent / "mpiexec"
    cmd = [str(local) if local.exists() else "mpiexec", "-n", "2", sys.executable, "-m", "glm_ep", "run", "--model",
           str(ckpt), "--prefill", "9", "--decode", "300", "--verify", "3"]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO)
    stderr, rewritten = [], False
    try:
        for line in job.stderr:  # the decode steps after the load leave time for the rewrite
            stderr.append(line)
            if not rewritten and "weights: rank 0 holds" in line:
                for p in other.glob("model-*.safetensors"):
                    p.replace(ckpt / p.name)
                rewritten = True
        stdout = job.stdout.read()
        job.wait(timeout=MPI_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
    assert rewritten, "".join(stderr)[-3000:]
    r = subprocess.CompletedProcess(cmd, job.returncode, stdout, "".join(stderr))
    fails(r, f"{ckpt}: the checkpoint changed since load", "expected the files the run loaded")
    assert "PASS" not in stdout and "FAIL" not in stdout

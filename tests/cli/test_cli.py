"""End to end: ``glm-ep forward`` and ``glm-ep run`` under ``mpiexec`` (every launch has a timeout).

``forward`` runs on two checkpoints: one from ``glm_ep.checkpoint.synth.write_synthetic`` and one from the
independent writer in ``ckpt_writer`` (composite config, ``model.language_model`` prefix, fp32
router, its own NVFP4 packer). Each site output is held against a float64 evaluation built from
the checkpoint files by the tests' own decoder, not by ``glm_ep.check.reference``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from ckpt_writer import read_f64, write_checkpoint
from cli_jobs import glm_ep, load_outputs, mpi_env, save_hidden
from helpers import BF16, REPO, random_x, rel_l2, site64

LAYOUTS = [(1, 1, 1), (2, 2, 2), (2, 1, 2), (2, 2, 1)]
ROWS = [1, 5, 300]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    """name -> (folder, float64 layers, routing params): each decoded from the files by the tests."""
    writer_dir = tmp_path_factory.mktemp("writer") / "glm"
    written = write_checkpoint(writer_dir, seed=3)
    decoded = read_f64(writer_dir)
    assert decoded[1] == written[1]
    for a, b in zip(decoded[0], written[0]):  # the test decoder reads back what the writer meant
        assert all(np.array_equal(x, y) for x, y in zip(a.mlp, b.mlp))
    return {"synth": (tiny_checkpoint, *read_f64(tiny_checkpoint)), "writer": (writer_dir, *decoded)}


_REFERENCE: dict[tuple[str, int], list[np.ndarray]] = {}


def _reference(checkpoints, name: str, rows: int, x: np.ndarray) -> list[np.ndarray]:
    if (name, rows) not in _REFERENCE:
        _, layers, p = checkpoints[name]
        _REFERENCE[(name, rows)] = [site64(layer, p, x) for layer in layers]
    return _REFERENCE[(name, rows)]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("world,tp,ep", LAYOUTS, ids=[f"w{w}-tp{t}-ep{e}" for w, t, e in LAYOUTS])
@pytest.mark.parametrize("name", ["synth", "writer"])
def test_forward_matches_float64_per_site(checkpoints, tmp_path, name: str, world: int, tp: int, ep: int,
                                          rows: int) -> None:
    model_dir, layers, _ = checkpoints[name]
    hidden = layers[0].mlp[0].shape[1]
    x = random_x(rows * 31 + hidden, rows, hidden, gain=1.5)
    inp, out = save_hidden(tmp_path / "in.safetensors", x), tmp_path / "out.safetensors"
    r = glm_ep(world, "forward", "--model", str(model_dir), "--input", str(inp), "--output", str(out),
               "--tp", str(tp), "--ep", str(ep))
    assert r.returncode == 0, r.stderr[-3000:]
    got = load_outputs(out)
    assert sorted(got) == [f"layers.{i}" for i in range(len(layers))]
    for i, want in enumerate(_reference(checkpoints, name, rows, x)):
        y = got[f"layers.{i}"]
        assert y.dtype == BF16 and y.shape == (rows, hidden)
        assert rel_l2(y, want) < 1e-2, (i, rel_l2(y, want))


def test_forward_chunks_inputs_wider_than_the_workspace(checkpoints, tmp_path) -> None:
    model_dir, layers, p = checkpoints["writer"]
    topo = tmp_path / "small.toml"
    topo.write_text('name = "small"\nworld = 2\ntp = 2\nep = 2\nworkspace_rows = 16\n'
                    '[levers]\nprefill_gemm_min_rows = 9\n')
    x = random_x(8, 40, 64)
    inp, out = save_hidden(tmp_path / "in.safetensors", x), tmp_path / "out.safetensors"
    r = glm_ep(2, "forward", "--model", str(model_dir), "--input", str(inp), "--output", str(out),
               "--topology", str(topo))
    assert r.returncode == 0, r.stderr[-3000:]
    got = load_outputs(out)
    for i, layer in enumerate(layers):
        assert rel_l2(got[f"layers.{i}"], site64(layer, p, x)) < 1e-2


def _check_run_report(r: subprocess.CompletedProcess, world: int) -> None:
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    log = r.stderr
    assert re.search(r"workspace: [\d.]+ [MG]B per workspace at \d+ rows", log), log[-2000:]
    assert re.search(r"private copies would be [\d.]+ [MG]B", log), log[-2000:]
    for phase in ("prefill", "decode", "verify"):
        assert re.search(rf"^{phase}\s+\d+\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", r.stdout, re.M), r.stdout
    assert "median ms" in r.stdout and f"world {world}" in r.stdout
    assert r.stdout.strip().splitlines()[-1] == "PASS", r.stdout[-2000:]
    assert "FAIL" not in r.stdout


def test_run_default_checkpoint_two_ranks(tmp_path) -> None:
    r = glm_ep(2, "run", "--cache-dir", str(tmp_path / "cache"), timeout=240)
    _check_run_report(r, 2)
    assert (tmp_path / "cache" / "tiny" / "config.json").is_file()
    assert "W4A4" not in r.stderr  # the built-in checkpoint is a weight-only export: nothing to say about it


@pytest.mark.parametrize("world,extra", [(1, []), (2, ["--tp", "1", "--ep", "2"])], ids=["w1", "w2-tp1-ep2"])
def test_run_on_the_independent_checkpoint(checkpoints, world: int, extra: list[str]) -> None:
    model_dir = checkpoints["writer"][0]
    r = glm_ep(world, "run", "--model", str(model_dir), "--prefill", "200", "--decode", "3", "--verify", "6",
               *extra)
    _check_run_report(r, world)


def test_synth_cli_writes_a_loadable_checkpoint(tmp_path) -> None:
    out = tmp_path / "c"
    r = subprocess.run([sys.executable, "-m", "glm_ep", "synth", "--preset", "tiny", "--out", str(out),
                        "--composite", "--router-dtype", "f32", "--layers", "2", "--shard-mb", "1"],
                       capture_output=True, text=True, timeout=120, env=mpi_env(), cwd=REPO)
    assert r.returncode == 0, r.stderr
    umask = os.umask(0)
    os.umask(umask)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in out.glob("*.safetensors")}
    assert modes and set(modes.values()) == {oct(0o666 & ~umask)}, modes  # readable as any new file, not 0600
    layers, p = read_f64(out)
    assert [layer.kind for layer in layers] == ["dense", "sparse"]
    assert layers[1].router.shape == (32, 128) and np.all(np.abs(layers[1].bias - 7) < 0.5)
    x = random_x(3, 5, 128)
    inp, res = save_hidden(tmp_path / "in.safetensors", x), tmp_path / "out.safetensors"
    r = glm_ep(2, "forward", "--model", str(out), "--input", str(inp), "--output", str(res))
    assert r.returncode == 0, r.stderr[-3000:]
    got = load_outputs(res)
    for i, layer in enumerate(layers):
        assert rel_l2(got[f"layers.{i}"], site64(layer, p, x)) < 1e-2
    assert ml_dtypes.bfloat16 == got["layers.0"].dtype

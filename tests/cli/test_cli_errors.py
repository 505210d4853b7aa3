"""Every failure ends the whole MPI job, with the user-error exit code (2) within the timeout, and a
message on stderr that names the offending file, tensor or value."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from glm_ep.errors import EXIT_INTERNAL

from ckpt_writer import read_safetensors, write_safetensors
from cli_jobs import copy_checkpoint, fails, glm_ep, mpiexec, save_hidden, shard_of
from helpers import REPO, random_x

INDEX = "model.safetensors.index.json"


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path) -> Path:
    """A private copy of the tiny checkpoint (several shards), free to break."""
    return copy_checkpoint(tiny_checkpoint, tmp_path / "tiny")


@pytest.fixture
def x_file(tmp_path) -> Path:
    return save_hidden(tmp_path / "x.safetensors", random_x(0, 3, 128))


def _rewrite(ckpt: Path, key: str, dtype: str | None = None, shape: tuple[int, ...] | None = None,
             drop: bool = False) -> Path:
    """Rewrite ``key``'s shard with the tensor dropped or given another dtype/shape (consistent bytes)."""
    shard = shard_of(ckpt, key)
    tensors = read_safetensors(shard)
    old_dtype, old_shape, data = tensors.pop(key)
    if not drop:
        new_shape = shape or old_shape
        itemsize = {"BF16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}[dtype or old_dtype]
        tensors[key] = (dtype or old_dtype, new_shape, bytes(int(np.prod(new_shape)) * itemsize))
    write_safetensors(shard, tensors)
    return shard


def _forward(ckpt: Path, x_file: Path, tmp_path: Path, *extra: str, n: int = 2):
    return glm_ep(n, "forward", "--model", str(ckpt), "--input", str(x_file), "--output",
                  str(tmp_path / "out.safetensors"), *extra)


def test_missing_model_folder(tmp_path, x_file) -> None:
    fails(_forward(tmp_path / "nowhere", x_file, tmp_path), "nowhere", "model folder not found")


def test_missing_shard(ckpt, x_file, tmp_path) -> None:
    shard = shard_of(ckpt, "model.layers.2.mlp.experts.3.up_proj.weight")
    shard.unlink()
    fails(_forward(ckpt, x_file, tmp_path), shard.name, "not found")


def test_truncated_shard(ckpt, x_file, tmp_path) -> None:
    shard = shard_of(ckpt, "model.layers.3.mlp.experts.30.down_proj.weight")
    shard.write_bytes(shard.read_bytes()[:-100])
    fails(_forward(ckpt, x_file, tmp_path), shard.name, "truncated")


@pytest.mark.parametrize("garbage", [b"\xff" * 8, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"])
def test_corrupt_shard_header(ckpt, x_file, tmp_path, garbage: bytes) -> None:
    shard = shard_of(ckpt, "model.layers.1.mlp.gate.weight")
    shard.write_bytes(garbage + shard.read_bytes()[len(garbage):])
    fails(_forward(ckpt, x_file, tmp_path), shard.name, "corrupt header")


def test_missing_tensor(ckpt, x_file, tmp_path) -> None:
    key = "model.layers.2.mlp.shared_experts.up_proj.weight"
    _rewrite(ckpt, key, drop=True)
    fails(_forward(ckpt, x_file, tmp_path), key, "not found")


def test_missing_tensor_and_index_entry(ckpt, x_file, tmp_path) -> None:
    key = "model.layers.0.mlp.down_proj.weight"
    _rewrite(ckpt, key, drop=True)
    index = json.loads((ckpt / INDEX).read_text())
    del index["weight_map"][key]
    (ckpt / INDEX).write_text(json.dumps(index))
    fails(_forward(ckpt, x_file, tmp_path), key, "not found")


def test_wrong_shape(ckpt, x_file, tmp_path) -> None:
    key = "model.layers.1.mlp.gate.weight"
    shard = _rewrite(ckpt, key, shape=(32, 64))
    fails(_forward(ckpt, x_file, tmp_path), shard.name, key, "[32, 64]", "[32, 128]")


def test_wrong_dtype(ckpt, x_file, tmp_path) -> None:
    key = "model.layers.0.mlp.gate_proj.weight"
    shard = _rewrite(ckpt, key, dtype="F32")
    fails(_forward(ckpt, x_file, tmp_path), shard.name, key, "F32", "BF16")


def test_bias_stored_bf16_is_refused(ckpt, x_file, tmp_path) -> None:
    key = "model.layers.3.mlp.gate.e_score_correction_bias"
    _rewrite(ckpt, key, dtype="BF16")
    fails(_forward(ckpt, x_file, tmp_path), key, "BF16", "F32")


@pytest.mark.parametrize("edit,needles", [
    (lambda c: c.pop("swiglu_limit"), ["config.json", "swiglu_limit"]),
    (lambda c: c.update(n_group=2), ["config.json", "n_group = 2"]),
    (lambda c: c.update(intermediate_size=255), ["intermediate_size 255 does not divide over tp = 2"]),
    (lambda c: c.update(num_experts_per_tok=17), ["num_experts_per_tok = 17, expected <= 16 on backend 'cpu'"]),
], ids=["no-swiglu-limit", "n-group-2", "odd-intermediate", "top-k-past-the-router"])
def test_bad_config(ckpt, x_file, tmp_path, edit, needles: list[str]) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    fails(_forward(ckpt, x_file, tmp_path, "--tp", "2"), *needles)


def test_ep_not_dividing_world(ckpt, x_file, tmp_path) -> None:
    """Without --topology the message names the default layout, not an internal name ('cli')."""
    fails(_forward(ckpt, x_file, tmp_path, "--ep", "3"),
          "topology 'default, no --topology': ep = 3 does not divide world = 2")


def test_lever_past_the_backend_limit(ckpt, x_file, tmp_path) -> None:
    topo = tmp_path / "wide.toml"
    topo.write_text("world = 2\ntp = 2\nep = 2\n[levers]\nunion_max_ids = 128\n")
    fails(_forward(ckpt, x_file, tmp_path, "--topology", str(topo)),
          "levers.union_max_ids = 128, expected 1..64 on backend 'cpu'")


def test_fp16_form_the_swiglu_limit_does_not_bound(ckpt, x_file, tmp_path) -> None:
    """Refused on every rank before any device is touched (so also where no GPU is)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["swiglu_limit"] = 300.0
    (ckpt / "config.json").write_text(json.dumps(cfg))
    topo = tmp_path / "f16.toml"
    topo.write_text("world = 2\ntp = 2\nep = 2\n[levers]\nring_f16 = true\n")
    fails(_forward(ckpt, x_file, tmp_path, "--backend", "cuda", "--topology", str(topo)), "levers.ring_f16 = true",
          "swiglu_limit = 300", "set ring_f16 = false")


def test_topology_world_differs_from_mpi_size(ckpt, x_file, tmp_path) -> None:
    r = _forward(ckpt, x_file, tmp_path, "--topology", str(REPO / "configs" / "single.toml"))
    fails(r, "'single' is for 1 rank (world = 1), but the MPI job has 2")


def test_input_of_the_wrong_hidden_size(ckpt, tmp_path) -> None:
    bad = save_hidden(tmp_path / "narrow.safetensors", random_x(1, 3, 64))
    fails(_forward(ckpt, bad, tmp_path), "narrow.safetensors", "[3, 64]", "[rows >= 1, 128]")
    empty = save_hidden(tmp_path / "empty.safetensors", np.zeros((0, 128), ml_dtypes.bfloat16))
    fails(_forward(ckpt, empty, tmp_path), "empty.safetensors: hidden_states is bfloat16 [0, 128], expected "
          "bfloat16 [rows >= 1, 128]")


def test_error_on_one_rank_at_load_ends_the_job_on_every_rank(ckpt, x_file, tmp_path) -> None:
    """Expert 20 is read only by EP rank 1 (experts 16..31): only rank 1 fails, both ranks report."""
    key = "model.layers.2.mlp.experts.20.gate_proj.weight"
    _rewrite(ckpt, key, shape=(64, 32))
    r = _forward(ckpt, x_file, tmp_path)
    fails(r, key, "[64, 32]", "(on rank 1)")
    assert r.stderr.count(key) == 1, r.stderr[-3000:]  # agreed: rank 0 prints it once
    assert not (tmp_path / "out.safetensors").exists()
    ok = _forward(ckpt, x_file, tmp_path, "--ep", "1", "--tp", "2", n=2)  # ep = 1: rank 0 reads it too
    fails(ok, key, "(on rank 0)")


def test_unexpected_exception_on_one_rank_aborts_the_job(tmp_path) -> None:
    """Rank 1 raises while rank 0 waits in a barrier: run_guarded must abort, not hang."""
    script = textwrap.dedent("""
        import sys
        from mpi4py import MPI
        from glm_ep.dist.ranks import run_guarded

        comm = MPI.COMM_WORLD

        def main():
            if comm.Get_rank() == 1:
                raise RuntimeError("boom on rank one")
            comm.Barrier()  # never completes: rank 1 is gone
            print("rank 0 passed the barrier", flush=True)
            return 0

        sys.exit(run_guarded(main, comm))
    """)
    r = mpiexec(2, "-c", script, timeout=60)
    assert r.returncode == EXIT_INTERNAL, r.stderr[-3000:]
    assert "boom on rank one" in r.stderr and "aborting all 2 ranks" in r.stderr, r.stderr[-3000:]
    assert "passed the barrier" not in r.stdout


def test_a_crash_on_one_rank_inside_an_agreement_stops_every_rank_at_once(tmp_path) -> None:
    """A crash (not a user error) on one rank inside ``Ranks.agree``, as the library API meets it (no
    run_guarded): that rank raises its own exception, the other an AgreedError naming it, both at once, not
    at the collective deadline: that is an hour here, so a job that waited for it would outlive the launch's
    timeout."""
    script = textwrap.dedent("""
        import sys
        from pathlib import Path
        from mpi4py import MPI
        from glm_ep.dist.ranks import AgreedError, Ranks

        rank = MPI.COMM_WORLD.Get_rank()

        def step():
            if rank == 1:
                raise ZeroDivisionError("boom")
            return 7

        try:
            Ranks(MPI.COMM_WORLD, timeout_s=3600).agree("step", step)
            said = "went on"
        except AgreedError as e:
            said = f"agreed {e.internal} [{e}]"
        except ZeroDivisionError as e:
            said = f"own {e!r}"
        Path(sys.argv[1], f"rank{rank}").write_text(said)
    """)
    r = mpiexec(2, "-c", script, str(tmp_path), timeout=60)  # the hang guard: far below the deadline
    assert r.returncode == 0, r.stdout + r.stderr
    said = {rank: (tmp_path / f"rank{rank}").read_text() for rank in (0, 1)}
    assert said[0] == "agreed True [internal error: ZeroDivisionError: boom (on rank 1)]", said
    assert said[1] == "own ZeroDivisionError('boom')", said


def test_an_agreed_crash_exits_as_an_internal_error(capsys) -> None:
    """An AgreedError that began as a crash on some rank exits 1 (internal), a user error 2, each printed once."""
    from glm_ep.errors import EXIT_USER
    from glm_ep.dist.ranks import AgreedError, run_guarded

    def raise_(e: Exception):
        raise e

    crash = AgreedError("internal error: ZeroDivisionError: boom (on rank 1)", internal=True)
    assert run_guarded(lambda: raise_(crash), None) == EXIT_INTERNAL
    assert run_guarded(lambda: raise_(AgreedError("value 3 is bad, expected 7")), None) == EXIT_USER
    err = capsys.readouterr().err
    assert "glm-ep: error: internal error: ZeroDivisionError: boom (on rank 1)" in err
    assert "glm-ep: error: value 3 is bad, expected 7" in err


def test_an_interrupt_exits_130_with_one_line(capsys) -> None:
    """Ctrl-C (KeyboardInterrupt) ends the command with 130 (128 + SIGINT), as a shell reports it, saying so in one
    line and no traceback; SIGTERM (raised as deadline.Terminated where the command watches signals) with 143."""
    from glm_ep.dist.deadline import Terminated
    from glm_ep.dist.ranks import run_guarded

    def interrupted() -> int:
        raise KeyboardInterrupt

    def terminated() -> int:
        raise Terminated

    assert run_guarded(interrupted, None) == 130
    assert capsys.readouterr().err == "glm-ep: interrupted\n"
    assert run_guarded(terminated, None) == 143
    assert capsys.readouterr().err == "glm-ep: terminated (SIGTERM)\n"


def test_an_agreed_error_is_printed_once_whole_one_rank_per_line(tmp_path) -> None:
    """Ranks that fail with different messages: rank 0 prints all of them, one rank per line."""
    script = textwrap.dedent("""
        import sys
        from mpi4py import MPI
        from glm_ep.errors import ConfigError
        from glm_ep.dist.ranks import Ranks, run_guarded

        def fail():
            raise ConfigError(f"value {MPI.COMM_WORLD.Get_rank()} is bad, expected 7")

        sys.exit(run_guarded(lambda: Ranks(MPI.COMM_WORLD).agree("step", fail), MPI.COMM_WORLD))
    """)
    r = mpiexec(2, "-c", script, timeout=60)
    fails(r, "glm-ep: error: the ranks failed differently:\n  rank 0: value 0 is bad, expected 7\n"
             "  rank 1: value 1 is bad, expected 7\n")


def test_synth_into_a_file_or_an_unmakeable_folder_is_a_clear_error(tmp_path, capsys) -> None:
    from glm_ep.app.cli import main

    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert main(["synth", "--out", str(a_file)]) == 2
    assert f"{a_file}: cannot make the synthetic checkpoint's folder there (File exists)" in capsys.readouterr().err
    assert main(["synth", "--out", str(a_file / "sub")]) == 2
    assert "cannot make the synthetic checkpoint's folder there" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["synth", "--out", "{tmp}/ck"], ["make-input", "--rows", "2", "--hidden", "64", "--out", "{tmp}/x"],
                                  ["balance", "--load", "{tmp}/l", "--ep", "2", "--out", "{tmp}/p.json"]],
                         ids=["synth", "make-input", "balance"])
def test_a_one_process_command_under_mpiexec_is_refused_once(tmp_path, argv) -> None:
    """Every rank refuses the same way; rank 0 alone prints it (each rank printed the same line), all exit 2."""
    r = mpiexec(2, "-m", "glm_ep", *(a.format(tmp=tmp_path) for a in argv))
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.count("from one process; expected it run without mpiexec") == 1, r.stderr[-2000:]
    assert not list(tmp_path.iterdir())


def test_synth_refuses_the_shards_a_cut_short_write_left(tmp_path, capsys) -> None:
    """Shards without config.json or index (a write killed before its end) are a checkpoint's files too: a new synth
    there is refused naming them, instead of writing beside them (the folder then held both); --force replaces
    them."""
    from glm_ep.app.cli import main

    out = tmp_path / "ck"
    out.mkdir()
    for i in range(1, 5):
        (out / f"model-{i:05d}-of-00018.safetensors").write_bytes(b"x")
    assert main(["synth", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (f"{out}: already holds a checkpoint (model-00001-of-00018.safetensors, model-00002-of-00018.safetensors "
            "and 2 more shard(s)); expected an empty or new folder (--force writes over its files)") in err, err
    assert main(["synth", "--out", str(out), "--force"]) == 0
    assert not list(out.glob("*-of-00018.safetensors")) and (out / "config.json").exists()


_SYNTH_CUT_SHORT = """
import os, signal, sys
from glm_ep.checkpoint import synth
from glm_ep.app.cli import main

def cut_short(out_dir, *args, **kwargs):  # one shard written, then a scheduler's cancel
    os.makedirs(out_dir, exist_ok=True)
    open(os.path.join(out_dir, "model-00001-of-00018.safetensors"), "wb").write(b"x" * 1000)
    os.kill(os.getpid(), signal.SIGTERM)

synth.write_synthetic = cut_short
sys.exit(main(["synth", "--out", sys.argv[1]] + sys.argv[2:]))
"""


def test_synth_cut_short_by_sigterm_says_so_and_leaves_nothing(tmp_path) -> None:
    """SIGTERM mid-write: "terminated (SIGTERM)", exit 143, and the files the write added gone (it left a partial
    folder of shards and printed nothing); over an old checkpoint (--force) the user's other files stay, and the
    old config.json and index go with a word on stderr (they would present old and new shards as one checkpoint)."""
    import subprocess
    import sys

    from glm_ep.errors import EXIT_TERMINATED

    script = tmp_path / "cut.py"
    script.write_text(_SYNTH_CUT_SHORT)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "new")], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == EXIT_TERMINATED and "glm-ep: terminated (SIGTERM)" in r.stderr, (r.returncode, r.stderr)
    assert not (tmp_path / "new").exists()
    old = tmp_path / "old"
    old.mkdir()
    (old / "NOTES.txt").write_text("mine")
    (old / "config.json").write_text("{}")
    r = subprocess.run([sys.executable, str(script), str(old), "--force"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == EXIT_TERMINATED, (r.returncode, r.stderr)
    assert sorted(p.name for p in old.iterdir()) == ["NOTES.txt"]
    assert "the write over its checkpoint was cut short" in r.stderr and "config.json were removed" in r.stderr, \
        r.stderr


def test_synth_refuses_to_overwrite_a_checkpoint_or_to_run_on_several_ranks(tmp_path, capsys, monkeypatch) -> None:
    """``synth --out`` into a folder that holds a checkpoint (a typo for a real one) is refused unless --force, and
    so is synth under mpiexec with more than one rank (every rank would write the same files at once)."""
    from glm_ep.app.cli import main

    out = tmp_path / "ck"
    assert main(["synth", "--out", str(out), "--shard-mb", "1"]) == 0
    config = (out / "config.json").read_bytes()
    capsys.readouterr()
    assert main(["synth", "--out", str(out), "--seed", "3"]) == 2
    err = capsys.readouterr().err
    assert f"{out}: already holds a checkpoint (config.json, model.safetensors.index.json)" in err, err
    assert "--force writes over its files" in err
    assert (out / "config.json").read_bytes() == config
    assert main(["synth", "--out", str(out), "--seed", "3", "--shard-mb", "1", "--force"]) == 0
    (out / "NOTES.txt").write_text("mine")
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert main(["synth", "--out", str(out), "--seed", "3", "--force"]) == 0  # one shard now: the old ones gone
    assert sorted(p.name for p in out.iterdir()) == ["NOTES.txt", "config.json", "model-00001-of-00001.safetensors",
                                                     "model.safetensors.index.json"], sorted(out.iterdir())
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()  # a --force refused on its new config leaves the old checkpoint whole
    assert main(["synth", "--out", str(out), "--force", "--moe-intermediate-size", "17"]) == 2
    assert "17" in capsys.readouterr().err and {p.name: p.read_bytes() for p in out.iterdir()} == kept
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    capsys.readouterr()
    assert main(["synth", "--out", str(tmp_path / "new")]) == 2
    assert "synth writes one checkpoint from one process; expected it run without mpiexec" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    monkeypatch.setenv("PMIX_RANK", "3")  # srun --mpi=pmix: a rank, no rank count
    assert main(["synth", "--out", str(tmp_path / "new")]) == 2
    assert "synth writes one checkpoint from one process" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_run_with_a_cache_dir_that_is_a_file_is_a_clear_error(tmp_path) -> None:
    a_file = tmp_path / "cache"
    a_file.write_text("x")
    r = glm_ep(2, "run", "--cache-dir", str(a_file))
    fails(r, f"{a_file}: cannot make the checkpoint cache (--cache-dir) there")


def test_a_closed_stdout_ends_the_command_quietly() -> None:
    """``glm-ep footprint ... | head``: the reader gone, the command exits 141 (128 + SIGPIPE) with nothing on
    stderr, not an internal-error traceback."""
    import os
    import subprocess
    import sys

    from glm_ep.errors import EXIT_BROKEN_PIPE
    from cli_jobs import mpi_env

    read, write = os.pipe()
    os.close(read)  # every write to the pipe now fails with EPIPE
    try:
        r = subprocess.run([sys.executable, "-m", "glm_ep", "footprint", "--preset", "glm-5.3-flash"], stdout=write,
                           stderr=subprocess.PIPE, text=True, timeout=60, env=mpi_env(), cwd=REPO)
    finally:
        os.close(write)
    assert r.returncode == EXIT_BROKEN_PIPE == 141 and r.stderr == "", r.stderr


@pytest.mark.parametrize("argv", [["synth", "--preset", "nope", "--out", "OUT"], ["footprint", "--preset", "nope"]])
def test_an_unknown_preset_is_named(argv: list[str], capsys, tmp_path) -> None:
    from glm_ep.app.cli import main

    argv = [str(tmp_path / "ck") if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    assert "unknown preset 'nope'; expected one of ['glm-5.3-flash', 'tiny']" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()


def test_the_cuda_backend_without_cuda_is_one_clear_error(tiny_checkpoint) -> None:
    """``--backend cuda`` (or a CUDA topology) on a machine where CuPy is missing or sees no GPU: exit 2 on every
    rank with one message naming the host and the way out, before any weight is read."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("CUDA is usable here")
    except Exception:
        pass
    r = glm_ep(2, "run", "--model", str(tiny_checkpoint), "--backend", "cuda", "--decode", "1", "--prefill", "2")
    fails(r, "asks for backend = 'cuda', but CUDA is unusable on", "or use backend = 'cpu'")
    assert "loading weights" not in r.stderr

"""``forward``'s files are checked before any weight is read: an output whose folder is missing, or
that names a folder, symbolic link, FIFO or device node, is refused on every rank and never
replaced; an existing regular file is replaced; rank 0 writes the result under agreement. A file the
system refuses (permission, a name too long, a full disk, stdout on /dev/full) is a user error, not a crash."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from glm_ep.errors import InputError
from glm_ep.app.files import check_output_path, read_hidden_states

from ckpt_writer import read_safetensors, write_safetensors
from cli_jobs import copy_checkpoint, fails, glm_ep, load_outputs, loaded_weights, save_hidden, shard_of
from helpers import REPO, random_x


@pytest.fixture
def x_file(tmp_path) -> Path:
    return save_hidden(tmp_path / "x.safetensors", random_x(0, 3, 128))


def _forward(model: Path, x_file: Path, out: Path | str):
    return glm_ep(2, "forward", "--model", str(model), "--input", str(x_file), "--output", str(out))


def test_output_in_a_missing_folder_is_refused_before_the_load(tiny_checkpoint, x_file, tmp_path) -> None:
    out = tmp_path / "nowhere" / "out.safetensors"
    r = _forward(tiny_checkpoint, x_file, out)
    fails(r, str(out), "output folder", "does not exist", "(on rank 0)")
    assert not loaded_weights(r)
    assert not out.parent.exists()


def _fifo(p: Path) -> Path:
    os.mkfifo(p)
    return p


def _device_node(p: Path) -> Path:
    """A private twin of /dev/null (char 1:3): a regression must never write over the real one."""
    try:
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("cannot create a device node here")
    return p


def _symlink_to_a_file(p: Path) -> Path:
    target = p.with_name("target.bin")
    target.write_bytes(b"keep me")
    p.symlink_to(target)
    return p


@pytest.mark.parametrize("make,kind", [
    (lambda p: p.mkdir() or p, "a folder"),
    (_fifo, "a FIFO"),
    (_symlink_to_a_file, "a symbolic link"),
    (_device_node, "a character device node"),
], ids=["folder", "fifo", "symlink", "device-node"])
def test_output_that_is_not_a_regular_file_is_refused_and_kept(tiny_checkpoint, x_file, tmp_path, make,
                                                               kind: str) -> None:
    out = make(tmp_path / "out.safetensors")
    before = os.lstat(out)
    r = _forward(tiny_checkpoint, x_file, out)
    fails(r, f"{out}: the output path exists and is {kind}", "expected a new path or a regular file")
    assert not loaded_weights(r)
    after = os.lstat(out)
    assert (stat.S_IFMT(after.st_mode), after.st_ino, after.st_rdev) == (
        stat.S_IFMT(before.st_mode), before.st_ino, before.st_rdev)
    if kind == "a symbolic link":
        assert out.resolve().read_bytes() == b"keep me"


def test_an_existing_regular_output_is_replaced(tiny_checkpoint, x_file, tmp_path) -> None:
    """... and the new file gets the permissions any new file of the process gets (safetensors writes a private
    temporary file and renames it over the path)."""
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"old bytes")
    r = _forward(tiny_checkpoint, x_file, out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(load_outputs(out)) == [f"layers.{i}" for i in range(4)]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~umask
    assert not list(tmp_path.glob(".glm-ep-probe-*")), "the writability probe was left behind"


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_save_readable_gives_the_umask_modes_and_leaves_the_umask(tmp_path, monkeypatch, umask: int) -> None:
    """The mode comes from the process's umask, read without changing it; a file system that refuses chmod
    leaves the file written (safetensors' 0600), not an error."""
    from glm_ep.app import files

    old = os.umask(umask)
    try:
        assert files._umask() == umask
        files.save_readable({"a": np.zeros(3, np.float32)}, tmp_path / "a.safetensors")
        assert os.stat(tmp_path / "a.safetensors").st_mode & 0o777 == 0o666 & ~umask
        assert os.umask(umask) == umask  # still the process's
        monkeypatch.setattr(os, "chmod", lambda *a, **k: (_ for _ in ()).throw(PermissionError("no chmod here")))
        files.save_readable({"b": np.ones(2, np.float32)}, tmp_path / "b.safetensors")
        assert (tmp_path / "b.safetensors").stat().st_size > 0
    finally:
        os.umask(old)


def test_an_output_folder_where_no_file_can_be_made_is_refused_early(tmp_path, monkeypatch) -> None:
    """What the permission bits do not say (a read-only or pseudo file system, as /sys): refused by the check that
    runs before the load, not after it at the write."""
    import errno
    import tempfile

    def read_only(**kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(InputError, match=f"cannot make a file in output folder '{tmp_path}' \\(Read-only file "
                                         "system\\); expected a writable folder"):
        check_output_path(str(tmp_path / "out.safetensors"))


def test_output_folder_not_writable(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Root may write anywhere, so the permission answer is stubbed."""
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(InputError, match=f"output folder '{tmp_path}' is not writable"):
        check_output_path(str(tmp_path / "out.safetensors"))


def _other_tensor(d):
    write_safetensors(d / "x.safetensors", {"x": ("BF16", (2, 128), bytes(2 * 128 * 2))})
    return d / "x.safetensors"


def _not_safetensors(d):
    (d / "x.safetensors").write_bytes(b"hidden_states,1,2,3\n")
    return d / "x.safetensors"


@pytest.mark.parametrize("make,needle", [
    (lambda d: d / "missing.safetensors", "input file not found"),
    (lambda d: d, "input file is a folder"),
    (_other_tensor, "no tensor 'hidden_states' (found ['x'])"),
    (_not_safetensors, "not a readable safetensors file"),
], ids=["missing", "folder", "other-tensor", "not-safetensors"])
def test_input_is_read_before_the_load(tiny_checkpoint, tmp_path, make, needle: str) -> None:
    r = _forward(tiny_checkpoint, make(tmp_path), tmp_path / "out.safetensors")
    fails(r, needle)
    assert not loaded_weights(r)


@pytest.mark.parametrize("dtype,itemsize", [("F8_E4M3", 1), ("F8_E5M2", 1), ("F32", 4), ("F16", 2)])
def test_input_dtype_is_named_from_the_header(tmp_path, dtype: str, itemsize: int) -> None:
    """An input of another dtype is refused by name before its data is read: NumPy cannot even hold the 8-bit
    floats (safetensors' reader raised an AttributeError for them)."""
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"hidden_states": (dtype, (3, 128), bytes(3 * 128 * itemsize))})
    with pytest.raises(InputError, match=rf"hidden_states is {dtype} \[3, 128\], expected BF16 \[rows, 128\]"):
        read_hidden_states(str(path), 128)


INDEX = "model.safetensors.index.json"


def _same_as_input(ckpt: Path, x_file: Path) -> Path:
    """The input by another spelling: through a sibling folder and '..'."""
    (x_file.parent / "sub").mkdir()
    return x_file.parent / "sub" / ".." / x_file.name


@pytest.mark.parametrize("target,what", [
    (lambda ckpt, x: x, "the --input file"),
    (_same_as_input, "the --input file"),
    (lambda ckpt, x: ckpt / "config.json", "a file of the model folder (config.json)"),
    (lambda ckpt, x: ckpt / INDEX, f"a file of the model folder ({INDEX})"),
    (lambda ckpt, x: shard_of(ckpt, "model.layers.2.mlp.experts.3.up_proj.weight"), "a file of the model folder ("),
], ids=["input", "input-other-spelling", "config", "index", "shard"])
def test_output_that_is_a_file_the_job_reads_is_refused_and_kept(tiny_checkpoint, x_file, tmp_path, target,
                                                                 what: str) -> None:
    """``--output`` naming the input or a file of the model folder was written over (exit 0, the input gone):
    refused on every rank before the load, the file left as it was."""
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "tiny")  # a regression writes over this copy only
    out = target(ckpt, x_file)
    before = out.read_bytes()
    r = _forward(ckpt, x_file, out)
    fails(r, f"--output {out}: is {what}", "expected another path")
    assert not loaded_weights(r)
    assert out.read_bytes() == before


def test_a_checkpoint_shard_as_the_input_is_named_in_one_short_line(tiny_checkpoint, tmp_path) -> None:
    """A shard has no hidden_states: the message lists a few of its tensors, not every name (a 63 KB line for a
    real shard)."""
    shard = shard_of(tiny_checkpoint, "model.layers.2.mlp.experts.3.up_proj.weight")
    assert len(read_safetensors(shard)) > 20
    r = _forward(tiny_checkpoint, shard, tmp_path / "out.safetensors")
    fails(r, f"{shard}: no tensor 'hidden_states' (found ['model.layers.", " more])")
    assert max(len(line) for line in r.stderr.splitlines()) < 600, r.stderr[-3000:]


@pytest.mark.parametrize("error,message", [
    (PermissionError(13, "Permission denied", "ck/config.json"),
     "ck/config.json: permission denied; expected a path this process may read (or write, for an output)"),
    (FileNotFoundError(2, "No such file or directory", "ck/s.safetensors"),
     "ck/s.safetensors: no such file or directory; expected an existing path"),
    (OSError(36, "File name too long", "x" * 300), f"{'x' * 300}: file name too long; expected a shorter path"),
    (OSError(28, "No space left on device"),
     "writing a file: no space left on device; expected room on the device for what is written"),
], ids=["permission", "missing", "name-too-long", "full-disk"])
def test_a_file_the_system_refuses_is_a_user_error(error: OSError, message: str, capsys) -> None:
    """An OSError about one of the job's files (it names the path; or a full disk, which a write to stdout names
    none of) is the user's to mend: inside an agreement point an agreed error, not a crash; outside one a clear
    line and exit 2, not a traceback. Any other exception stays a crash."""
    from mpi4py import MPI

    from glm_ep.errors import EXIT_USER, file_access_error
    from glm_ep.dist.ranks import AgreedError, Ranks, run_guarded

    def refused():
        raise error

    with pytest.raises(AgreedError) as e:
        Ranks(MPI.COMM_SELF).agree("open", refused)
    assert str(e.value) == message and not e.value.internal
    assert run_guarded(refused, None) == EXIT_USER
    assert capsys.readouterr().err == f"glm-ep: error: {message}\n"
    assert file_access_error(OSError(5, "Input/output error")) is None  # no path: a crash
    assert file_access_error(ValueError("x")) is None
    # errors of ours, not the user's: too many open files, an I/O error on a named file, a missing kernel source
    assert file_access_error(OSError(24, "Too many open files", "/tmp/x")) is None
    assert file_access_error(OSError(5, "Input/output error", "/tmp/x")) is None
    import glm_ep

    own = Path(glm_ep.__file__).parent / "backend" / "cuda" / "kernels" / "missing.cu"
    assert file_access_error(FileNotFoundError(2, "No such file or directory", str(own))) is None


def test_files_the_system_refuses_end_the_job_with_one_line(tiny_checkpoint, tmp_path) -> None:
    """A path too long for the file system, on every rank (an agreed error), and a full stdout: exit 2 with one
    line each, never a traceback (run as root too, where permissions do not refuse)."""
    long = tmp_path / ("a" * 300 + ".safetensors")
    r = glm_ep(2, "forward", "--model", str(tiny_checkpoint), "--input", str(long), "--output",
               str(tmp_path / "out.safetensors"))
    fails(r, f"{long}: file name too long; expected a shorter path")
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "glm_ep", "footprint", "--preset", "tiny"], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert r.stderr == ("glm-ep: error: writing to stdout: no space left on device; expected room on the device "
                        "for what is written\n"), r.stderr
    with open("/dev/full", "w") as full:  # stderr refused too: the exit code still says it
        r = subprocess.run([sys.executable, "-m", "glm_ep", "footprint", "--preset", "tiny"], stdout=full,
                           stderr=full, timeout=120, cwd=REPO)
    assert r.returncode == 2


def _disk_full(*args, **kwargs):  # what safetensors' writer raises on a full disk: its own error, not an OSError
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_synth_on_a_full_disk_is_a_user_error(tmp_path, monkeypatch, capsys) -> None:
    """safetensors reports a failed write (no space left) as its own SafetensorError; save_readable makes it the
    OSError it is, which synth reports as the user's (exit 2); any other SafetensorError stays a crash."""
    import safetensors.numpy
    from safetensors import SafetensorError

    from glm_ep.app.cli import main

    monkeypatch.setattr(safetensors.numpy, "save_file", _disk_full)
    assert main(["synth", "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "cannot write it (No space left on device)" in err, err
    assert "Traceback" not in err

    def unserialisable(*args, **kwargs):  # not the disk: a tensor of ours it could not write, a crash
        raise SafetensorError("Error while serializing: the tensor is not contiguous")

    monkeypatch.setattr(safetensors.numpy, "save_file", unserialisable)
    assert main(["synth", "--out", str(tmp_path / "ck2"), "--force"]) == 1
    assert "internal error" in capsys.readouterr().err


def test_make_input_on_a_full_disk_is_a_user_error(tmp_path, monkeypatch, capsys) -> None:
    import safetensors.numpy

    from glm_ep.app.cli import main

    monkeypatch.setattr(safetensors.numpy, "save_file", _disk_full)
    out = tmp_path / "in.safetensors"
    assert main(["make-input", "--hidden", "64", "--rows", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"glm-ep: error: {out}: cannot write the input (No space left on device)" in err, err
    assert "Traceback" not in err and not out.exists()


def _small_load():
    """An expert load of 2 sparse layers of 8 experts, top-2, as ``run --expert-load`` records one."""
    from glm_ep.balance.expert_load import ExpertLoad

    rng = np.random.default_rng(0)
    choices = [rng.integers(0, 8, (6, 2)).astype(np.int32) for _ in range(2)]
    counts = np.stack([np.bincount(c.ravel(), minlength=8) for c in choices]).astype(np.int64)
    model = {"num_hidden_layers": 3, "n_routed_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
             "moe_intermediate_size": 32}
    layout = {"world": 1, "tp": 1, "ep": 1, "moe_tp": 1, "expert_placement": ""}
    return ExpertLoad(model, (1, 2), layout, counts, counts.sum(axis=1, keepdims=True),
                      [np.array([6], np.int64)] * 2, choices)


def test_expert_load_on_a_full_disk_is_a_user_error(tmp_path, monkeypatch) -> None:
    import safetensors.numpy

    monkeypatch.setattr(safetensors.numpy, "save_file", _disk_full)
    with pytest.raises(InputError, match=r"el.safetensors: cannot write the expert load \(No space left on device\)"):
        _small_load().save(tmp_path / "el.safetensors")
    assert not (tmp_path / "el.safetensors").exists()


def test_a_placement_or_heat_map_cut_short_leaves_no_file(tmp_path, monkeypatch) -> None:
    """A write that fails part way (a full disk) leaves neither a partial file nor a stray temporary one, and an
    existing file at the path as it was."""
    from glm_ep.app import files
    from glm_ep.balance.eplb import balanced_placement

    load = _small_load()
    placed = balanced_placement(load.logical_count, load.layers, 2, 0)
    out = tmp_path / "p.json"
    real_write = Path.write_text

    def half_then_full(self, text, *args, **kwargs):
        real_write(self, text[:10])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(OSError):
        placed.save(out)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    out.write_text("old")
    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(OSError):
        placed.save(out)
    monkeypatch.undo()
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]
    with files.replacing(tmp_path / "q.bin") as tmp:
        tmp.write_bytes(b"new")
    assert (tmp_path / "q.bin").read_bytes() == b"new"

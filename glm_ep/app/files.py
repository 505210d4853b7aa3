"""The ``forward`` job's files: its input hidden states and its output path.

Both are checked before any weight is read. The input must be bf16 ``[rows, hidden]`` with every
value finite (``allow_nonfinite_input`` computes NaN/Inf rows instead). The output's folder must
exist and be writable, and an existing output must be a regular file: a folder, a symbolic link,
a FIFO or a device node is refused, never replaced (``save_file`` renames a new file over the path).
Nor may the output be a file the job reads: the input, or a file of the model folder (``job_inputs``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

from glm_ep.checkpoint.reader import INDEX_FILE, SINGLE_FILE
from glm_ep.config.model import HF_QUANT_FILE
from glm_ep.errors import PATH_KINDS, InputError, not_a_file
from glm_ep.checkpoint.finite import nonfinite_mask

BF16 = ml_dtypes.bfloat16
_SHOWN_NAMES = 8  # names an error message lists before "... N more"


def few_names(names: Iterable[str], shown: int = _SHOWN_NAMES) -> str:
    """``names`` sorted, as a list of at most ``shown`` of them and how many more there are: an error line stays
    short however many tensors a file holds (a checkpoint shard given as the input holds thousands)."""
    names = sorted(names)
    more = [f"... {len(names) - shown} more"] if len(names) > shown else []
    return "[" + ", ".join([repr(n) for n in names[:shown]] + more) + "]"


def read_hidden_states(path: str, hidden: int, allow_nonfinite: bool = False) -> np.ndarray:
    """``hidden_states`` bf16 ``[rows, hidden]`` from a safetensors file, every row finite unless allowed."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    if (problem := not_a_file(p, "input file")) is not None:
        raise InputError(f"{problem}; expected a safetensors file")
    if not os.access(p, os.R_OK):  # safetensors would call it a file not found
        raise InputError(f"{p}: permission denied; expected an input file this process may read")
    try:
        with safe_open(str(p), framework="numpy") as f:
            if "hidden_states" not in f.keys():
                raise InputError(f"{p}: no tensor 'hidden_states' (found {few_names(f.keys())})")
            sl = f.get_slice("hidden_states")
            dtype, shape = sl.get_dtype(), list(sl.get_shape())
            if dtype != "BF16":  # read from the header: NumPy cannot even hold some (F8_E4M3, F4)
                raise InputError(f"{p}: hidden_states is {dtype} {shape}, expected BF16 [rows, {hidden}]")
            x = f.get_tensor("hidden_states")
    except SafetensorError as e:
        raise InputError(f"{p}: not a readable safetensors file ({e})") from None
    if x.dtype != BF16 or x.ndim != 2 or x.shape[1] != hidden or x.shape[0] < 1:
        raise InputError(f"{p}: hidden_states is {x.dtype} {list(x.shape)}, expected bfloat16 [rows >= 1, {hidden}]")
    bad_rows = np.flatnonzero(nonfinite_mask(x).any(axis=1))
    if bad_rows.size and not allow_nonfinite:
        shown = bad_rows[:8].tolist()
        raise InputError(f"{p}: hidden_states has {bad_rows.size} of {x.shape[0]} rows holding NaN or Inf "
                         f"(rows {shown}{' ...' if bad_rows.size > len(shown) else ''}); expected finite values "
                         "(allow_nonfinite_input = true in the topology computes them)")
    return x


def job_inputs(input_path: str, model_dir: str) -> list[tuple[str, Path]]:
    """What ``forward`` reads, as (what it is, path) pairs: the input file and the files of the model folder
    (config.json, the quantization record, the safetensors index and every shard it names, or the single
    file). Read from the folder as it is; an unreadable index names no shards (the load reports it)."""
    folder = Path(model_dir)
    names = ["config.json", HF_QUANT_FILE, INDEX_FILE, SINGLE_FILE]
    try:
        weight_map = json.loads((folder / INDEX_FILE).read_bytes()).get("weight_map")
        names += sorted({v for v in weight_map.values() if isinstance(v, str)})
    except (OSError, ValueError, AttributeError, RecursionError):
        pass
    return [("the --input file", Path(input_path))] + [(f"a file of the model folder ({n})", folder / n)
                                                        for n in names]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # either missing (or a name the OS refuses): not the same existing file
        return False


def check_output_path(path: str, reads: Iterable[tuple[str, Path]] = ()) -> Path:
    """``path`` if a new output can be written there: its folder exists and is writable, an
    existing file at ``path`` is a regular one, and it is none of the files the job ``reads``
    ((what it is, path) pairs: ``job_inputs``). InputError naming what is wrong otherwise."""
    p = Path(path)
    folder = p.parent
    if not folder.is_dir():
        raise InputError(f"{p}: output folder '{folder}' does not exist; expected an existing, writable folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{p}: output folder '{folder}' is not writable")
    try:  # what the permission bits do not say (a read-only or pseudo file system): a file made and removed now
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".glm-ep-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(f"{p}: cannot make a file in output folder '{folder}' ({e.strerror or e}); expected a "
                         "writable folder") from None
    try:
        mode = os.lstat(p).st_mode
    except FileNotFoundError:
        return p
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in PATH_KINDS if test(mode)), "not a regular file")
        raise InputError(f"{p}: the output path exists and is {kind}; expected a new path or a regular file "
                         "to replace")
    for what, q in reads:
        if _same_file(p, q):
            raise InputError(f"--output {p}: is {what}; expected another path (writing there would destroy "
                             "what the job reads)")
    return p


def save_readable(tensors: dict[str, np.ndarray], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.numpy.save_file``, leaving the file with the permissions any new file of this process gets
    (0666 less the umask): save_file writes a private temporary file (0600) and renames it over the path. Its
    I/O failures (a full disk) come out as OSError, as Python's own writes fail, with the errno it names; any other
    SafetensorError (a tensor it cannot serialise) as it is."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:  # e.g. "Error while serializing: I/O error: No space left on device (os error 28)"
        if "I/O error" not in str(e):  # a tensor it could not serialise: the caller's, a crash
            raise
        code = re.search(r"os error (\d+)", str(e))
        raise (OSError(int(code[1]), os.strerror(int(code[1])), str(path)) if code else OSError(str(e))) from None
    try:
        os.chmod(path, 0o666 & ~_umask())
    except OSError:  # a file system that keeps its own modes: the file is written all the same
        pass


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A new file's temporary path in ``path``'s folder, renamed over ``path`` when the block ends and removed if it
    fails: a write cut short (a full disk, an interrupt) leaves neither a partial file nor an emptied old one. The
    file gets the permissions any new file of this process gets (0666 less the umask)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """The process's umask, read without setting it where Linux reports it (``os.umask`` sets it, for a moment
    the whole process's, threads included)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def write_outputs(outputs: dict[str, np.ndarray], path: str, reads: Iterable[tuple[str, Path]] = ()) -> Path:
    """Write ``outputs`` as safetensors to ``path``, checked again right before writing."""
    from safetensors import SafetensorError

    p = check_output_path(path, reads)
    try:
        save_readable(outputs, p)
    except (OSError, SafetensorError) as e:
        raise InputError(f"{p}: cannot write the output ({e})") from None
    return p

"""The ``forward`` job's files: its input hidden states and its output path.

Both are checked before any weight is read. The input must be bf16 ``[rows, hidden]`` with every
value finite (``allow_nonfinite_input`` computes NaN/Inf rows instead). The output's folder must
exist and be writable, and an existing output must be a regular file: a folder, a symbolic link,
a FIFO or a device node is refused, never replaced (``save_file`` renames a new file over the path).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import ml_dtypes
import numpy as np

from glm_ep.errors import InputError
from glm_ep.finite import nonfinite_mask

BF16 = ml_dtypes.bfloat16
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device node"), (stat.S_ISBLK, "a block device node"),
          (stat.S_ISSOCK, "a socket"))


def read_hidden_states(path: str, hidden: int, allow_nonfinite: bool = False) -> np.ndarray:
    """``hidden_states`` bf16 ``[rows, hidden]`` from a safetensors file, every row finite unless allowed."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: input file not found" if not p.exists() else
                         f"{p}: input is not a regular file; expected a safetensors file")
    try:
        with safe_open(str(p), framework="numpy") as f:
            if "hidden_states" not in f.keys():
                raise InputError(f"{p}: no tensor 'hidden_states' (found {sorted(f.keys())})")
            sl = f.get_slice("hidden_states")
            dtype, shape = sl.get_dtype(), list(sl.get_shape())
            if dtype != "BF16":  # read from the header: NumPy cannot even hold some (F8_E4M3, F4)
                raise InputError(f"{p}: hidden_states is {dtype} {shape}, expected BF16 [rows, {hidden}]")
            x = f.get_tensor("hidden_states")
    except SafetensorError as e:
        raise InputError(f"{p}: not a readable safetensors file ({e})") from None
    if x.dtype != BF16 or x.ndim != 2 or x.shape[1] != hidden or x.shape[0] < 1:
        raise InputError(f"{p}: hidden_states is {x.dtype} {list(x.shape)}, expected bfloat16 [rows, {hidden}]")
    bad_rows = np.flatnonzero(nonfinite_mask(x).any(axis=1))
    if bad_rows.size and not allow_nonfinite:
        shown = bad_rows[:8].tolist()
        raise InputError(f"{p}: hidden_states has {bad_rows.size} of {x.shape[0]} rows holding NaN or Inf "
                         f"(rows {shown}{' ...' if bad_rows.size > len(shown) else ''}); expected finite values "
                         "(allow_nonfinite_input = true in the topology computes them)")
    return x


def check_output_path(path: str) -> Path:
    """``path`` if a new output can be written there: its folder exists and is writable, and an
    existing file at ``path`` is a regular one. InputError naming what is wrong otherwise."""
    p = Path(path)
    folder = p.parent
    if not folder.is_dir():
        raise InputError(f"{p}: output folder '{folder}' does not exist; expected an existing, writable folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{p}: output folder '{folder}' is not writable")
    try:
        mode = os.lstat(p).st_mode
    except FileNotFoundError:
        return p
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise InputError(f"{p}: the output path exists and is {kind}; expected a new path or a regular file "
                         "to replace")
    return p


def write_outputs(outputs: dict[str, np.ndarray], path: str) -> Path:
    """Write ``outputs`` as safetensors to ``path``, checked again right before writing."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    p = check_output_path(path)
    try:
        save_file(outputs, str(p))
    except (OSError, SafetensorError) as e:
        raise InputError(f"{p}: cannot write the output ({e})") from None
    return p

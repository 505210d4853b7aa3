"""Arrays in and out of the library API: NumPy, CuPy and torch tensors, each given back as it came.

An input is bfloat16 ``[rows, hidden]``. The result is a fresh bfloat16 array of the input's own
kind on the input's own device: NumPy in, NumPy out; CuPy in, CuPy out; a torch tensor in, a torch
tensor out. torch tensors cross through DLPack. DLPack consumers such as NumPy have no bfloat16, so
a tensor crosses as its 16-bit patterns (``int16``) and is viewed back as bfloat16 on the other
side: no rounding, and no copy where the tensor already sits where the backend computes.

On the CUDA backend the runtime's stream first waits for the caller's current CuPy stream (torch's
is handled by DLPack's stream exchange), and the caller's stream then waits for the runtime's, so
inputs and results are ordered without a host sync.
"""

from __future__ import annotations

import contextlib
import operator
import sys
from typing import Any, Iterator

import ml_dtypes
import numpy as np

from glm_ep.errors import InputError

BF16 = ml_dtypes.bfloat16
KINDS = ("numpy", "cupy", "torch")


def kind_of(x: Any) -> str:
    """``"numpy"``, ``"cupy"`` or ``"torch"``; anything else is refused, naming its type."""
    if isinstance(x, np.ndarray):
        return "numpy"
    root = type(x).__module__.partition(".")[0]
    if root in KINDS:
        return root
    raise InputError(f"input is a {type(x).__module__}.{type(x).__qualname__}; expected a NumPy or CuPy "
                     "array or a torch tensor, bfloat16 [rows, hidden]")


def check_input(x: Any, hidden: int) -> str:
    """The kind of ``x`` after checking it is bfloat16 ``[rows >= 1, hidden]``."""
    kind = kind_of(x)
    if kind == "torch" and x.device.type not in ("cpu", "cuda"):  # meta (no data), mps, xla, ...: nothing to read
        raise InputError(f"input is a torch tensor on device {str(x.device)!r}; expected a CPU or CUDA tensor")
    dtype = str(x.dtype).rpartition(".")[2]  # 'bfloat16' for NumPy/CuPy, 'torch.bfloat16' for torch
    shape = tuple(x.shape)
    if dtype != "bfloat16" or len(shape) != 2 or shape[1] != hidden or shape[0] < 1:
        raise InputError(f"input is {dtype} {list(shape)}, expected bfloat16 [rows >= 1, {hidden}] "
                         f"(hidden_size {hidden})")
    return kind


def layer_index(i: Any, layers: int) -> int:
    """``i`` as a layer index in ``0 .. layers - 1``: a Python or NumPy integer, never a boolean."""
    try:
        if isinstance(i, (bool, np.bool_)):
            raise TypeError
        index = operator.index(i)
    except TypeError:
        raise InputError(f"site index {i!r} is not an integer; expected 0..{layers - 1}") from None
    if not 0 <= index < layers:
        raise InputError(f"site index {i!r} is out of range; the model has layers 0..{layers - 1}")
    return index


def host_bits(x: Any) -> bytes:
    """The bytes of a checked input (``check_input``), copied to the host where it is on a device."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).tobytes()
    if kind_of(x) == "cupy":
        return x.get().tobytes()
    return x.detach().view(sys.modules["torch"].int16).cpu().numpy().tobytes()


def _same_device(a: Any, be: Any, what: str) -> Any:
    if a.device.id != be.device.id:
        raise InputError(f"{what} is on CUDA device {a.device.id}, but this rank runs on device {be.device.id}; "
                         "move it there first")
    return a


def to_backend(x: Any, kind: str, be: Any) -> Any:
    """``x`` as the backend's bf16 array: the same memory where it can be, a copy where it must cross."""
    if kind == "torch":
        bits = x.detach().view(sys.modules["torch"].int16)
        if be.name == "cuda" and bits.is_cuda:
            return _same_device(be.xp.from_dlpack(bits), be, "the torch tensor").view(BF16)
        return be.asarray(np.from_dlpack(bits.cpu()).view(BF16))
    if kind == "cupy":
        return _same_device(x, be, "the CuPy array") if be.name == "cuda" else be.asarray(x.get())
    return be.asarray(x)


def from_backend(out: Any, like: Any, kind: str, be: Any) -> Any:
    """The backend array ``out`` (fresh, handed over) as an array of ``like``'s kind and device."""
    if kind == "numpy":
        return out if isinstance(out, np.ndarray) else be.to_host(out)
    if kind == "cupy":
        if be.name == "cuda":
            return out
        with like.device:
            return sys.modules["cupy"].asarray(out)
    torch = sys.modules["torch"]
    if be.name == "cuda" and like.is_cuda:
        return torch.from_dlpack(out.view(np.int16)).view(torch.bfloat16)
    host = out if isinstance(out, np.ndarray) else be.to_host(out)
    return torch.from_dlpack(host.view(np.int16)).view(torch.bfloat16).to(like.device)


@contextlib.contextmanager
def runtime_stream(be: Any) -> Iterator[None]:
    """CUDA: run the block on the runtime's device and stream, ordered after the caller's current
    stream, and order the caller's stream after it. Other backends run the block as it is."""
    if be.name != "cuda":
        yield
        return
    caller = be.xp.cuda.get_current_stream()  # of the caller's current device, which may be another
    be.stream.wait_event(caller.record())
    with be.device, be.stream:
        yield
    caller.wait_event(be.stream.record())

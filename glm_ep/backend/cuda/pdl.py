"""Programmatic dependent launch (sm_90 and later): each kernel may start placing its blocks while
the one before it on the stream drains, so the launch latency and the previous kernel's tail
overlap instead of adding up.

Every kernel of glm_ep opens with ``pdl_enter()`` (``kernels/common.cuh``): ``griddepcontrol.wait``
before it touches global memory, then ``griddepcontrol.launch_dependents``. A kernel launched with
the programmatic-serialization attribute therefore reads nothing before its predecessor has
finished and flushed, the same ordering a plain launch gets, and a stream capture records the pair
as a programmatic edge of the graph. CuPy's ``RawKernel`` cannot pass launch attributes, so the
launch goes through the driver's ``cuLaunchKernelEx`` (ctypes), with the arguments marshalled as
CuPy would: a device array as its pointer, a NumPy scalar as its bytes.

The backend turns it on around its own ops (``dependent_launches``, from the ``pdl`` lever); other
code that launches through ``loader.launch`` gets plain launches, and so do the persistent decode
rings (``launch(..., persistent=True)``: placed while their predecessor drains, their blocks would
crowd the SMs that free first; docs/perf/NOTES.md, "Programmatic dependent launch").
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
from typing import Any, Iterator

import numpy as np

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("glm_ep_pdl", default=False)


@contextlib.contextmanager
def dependent_launches(on: bool) -> Iterator[None]:
    """Launches through ``loader.launch`` inside the block use programmatic dependent launch when
    ``on`` (the caller has checked ``supported``)."""
    token = _ACTIVE.set(on)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    return _ACTIVE.get()


@functools.cache
def _driver() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernelEx
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return lib


def unsupported_reason(compute_capability: tuple[int, int]) -> str | None:
    """Why programmatic dependent launch is not available on a device of this compute capability
    (None where it is)."""
    if compute_capability < (9, 0):
        return f"sm_{compute_capability[0]}{compute_capability[1]} has no griddepcontrol (sm_90 and later)"
    try:
        _driver().cuLaunchKernelEx
    except (OSError, AttributeError) as e:
        return f"the CUDA driver has no cuLaunchKernelEx ({e})"
    return None


def kernel_params(args: tuple) -> tuple[Any, list[np.ndarray]]:
    """The ``void**`` array of ``cuLaunchKernelEx`` for ``args`` and the host buffers it points
    into (to keep alive until the launch returns): an object with ``.data.ptr`` (a CuPy array) is
    passed as its device pointer, a NumPy scalar as its own bytes."""
    held = []
    for i, a in enumerate(args):
        if isinstance(a, np.generic):
            held.append(np.array(a))
        elif hasattr(a, "data") and hasattr(a.data, "ptr"):
            held.append(np.array(a.data.ptr, dtype=np.uint64))
        else:
            raise TypeError(f"kernel argument {i}: {type(a).__name__}, expected a device array or a NumPy scalar "
                            "(np.int32, np.int64, np.float32, np.uint64)")
    params = (ctypes.c_void_p * max(len(held), 1))(*[h.ctypes.data for h in held])
    return params, held


def launch(function_ptr: int, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, smem: int,
           stream_ptr: int) -> None:
    """``cuLaunchKernelEx`` with programmatic stream serialization allowed."""
    params, held = kernel_params(args)
    attr = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value = (1).to_bytes(4, "little")  # programmaticStreamSerializationAllowed = 1
    grid3, block3 = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(*block3), smem, stream_ptr,
                        ctypes.pointer(attr), 1)
    lib = _driver()
    rc = lib.cuLaunchKernelEx(ctypes.byref(cfg), function_ptr, params, None)
    del held
    if rc != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"cuLaunchKernelEx failed: {(name.value or b'?').decode()} ({rc})")

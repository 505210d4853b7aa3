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
crowd the SMs that free first; docs/perf/DESIGN-NOTES.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import struct
import threading
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


# A scalar argument's struct code by (dtype kind, itemsize): its own bytes, as CuPy passes a NumPy scalar.
_SCALAR_CODES = {("i", 1): "b", ("u", 1): "B", ("b", 1): "?", ("i", 2): "h", ("u", 2): "H", ("f", 2): "e",
                 ("i", 4): "i", ("u", 4): "I", ("f", 4): "f", ("i", 8): "q", ("u", 8): "Q", ("f", 8): "d"}
_SLOT = 8  # every argument gets an 8-byte slot of the parameter buffer (each is read through its own pointer)


@functools.cache
def _layout(types: tuple[type, ...]) -> tuple[struct.Struct, tuple[bool, ...], tuple[int, ...]]:
    """(packer, which arguments are device arrays, each argument's size) for arguments of these types;
    one per kernel signature, so a launch only reads the pointers and packs the bytes."""
    codes, pointers, sizes = [], [], []
    for i, t in enumerate(types):
        if issubclass(t, np.generic):
            dt = np.dtype(t)
            code = _SCALAR_CODES.get((dt.kind, dt.itemsize))
            if code is None:
                raise TypeError(f"kernel argument {i}: {t.__name__}, expected a device array or a NumPy scalar "
                                "of at most 8 bytes (np.int32, np.int64, np.float32, np.uint64)")
            codes.append(code + "x" * (_SLOT - dt.itemsize))
            pointers.append(False)
            sizes.append(dt.itemsize)
        else:  # a device array (a CuPy array's .data is a MemoryPointer): checked per value in kernel_params
            codes.append("Q")
            pointers.append(True)
            sizes.append(8)
    return struct.Struct("<" + "".join(codes)), tuple(pointers), tuple(sizes)


class _Buffers(threading.local):
    """This thread's parameter buffers by argument count (``cuLaunchKernelEx`` copies the values it is
    handed before it returns, so one buffer per thread and count serves every launch)."""

    def __init__(self) -> None:
        self.by_count: dict[int, tuple[Any, Any]] = {}

    def get(self, n: int) -> tuple[Any, Any]:
        got = self.by_count.get(n)
        if got is None:
            slots = max(n, 1)
            values = ctypes.create_string_buffer(_SLOT * slots)
            base = ctypes.addressof(values)
            got = values, (ctypes.c_void_p * slots)(*[base + _SLOT * i for i in range(slots)])
            self.by_count[n] = got
        return got


_BUFFERS = _Buffers()


def kernel_params(args: tuple) -> tuple[Any, tuple[int, ...]]:
    """The ``void**`` array of ``cuLaunchKernelEx`` for ``args`` and each argument's size in bytes: an
    object with ``.data.ptr`` (a CuPy array) is passed as its device pointer, a NumPy scalar as its own
    bytes. The array points into this thread's buffer for that many arguments: valid until the
    thread's next call with as many."""
    packer, pointers, sizes = _layout(tuple(map(type, args)))
    try:
        values = [a.data.ptr if p else a for a, p in zip(args, pointers)]
    except AttributeError:
        bad = next(i for i, (a, p) in enumerate(zip(args, pointers)) if p and not hasattr(getattr(a, "data", None),
                                                                                         "ptr"))
        raise TypeError(f"kernel argument {bad}: {type(args[bad]).__name__}, expected a device array (with "
                        ".data.ptr) or a NumPy scalar (np.int32, np.int64, np.float32, np.uint64)") from None
    buf, params = _BUFFERS.get(len(args))
    packer.pack_into(buf, 0, *values)
    return params, sizes


class _Launch(threading.local):
    """This thread's ``CUlaunchConfig`` and its one attribute (programmatic stream serialization
    allowed), filled in per launch."""

    def __init__(self) -> None:
        self.attr = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
        self.attr.value = (1).to_bytes(4, "little")  # programmaticStreamSerializationAllowed = 1
        self.cfg = _LaunchConfig(attrs=ctypes.pointer(self.attr), num_attrs=1)


_LAUNCH = _Launch()


def launch(function_ptr: int, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, smem: int,
           stream_ptr: int) -> None:
    """``cuLaunchKernelEx`` with programmatic stream serialization allowed."""
    params, _ = kernel_params(args)
    cfg = _LAUNCH.cfg
    cfg.grid[:] = (tuple(grid) + (1, 1))[:3]
    cfg.block[:] = (tuple(block) + (1, 1))[:3]
    cfg.shared_mem = smem
    cfg.stream = stream_ptr
    lib = _driver()
    rc = lib.cuLaunchKernelEx(ctypes.byref(cfg), function_ptr, params, None)
    if rc != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"cuLaunchKernelEx failed: {(name.value or b'?').decode()} ({rc})")

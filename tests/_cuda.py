"""The CUDA tests' device side: the skip logic (CuPy and a visible device, or skip with the reason),
one backend per process, copies to and from it, and poisoned outputs that catch unwritten elements.
The comparisons against the NumPy twins (``assert_close``, ``assert_ulps``) are in ``helpers``."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.weights import MoeWeights

from helpers import BF16


def _probe():
    try:
        import cupy
    except Exception as e:  # not installed, or built for another CUDA
        return None, f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return None, f"no CUDA device ({type(e).__name__}: {e})"
    return (cupy, "") if n > 0 else (None, "no CUDA device")


cupy, _REASON = _probe()
#: apply as ``pytestmark = [pytest.mark.cuda, requires_cuda]``
requires_cuda = pytest.mark.skipif(cupy is None, reason=_REASON or "CUDA available")


@functools.cache
def backend():
    """One CudaBackend per process: its stream is the current CuPy stream."""
    from glm_ep.backend.cuda import CudaBackend

    return CudaBackend(0)


def dev(a: np.ndarray):
    return backend().asarray(a)


def host(a) -> np.ndarray:
    return backend().to_host(a)


def both(w: MoeWeights, be=None, limit: float = 10.0):
    """The routed-expert tables of ``w`` on the CUDA backend (``be``, default the shared one; the
    ring's operand forms chosen for ``swiglu_limit = limit``) and on NumPy: (cuda, numpy)."""
    return (be or backend()).upload_moe(w, limit).experts, NumpyBackend().upload_moe(w, limit).experts


def poisoned(shape, dtype):
    """A device buffer whose every byte is 0xFF (NaN for bf16/fp32) or, for int32, 0x7B7B7B7B:
    a value no kernel writes, so an element left unwritten is caught."""
    a = cupy.empty(shape, dtype=dtype)
    backend().synchronize()
    if np.dtype(dtype) == np.int32:
        a.fill(0x7B7B7B7B)
    else:
        cupy.cuda.runtime.memsetAsync(a.data.ptr, 0xFF, a.nbytes, backend().stream.ptr)
    return a


def unwritten(a: np.ndarray) -> np.ndarray:
    """Mask of elements still holding the poison."""
    if a.dtype == np.int32:
        return a == 0x7B7B7B7B
    bits = a.view(np.uint16 if a.dtype == BF16 else np.uint32)
    return bits == (0xFFFF if a.dtype == BF16 else 0xFFFFFFFF)


def assert_written(a: np.ndarray, what: str) -> None:
    bad = unwritten(a)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {a.size} elements left unwritten"

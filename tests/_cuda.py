"""Shared by the CUDA tests: the skip logic (CuPy and a visible device, or skip with the reason),
one backend per process, and the comparisons every CUDA test makes against its NumPy twin."""

from __future__ import annotations

import functools
import zlib

import ml_dtypes
import numpy as np
import pytest

BF16 = ml_dtypes.bfloat16


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


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name: fresh inputs per test, the same on every run."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def rand_bf16(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(BF16)
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


def rel_l2(got, ref) -> float:
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm((got - ref).ravel()) / max(np.linalg.norm(ref.ravel()), 1e-30))


def assert_close(got, ref, what: str, tol: float = 1e-2) -> None:
    got32 = np.asarray(got, np.float32)
    assert np.isfinite(got32).all(), f"{what}: non-finite values"
    err = rel_l2(got, ref)
    assert err < tol, f"{what}: relative L2 error {err:.3e} >= {tol}"


def bf16_ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in bf16 steps (0 where both are NaN, huge where only one is)."""
    def ordered(x):
        u = x.astype(BF16).view(np.uint16).astype(np.int32)
        return np.where(u & 0x8000, 0x8000 - u, u)  # -0 and +0 both map to 0

    d = np.abs(ordered(a) - ordered(b))
    na, nb = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    return np.where(na & nb, 0, np.where(na | nb, 1 << 20, d))


def assert_ulps(got, ref, what: str, ulps: int = 1) -> None:
    d = bf16_ulps(np.asarray(got), np.asarray(ref))
    assert d.max() <= ulps, f"{what}: {int((d > ulps).sum())} elements more than {ulps} bf16 ulp apart (max {int(d.max())})"

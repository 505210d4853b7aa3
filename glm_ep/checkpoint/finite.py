"""NaN / Inf detection on bit patterns: no float copies, cheap at the real shape.

A floating-point value is NaN or Inf exactly when its exponent bits are all ones.
``float8_e4m3fn`` has no Inf: its only non-finite values are the NaNs 0x7F and 0xFF (exponent and
mantissa all ones). ``first_nonfinite`` scans a tensor in cache-sized chunks (one AND and one max
per chunk, cheap beside the read); ``nonfinite_mask`` is the elementwise form, for small arrays and
for describing a failure.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

#: dtype -> (unsigned view, mask): ``bits & mask == mask`` marks a NaN or Inf
SPECIAL_BITS: dict[np.dtype, tuple[type, int]] = {
    np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7F80),
    np.dtype(np.float16): (np.uint16, 0x7C00),
    np.dtype(np.float32): (np.uint32, 0x7F800000),
    np.dtype(np.float64): (np.uint64, 0x7FF0000000000000),
    np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, 0x7F),
}
_CHUNK = 1 << 18  # elements per scan step: the chunk and its scratch stay in L2


def can_be_nonfinite(dtype: np.dtype) -> bool:
    return np.dtype(dtype) in SPECIAL_BITS


def _bits(a: np.ndarray) -> tuple[np.ndarray, np.unsignedinteger]:
    view, mask = SPECIAL_BITS[a.dtype]
    return np.ascontiguousarray(a).view(view), view(mask)


def nonfinite_mask(a: np.ndarray) -> np.ndarray:
    """Boolean array, True where ``a`` is NaN or Inf."""
    bits, mask = _bits(a)
    return (bits & mask) == mask


def first_nonfinite(a: np.ndarray) -> tuple[int, ...] | None:
    """Index of the first NaN or Inf of ``a`` (in C order), or None when every value is finite."""
    bits, mask = _bits(a)
    flat = bits.reshape(-1)
    scratch = np.empty(min(_CHUNK, flat.size), dtype=flat.dtype)
    for start in range(0, flat.size, _CHUNK):
        chunk = flat[start:start + _CHUNK]
        masked = np.bitwise_and(chunk, mask, out=scratch[:chunk.size])
        if masked.max() == mask:
            return tuple(int(i) for i in np.unravel_index(start + int(np.argmax(masked == mask)), a.shape))
    return None


def describe_nonfinite(a: np.ndarray, at: tuple[int, ...], where: list[int] | None = None) -> str:
    """E.g. ``'nan (bits 0x7FC0) at [3, 17]; 5 of 4096 values are NaN or Inf'``: ``at`` from
    ``first_nonfinite``, ``where`` the position to print (default ``at``)."""
    bits, _ = _bits(a)
    bad = int(np.count_nonzero(nonfinite_mask(a)))
    return (f"{a[at]} (bits 0x{int(bits[at]):0{2 * a.itemsize}X}) at {where if where is not None else list(at)}; "
            f"{bad} of {a.size} values are NaN or Inf")

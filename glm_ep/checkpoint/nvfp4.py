"""ModelOpt NVFP4 weights on NumPy: pack, unpack, dequantize and quantize.

Layout (per projection, weights ``[N, K]``):

* ``weight``  uint8 ``[N, K/2]``: element ``2j`` in the LOW nibble of byte ``j``, ``2j+1`` in the
  high nibble. A nibble is sign (bit 3) + an index (bits 0-2) into E2M1 ``[0, .5, 1, 1.5, 2, 3, 4, 6]``.
* ``weight_scale`` float8_e4m3fn ``[N, K/16]``: one scale per 16 consecutive k.
* ``weight_scale_2`` fp32 scalar.

``w[n, k] = e2m1[n, k] * float(weight_scale[n, k // 16]) * weight_scale_2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from glm_ep.config.model import NVFP4_GROUP

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
#: All 16 nibbles as fp32 (sign in bit 3).
NIBBLE_TO_F32 = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)
E2M1_MAX = 6.0
E4M3_MAX = 448.0


@dataclass(frozen=True)
class Nvfp4Weight:
    """One NVFP4 projection ``[N, K]`` as stored in a ModelOpt checkpoint."""

    packed: np.ndarray  # uint8 [N, K/2]
    scale: np.ndarray  # float8_e4m3fn [N, K/16]
    scale_2: float  # fp32 per-projection scale

    @property
    def shape(self) -> tuple[int, int]:
        n, half = self.packed.shape
        return n, 2 * half

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + 4


def pack_nibbles(nib_NK: np.ndarray) -> np.ndarray:
    """``[N, K]`` nibbles (uint8 0..15) -> ``[N, K/2]`` bytes, even k in the low nibble."""
    nib = np.asarray(nib_NK, dtype=np.uint8)
    if nib.shape[-1] % 2:
        raise ValueError(f"K = {nib.shape[-1]} is odd; NVFP4 packs two elements per byte")
    return (nib[..., 0::2] & 0xF) | ((nib[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed_NK2: np.ndarray) -> np.ndarray:
    """``[N, K/2]`` bytes -> ``[N, K]`` nibbles."""
    p = np.asarray(packed_NK2, dtype=np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


def dequantize_unscaled(w: Nvfp4Weight) -> np.ndarray:
    """The fp32 ``[N, K]`` ``e2m1 * e4m3`` without ``scale_2``: exact in fp32, and in bf16 too (at most 6
    significant bits, within bf16's normal range)."""
    vals_NK = NIBBLE_TO_F32[unpack_nibbles(w.packed)]
    n, k = vals_NK.shape
    scaled = vals_NK.reshape(n, k // NVFP4_GROUP, NVFP4_GROUP) * w.scale.astype(np.float32)[:, :, None]
    return scaled.reshape(n, k)


def dequantize(w: Nvfp4Weight) -> np.ndarray:
    """The fp32 ``[N, K]`` weight: ``e2m1 * e4m3`` is exact in fp32, so the only rounding is the
    final multiply by ``scale_2``."""
    return dequantize_unscaled(w) * np.float32(w.scale_2)


def quantize(w_NK: np.ndarray) -> Nvfp4Weight:
    """ModelOpt's recipe: ``scale_2 = amax / (6 * 448)``, block scale ``block_amax / (6 * scale_2)``
    cast to E4M3, each value divided by its block's scale and rounded to E2M1 (nearest, ties even)."""
    w = np.asarray(w_NK, dtype=np.float32)
    n, k = w.shape
    if k % NVFP4_GROUP:
        raise ValueError(f"K = {k} is not a multiple of the NVFP4 group size {NVFP4_GROUP}")
    amax = float(np.max(np.abs(w))) if w.size else 0.0
    scale_2 = np.float32(amax / (E2M1_MAX * E4M3_MAX)) if amax > 0 else np.float32(1.0)
    blocks = w.reshape(n, k // NVFP4_GROUP, NVFP4_GROUP)
    block_amax = np.max(np.abs(blocks), axis=-1)
    scale = np.clip(block_amax / (E2M1_MAX * scale_2), 0.0, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    denom = scale.astype(np.float32)[:, :, None] * scale_2
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(denom > 0, blocks / denom, 0.0).astype(np.float32)
    nib = np.clip(q, -E2M1_MAX, E2M1_MAX).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    return Nvfp4Weight(pack_nibbles(nib.reshape(n, k)), scale, float(scale_2))

"""NVFP4 (ModelOpt) codec: packing against hand-made bytes, scales, zero blocks, round trip."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from glm_ep.checkpoint.nvfp4 import Nvfp4Weight, dequantize, pack_nibbles, quantize, unpack_nibbles

from helpers import e4m3_to_f64, nvfp4_to_f64

E4M3 = ml_dtypes.float8_e4m3fn
#: one 16-value block holding every E2M1 magnitude with both signs, and its hand-packed bytes
#: (nibble = sign bit 3 + index into [0, .5, 1, 1.5, 2, 3, 4, 6]; even k in the LOW nibble)
BLOCK = [0.5, -6, 1, 1.5, 2, 3, 4, 0, -0.5, -1, -1.5, -2, -3, -4, 6, 0]
BLOCK_BYTES = [0xF1, 0x32, 0x54, 0x06, 0xA9, 0xCB, 0xED, 0x07]


def _scales(*bits: int) -> np.ndarray:
    return np.array([bits], dtype=np.uint8).view(E4M3)


def test_pack_puts_even_k_in_the_low_nibble() -> None:
    assert pack_nibbles(np.array([[1, 15]])).tolist() == [[0xF1]]
    assert pack_nibbles(np.array([[15, 1, 0, 7]])).tolist() == [[0x1F, 0x70]]
    assert unpack_nibbles(np.array([[0xF1, 0x70]], dtype=np.uint8)).tolist() == [[1, 15, 0, 7]]
    with pytest.raises(ValueError, match="odd"):
        pack_nibbles(np.zeros((1, 3), dtype=np.uint8))


def test_quantize_packs_a_hand_block_into_hand_bytes() -> None:
    q = quantize(np.array([BLOCK], dtype=np.float32))
    assert q.packed.dtype == np.uint8 and q.packed.shape == (1, 8)
    assert q.packed[0].tolist() == BLOCK_BYTES
    # ModelOpt: scale_2 = amax / (6 * 448); block scale = block_amax / (6 * scale_2) = 448 -> 0x7E
    assert q.scale_2 == pytest.approx(6.0 / (6 * 448), rel=1e-7)
    assert q.scale.dtype == E4M3 and q.scale.view(np.uint8).tolist() == [[0x7E]]
    assert dequantize(q)[0].tolist() == pytest.approx(BLOCK, rel=1e-6)


def test_dequantize_applies_e4m3_scale_and_scale_2() -> None:
    # block 0: the hand block, scale 0x38 = 1.0; block 1: byte 0x72 (1.0 then 6.0), scale 0x40 = 2.0
    packed = np.array([BLOCK_BYTES + [0x72] * 8], dtype=np.uint8)
    w = Nvfp4Weight(packed, _scales(0x38, 0x40), 0.25)
    assert w.shape == (1, 32) and w.nbytes == 16 + 2 + 4
    expected = [v * 1.0 * 0.25 for v in BLOCK] + [1.0 * 2.0 * 0.25, 6.0 * 2.0 * 0.25] * 8
    out = dequantize(w)
    assert out.dtype == np.float32
    assert out[0].tolist() == expected  # exact: every product is exact in fp32


@pytest.mark.parametrize("bits,value", [(0x38, 1.0), (0x40, 2.0), (0x7E, 448.0), (0x01, 2.0 ** -9),
                                        (0x08, 2.0 ** -6), (0x3C, 1.5), (0xB8, -1.0), (0x37, 0.9375), (0x2F, 0.46875)])
def test_e4m3_block_scale_values(bits: int, value: float) -> None:
    w = Nvfp4Weight(np.array([[0x02] * 8], dtype=np.uint8), _scales(bits), 1.0)  # 1.0 at even k, 0 at odd
    out = dequantize(w)[0]
    assert out[0::2].tolist() == [value] * 8 and out[1::2].tolist() == [0.0] * 8
    assert e4m3_to_f64(np.array([bits]))[0] == value  # the test's own decoder agrees


def test_all_zero_block_and_all_zero_matrix() -> None:
    rng = np.random.default_rng(11)
    w = rng.standard_normal((4, 48)).astype(np.float32)
    w[1, 16:32] = 0.0  # one all-zero block in the middle of a row
    q = quantize(w)
    assert q.scale.astype(np.float32)[1, 1] == 0.0
    assert unpack_nibbles(q.packed)[1, 16:32].tolist() == [0] * 16
    dq = dequantize(q)
    assert np.isfinite(dq).all() and (dq[1, 16:32] == 0).all()
    z = quantize(np.zeros((3, 32), dtype=np.float32))
    assert not z.packed.any() and not z.scale.astype(np.float32).any()
    assert np.isfinite(z.scale_2) and z.scale_2 > 0
    assert (dequantize(z) == 0).all()


@pytest.mark.parametrize("seed,shape", [(0, (64, 128)), (1, (128, 64)), (2, (7, 16))])
def test_round_trip_within_nvfp4_error(seed: int, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 3.0, (shape[0], 1))).astype(np.float32)
    q = quantize(w)
    n, k = shape
    assert q.packed.shape == (n, k // 2) and q.scale.shape == (n, k // 16)
    assert q.scale_2 == pytest.approx(np.abs(w).max() / (6 * 448), rel=1e-6)
    dq = dequantize(q)
    # every value is an E2M1 grid point times its block's scale
    block = np.repeat(q.scale.astype(np.float64), 16, axis=1) * q.scale_2
    grid = np.abs(dq / np.where(block > 0, block, 1))
    assert np.isin(np.round(grid, 4), [0, 0.5, 1, 1.5, 2, 3, 4, 6]).all()
    # error per element: at most one scale unit (half the widest E2M1 step), with E4M3 scale rounding
    blocks = np.abs(w).reshape(n, k // 16, 16).max(-1)
    bound = np.repeat(blocks / 6 * (1 + 2 ** -3), 16, axis=1) + 1e-12
    assert (np.abs(dq - w) <= bound).all()
    rel = np.linalg.norm(dq - w) / np.linalg.norm(w)
    assert 0.02 < rel < 0.15, rel  # NVFP4 on Gaussian weights: about 1e-1, never lossless
    # the test's independent decoder reads the same values from the raw bytes
    # (fp32 dequantize rounds the scale product and the value: two fp32 roundings at most)
    np.testing.assert_allclose(dq, nvfp4_to_f64(q.packed, q.scale.view(np.uint8), q.scale_2), rtol=2.5e-7, atol=0)


def test_quantize_refuses_k_off_the_group() -> None:
    with pytest.raises(ValueError, match="multiple of the NVFP4 group"):
        quantize(np.ones((2, 24), dtype=np.float32))

"""Measurement on the device: does mma.sync take the placed form's operands exactly? Each of the 16
e2m1 codes, placed as bf16 (sign to bit 15, e1 e0 m to bits 8..6: e2m1 x 2^-126, 0.5 a bf16 subnormal)
or as fp16 (bits 11..9: e2m1 x 2^-14), one nonzero k per row of A, against x in B; every product must
come back bit for bit in the fp32 D (its sign as a value: -0 x x onto a +0 accumulator is +0). Prints one line per x and a chain of 16 subnormal products:

    python3 tools/mma_subnormal_probe.py
"""

from __future__ import annotations

import sys

import numpy as np

SRC = r'''
extern "C" __global__ void mma_probe(const unsigned* a, const unsigned* b, float* d, int f16) {
    const int lane = threadIdx.x;
    const unsigned a0 = a[lane * 4], a1 = a[lane * 4 + 1], a2 = a[lane * 4 + 2], a3 = a[lane * 4 + 3];
    const unsigned b0 = b[lane * 2], b1 = b[lane * 2 + 1];
    float c0 = 0, c1 = 0, c2 = 0, c3 = 0;
    if (f16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    d[lane * 4] = c0, d[lane * 4 + 1] = c1, d[lane * 4 + 2] = c2, d[lane * 4 + 3] = c3;
}
'''
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def mma(kernel, a16: np.ndarray, b16: np.ndarray, f16: bool) -> np.ndarray:
    """D = A (16 x 16) B (16 x 8) from 16-bit patterns, through the m16n8k16 fragment layout."""
    import cupy as cp

    a, b = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        pa = lambda r, c: int(a16[r, c]) | int(a16[r, c + 1]) << 16  # noqa: E731
        pb = lambda k, n: int(b16[k, n]) | int(b16[k + 1, n]) << 16  # noqa: E731
        a[lane] = [pa(g, 2 * t), pa(g + 8, 2 * t), pa(g, 2 * t + 8), pa(g + 8, 2 * t + 8)]
        b[lane] = [pb(2 * t, g), pb(2 * t + 8, g)]
    d = cp.zeros((32, 4), cp.float32)
    kernel((1,), (32,), (cp.asarray(a), cp.asarray(b), d, np.int32(f16)))
    d, out = d.get(), np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        out[g, 2 * t], out[g, 2 * t + 1], out[g + 8, 2 * t], out[g + 8, 2 * t + 1] = d[lane]
    return out


def bf16_bits(x: float) -> np.uint16:
    return np.uint16(np.array(x, np.float32).view(np.uint32) >> 16)


def main() -> int:
    import cupy as cp

    kernel = cp.RawKernel(SRC, "mma_probe")
    ok = True
    for f16, xs in ((False, (2.0 ** 100, 1.0, 2.0 ** -20, 3.0 * 2 ** 60)), (True, (1.0, 2.0 ** -10, 3.0, 1024.0))):
        for x in xs:
            a, b = np.zeros((16, 16), np.uint16), np.zeros((16, 8), np.uint16)
            for code in range(16):
                a[code, code] = (code >> 3) << 15 | (code & 7) << (9 if f16 else 6)
            b[:, 0] = np.array(np.float16(x)).view(np.uint16) if f16 else bf16_bits(x)
            want = (E2M1 * (2.0 ** -14 if f16 else 2.0 ** -126) * x).astype(np.float32)
            got = mma(kernel, a, b, f16)[:, 0]
            # magnitudes bit for bit, signs as values: -0 * x accumulated onto +0 is +0
            exact = (np.array_equal(got.view(np.uint32) & 0x7FFFFFFF, want.view(np.uint32) & 0x7FFFFFFF)
                     and np.array_equal(np.sign(got), np.sign(want)))
            ok &= exact
            print(f"{'fp16' if f16 else 'bf16'} placed codes x {x:g}: {'exact' if exact else 'MISMATCH'}")
    a = np.full((16, 16), 1 << 6, np.uint16)  # bf16 2^-127 everywhere
    b = np.zeros((16, 8), np.uint16)
    b[:, 0] = bf16_bits(2.0 ** 100)
    got, want = mma(kernel, a, b, False)[0, 0], 16 * 2.0 ** -27
    print(f"chain of 16 subnormal-operand products: {got!r} (want {want!r})")
    ok &= got == want
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

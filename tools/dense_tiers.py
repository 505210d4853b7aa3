"""Measurement: the 9..64-row bf16 tensor-core GEMM (mma_bf16.cu) against cuBLAS, per shape, graph-free
but kernel-bound (the same launch back to back): which rows and widths each should serve."""
import cupy as cp
import ml_dtypes
import numpy as np

from glm_ep.backend.cuda import dense as K
from glm_ep.backend.cuda.elementwise import swiglu
from glm_ep.bench.common import time_median

BF16 = ml_dtypes.bfloat16
s = cp.cuda.Stream(non_blocking=True)
s.use()


def rnd(shape):
    return cp.asarray((np.random.default_rng(0).standard_normal(shape) * 0.05).astype(BF16))


H = 4096
print("shape rows mma_us cublas_us")
for name, n, k, glu in (("dense_glu", 12288, H, True), ("dense_down", H, 12288, False),
                        ("shared_glu", 2048, H, True), ("shared_down", H, 2048, False)):
    wg, wu = rnd((n, k)), rnd((n, k))
    for rows in (9, 16, 24, 32, 40, 48, 56, 64):
        x = rnd((rows, k))
        g, u, a = (cp.empty((rows, n), dtype=BF16) for _ in range(3))
        if glu:
            mma = lambda: K.mma_glu_bf16(x, wg, wu, 7.0, g, u, a)
            def cub():
                K.gemm_bf16(x, wg, g); K.gemm_bf16(x, wu, u); swiglu(g, u, 7.0, a)
        else:
            mma = lambda: K.mma_gemm_bf16(x, wg, g)
            cub = lambda: K.gemm_bf16(x, wg, g)
        print(name, rows, round(time_median(cp, s, mma, 20), 1), round(time_median(cp, s, cub, 20), 1), flush=True)

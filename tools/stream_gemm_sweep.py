"""Measurement (run 5 of docs/perf/stream_gemm_runs.log): the streaming GEMM in small blocks (one or two warps, long
lines), several an SM, at fixed ring depths and K splits, against cuBLAS; medians in us and TB/s."""
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
partials, arrived = cp.empty(64 << 20, dtype=cp.float32), cp.zeros(1 << 16, dtype=cp.uint32)
for name, n, k, glu in (("dense_glu", 12288, 4096, True), ("dense_down", 4096, 12288, False)):
    wg, wu = rnd((n, k)), rnd((n, k))
    nbytes = (2 if glu else 1) * n * k * 2
    for rows in (8, 16, 32, 64):
        x = rnd((rows, k))
        g, u, a = (cp.empty((rows, n), dtype=BF16) for _ in range(3))
        runs = []
        for v in ((1, 256), (1, 128), (2, 256)):
            for slots in (2, 3):
                for ks in ((1, 2) if glu else (4, 8)):
                    runs.append((v, slots, ks))
        for v, slots, ks in runs:
            if glu:
                fn = lambda: K.stream_glu_bf16(x, wg, wu, 7.0, g, u, a, partials, arrived, ks, v, slots)
            else:
                fn = lambda: K.stream_gemm_bf16(x, wg, g, partials, arrived, ks, v, slots)
            grid, S = K.stream_geometry(n, k, glu, ks, v)
            us = time_median(cp, s, fn, 20)
            print(name, rows, f"w{v[0]}k{v[1]} slots={slots} S={S} grid={grid}", round(us, 1),
                  round(nbytes / us / 1e6, 2), flush=True)
        if glu:
            def cub():
                K.gemm_bf16(x, wg, g)
                K.gemm_bf16(x, wu, u)
                swiglu(g, u, 7.0, a)
        else:
            cub = lambda: K.gemm_bf16(x, wg, g)
        us = time_median(cp, s, cub, 20)
        print(name, rows, "cublas", round(us, 1), round(nbytes / us / 1e6, 2), flush=True)

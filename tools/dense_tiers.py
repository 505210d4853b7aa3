"""Measurement: the bf16 projections of 8..64 rows on each engine, per shape, graph-free but kernel-bound
(the same launch back to back): the batch-M GEMV (<= 8 rows), the tensor-core GEMM (mma_bf16.cu), the
streaming GEMM at its own K split and at fixed ones (``--ksplit``), and cuBLAS; medians in us, and the
weight bytes over the time in TB/s."""
import argparse

import cupy as cp
import ml_dtypes
import numpy as np

from glm_ep.backend.cuda import dense as K
from glm_ep.backend.cuda.elementwise import swiglu
from glm_ep.bench.common import time_median

BF16 = ml_dtypes.bfloat16
ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--rows", type=int, nargs="+", default=[8, 9, 16, 32, 48, 64])
ap.add_argument("--ksplit", type=int, nargs="*", default=[], help="fixed K splits of the streaming GEMM to add")
ap.add_argument("--variants", action="store_true", help="every streaming variant at its own K split")
ap.add_argument("--iters", type=int, default=20)
args = ap.parse_args()

s = cp.cuda.Stream(non_blocking=True)
s.use()


def rnd(shape):
    return cp.asarray((np.random.default_rng(0).standard_normal(shape) * 0.05).astype(BF16))


n_part, n_arr = K.stream_scratch_sizes()
widest = max([1, *args.ksplit]) * K.stream_geometry(12288, 4096, True, 1)[0]  # a fixed split may pass one wave
partials = cp.empty(max(n_part, widest * 2 * 8 * 4 * 8 * 32), dtype=cp.float32)
arrived = cp.zeros(max(n_arr, widest), dtype=cp.uint32)
H = 4096
streams = [(None, v) for v in (K.STREAM_VARIANTS if args.variants else K.STREAM_VARIANTS[:1])]
streams += [(ks, K.STREAM_VARIANTS[0]) for ks in args.ksplit]
print("shape rows engine us TB/s", flush=True)
for name, n, k, glu in (("dense_glu", 12288, H, True), ("dense_down", H, 12288, False),
                        ("shared_glu", 2048, H, True), ("shared_down", H, 2048, False)):
    wg, wu = rnd((n, k)), rnd((n, k))
    nbytes = (2 if glu else 1) * n * k * 2
    for rows in args.rows:
        x = rnd((rows, k))
        g, u, a = (cp.empty((rows, n), dtype=BF16) for _ in range(3))
        runs = {}
        if glu:
            if rows <= K.GEMV_MAX_ROWS:
                runs["gemv"] = lambda: K.glu_bf16(x, wg, wu, 7.0, g, u, a)
            runs["mma"] = lambda: K.mma_glu_bf16(x, wg, wu, 7.0, g, u, a)
            for ks, v in streams:
                runs[f"stream_w{v[0]}k{v[1]}_s{ks or K.stream_geometry(n, k, True, None, v)[1]}"] = (
                    lambda ks=ks, v=v: K.stream_glu_bf16(x, wg, wu, 7.0, g, u, a, partials, arrived, ks, v))

            def cub():
                K.gemm_bf16(x, wg, g); K.gemm_bf16(x, wu, u); swiglu(g, u, 7.0, a)
            runs["cublas"] = cub
        else:
            if rows <= K.GEMV_MAX_ROWS:
                runs["gemv"] = lambda: K.gemv_bf16(x, wg, g)
            runs["mma"] = lambda: K.mma_gemm_bf16(x, wg, g)
            for ks, v in streams:
                runs[f"stream_w{v[0]}k{v[1]}_s{ks or K.stream_geometry(n, k, False, None, v)[1]}"] = (
                    lambda ks=ks, v=v: K.stream_gemm_bf16(x, wg, g, partials, arrived, ks, v))
            runs["cublas"] = lambda: K.gemm_bf16(x, wg, g)
        for engine, fn in runs.items():
            us = time_median(cp, s, fn, args.iters)
            print(name, rows, engine, round(us, 1), round(nbytes / us / 1e6, 2), flush=True)

"""Measurement: the bf16 projections of 1..64 rows on each engine, per shape, graph-free but kernel-bound (the same
launch back to back): the batch-M GEMV (<= 8 rows), the warp-streaming GEMM (<= 16 rows), the tensor-core GEMM
(mma_bf16.cu, 9..64 rows) and cuBLAS
(gate, up, then the SwiGLU pass for the gate + up shapes; ``cublas_pair``: gate and up in one batched call); medians in us, and the weight bytes over the time in
TB/s: which rows and widths each should serve. ``--wstream-splits 4 6`` adds the warp-streaming GEMM at those
fixed K splits beside its own choice (``wstream_s4``, ``wstream_s6``)."""
import argparse

import cupy as cp
import ml_dtypes
import numpy as np

from glm_ep.backend.cuda import dense as K
from glm_ep.backend.cuda.elementwise import swiglu
from glm_ep.bench.common import time_median

BF16 = ml_dtypes.bfloat16
ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--rows", type=int, nargs="+", default=[9, 16, 24, 32, 40, 48, 56, 64])
ap.add_argument("--shapes", nargs="+", default=["dense_glu", "dense_down", "shared_glu", "shared_down"])
ap.add_argument("--wstream-splits", type=int, nargs="*", default=[],
                help="also time the warp-streaming GEMM at these fixed K splits")
args = ap.parse_args()
s = cp.cuda.Stream(non_blocking=True)
s.use()


def rnd(shape):
    return cp.asarray((np.random.default_rng(0).standard_normal(shape) * 0.05).astype(BF16))


H = 4096
SHAPES = {"dense_glu": (12288, H, True), "dense_down": (H, 12288, False), "shared_glu": (2048, H, True),
          "shared_down": (H, 2048, False)}
n_part, n_arr = K.wstream_scratch_sizes()
for name in args.shapes:  # a fixed split may pass what the device holds at once: scratch for its grid too
    n, k, glu = SHAPES[name]
    for ks in args.wstream_splits:
        need = K.wstream_scratch_need(K.wstream_geometry(n, k, glu, ks)[0], ks, K.WSTREAM_MAX_ROWS)
        n_part, n_arr = max(n_part, need[0]), max(n_arr, need[1])
partials, arrived = cp.empty(n_part, dtype=cp.float32), cp.zeros(n_arr, dtype=cp.uint32)
print("shape rows engine us TB/s", flush=True)
for name in args.shapes:
    n, k, glu = SHAPES[name]
    wg, wu = rnd((n, k)), rnd((n, k))
    w2 = rnd((2, n, k)) if glu else None  # gate and up stacked, as upload_dense keeps them
    nbytes = (2 if glu else 1) * n * k * 2
    for rows in args.rows:
        x = rnd((rows, k))
        g, u, a = (cp.empty((rows, n), dtype=BF16) for _ in range(3))
        runs = {}
        if glu:
            if rows <= K.GEMV_MAX_ROWS:
                runs["gemv"] = lambda: K.glu_bf16(x, wg, wu, 7.0, g, u, a)
            elif rows <= K.MMA_GEMM_MAX_ROWS:
                runs["mma"] = lambda: K.mma_glu_bf16(x, wg, wu, 7.0, g, u, a)
            if rows <= K.WSTREAM_MAX_ROWS:
                runs["wstream"] = lambda: K.wstream_glu_bf16(x, wg, wu, 7.0, g, u, a, partials, arrived)
                for ks in args.wstream_splits:
                    runs[f"wstream_s{ks}"] = lambda ks=ks: K.wstream_glu_bf16(x, wg, wu, 7.0, g, u, a, partials,
                                                                            arrived, ks)

            def cub():
                K.gemm_bf16(x, wg, g)
                K.gemm_bf16(x, wu, u)
                swiglu(g, u, 7.0, a)
            runs["cublas"] = cub
            gu = cp.empty((2, rows, n), dtype=BF16)

            def cub_pair():  # gate and up in one strided-batched call (stacked weights, adjacent outputs)
                K.gemm_bf16_pair(x, w2[0], w2[1], gu[0], gu[1])
                swiglu(gu[0], gu[1], 7.0, a)
            runs["cublas_pair"] = cub_pair
        else:
            if rows <= K.GEMV_MAX_ROWS:
                runs["gemv"] = lambda: K.gemv_bf16(x, wg, g)
            elif rows <= K.MMA_GEMM_MAX_ROWS:
                runs["mma"] = lambda: K.mma_gemm_bf16(x, wg, g)
            if rows <= K.WSTREAM_MAX_ROWS:
                runs["wstream"] = lambda: K.wstream_gemm_bf16(x, wg, g, partials, arrived)
                for ks in args.wstream_splits:
                    runs[f"wstream_s{ks}"] = lambda ks=ks: K.wstream_gemm_bf16(x, wg, g, partials, arrived, ks)
            runs["cublas"] = lambda: K.gemm_bf16(x, wg, g)
        for engine, fn in runs.items():
            us = time_median(cp, s, fn, 20)
            print(name, rows, engine, round(us, 1), round(nbytes / us / 1e6, 2), flush=True)

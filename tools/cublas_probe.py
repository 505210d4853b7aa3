"""Measurement: the bf16 projections of the wide paths (``dense.gemm_bf16``: ONE cuBLAS GemmEx on CuPy's handle)
against ``torch.nn.functional.linear`` (cuBLASLt, torch's workspace) on the same shapes, and gate + up as one GEMM
over the two weights stacked ([2I, H]) against two.

    python tools/cublas_probe.py [--rows 64 128 256 1024 4096]

Shapes (GLM-5.3-Flash): the shared expert's gate [2048, 4096] and down [4096, 2048], the dense FFN's gate [12288,
4096] and down [4096, 12288]. Device time of back-to-back calls (CUDA events), medians; no host work in the loop
beyond the call itself.
"""

from __future__ import annotations

import argparse


def main() -> int:
    import cupy as cp
    import torch

    from glm_ep.backend.cuda import CudaBackend, dense
    from glm_ep.bench.common import BF16, gpu_bf16, time_median, torch_time_us

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 1024, 4096])
    args = ap.parse_args()
    be = CudaBackend(0)
    s = be.stream
    shapes = {"shared gate": (2048, 4096), "shared gate+up stacked": (4096, 4096), "shared down": (4096, 2048),
              "dense gate": (12288, 4096), "dense gate+up stacked": (24576, 4096), "dense down": (4096, 12288)}
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: us, glm_ep gemm_bf16 / torch F.linear")
    print("rows | " + " | ".join(shapes))
    for rows in args.rows:
        cells = []
        for name, (n, k) in shapes.items():
            x, w, out = gpu_bf16(cp, (rows, k), 1.0), gpu_bf16(cp, (n, k), k ** -0.5), cp.empty((rows, n), BF16)
            iters = max(3, min(50, 16384 // rows))
            with s:
                ours = time_median(cp, s, lambda: dense.gemm_bf16(x, w, out), iters, warmup=3, repeats=5)
            tx, tw = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), \
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            theirs = torch_time_us(lambda: torch.nn.functional.linear(tx, tw), iters)
            cells.append(f"{ours:.1f} / {theirs:.1f}")
            if "stacked" in name:  # gate + up as one strided-batched call on separate allocations
                half = n // 2
                w0, w1 = gpu_bf16(cp, (half, k), k ** -0.5), gpu_bf16(cp, (half, k), k ** -0.5)
                o0, o1 = cp.empty((rows, half), BF16), cp.empty((rows, half), BF16)
                if w1.data.ptr < w0.data.ptr:
                    w0, w1 = w1, w0
                if o1.data.ptr < o0.data.ptr:
                    o0, o1 = o1, o0
                with s:
                    pair = time_median(cp, s, lambda: dense.gemm_bf16_pair(x, w0, w1, o0, o1), iters, warmup=3,
                                       repeats=5)
                cells[-1] += f" (batched pair {pair:.1f})"
        print(f"{rows} | " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

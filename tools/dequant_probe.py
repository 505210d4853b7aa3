"""Measurement: a dense FFN stored NVFP4 (GLM-5.3-Flash's 12288 x 4096) on the ``dequant`` path, its projections
dequantized to bf16 for cuBLAS whole or in chunks of weight rows that stay in L2 (``grouped.DEQUANT_CHUNK_BYTES``),
against the bf16 dense site (the same cuBLAS GEMMs on bf16 weights: the path's floor) and the grouped GEMM.

    python tools/dequant_probe.py [--rows 256 512 1024 2048 4096] [--chunk-mb 0 8 16 24 32]

Per width: the site eager (as ``bench --prefill`` times it) at each chunk size (0: whole projections), the
bf16 dense site and the grouped-GEMM path. What the chunks save is the bf16 weights' trip to HBM and back.
"""

from __future__ import annotations

import argparse
from dataclasses import replace


def main() -> int:
    import cupy as cp

    from glm_ep.backend.cuda import CudaBackend
    from glm_ep.backend.cuda import grouped as G
    from glm_ep.bench.common import (BF16, copy_bandwidth, glm_model, gpu_bf16, gpu_dense, gpu_nvfp4_site, time_median,
                                     world1_cfg)
    from glm_ep.comm import SelfComm
    from glm_ep.experts import ExpertDispatch
    from glm_ep.site import DenseSite
    from glm_ep.topology import PathLevers
    from glm_ep.workspace import Workspace

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--chunk-mb", type=int, nargs="+", default=[0, 8, 16, 24, 32])
    args = ap.parse_args()
    model = glm_model()
    cfg = world1_cfg(model)
    be = CudaBackend(0)
    s = be.stream
    h = model.hidden_size
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, copy {copy_bandwidth(cp, s):.0f} GB/s")
    with s:
        site = gpu_nvfp4_site(be, SelfComm(), cfg, model, PathLevers(nvfp4_dense_dequant_min_rows=9))
        bf16 = DenseSite(be, SelfComm(), cfg, be.upload_dense(gpu_dense(cp, model.intermediate_size, h)))
    gemm = replace(site, nvfp4=ExpertDispatch(be, cfg.dense_as_expert(), PathLevers(nvfp4_dense_dequant_min_rows=0)))
    max_rows = max(args.rows)
    ws = Workspace(cp, cfg, max_rows)
    out = cp.empty((max_rows, h), dtype=BF16)
    G.DEQUANT_CHUNK_MIN_ROWS = 1
    print("rows | " + " | ".join(f"chunks {mb} MB" if mb else "whole" for mb in args.chunk_mb)
          + " | bf16 dense site | grouped GEMM   (us, eager site calls)")
    for rows in args.rows:
        x, o = gpu_bf16(cp, (rows, h), 1.0), out[:rows]
        iters = max(3, min(20, 8192 // rows))
        cells = []
        for mb in args.chunk_mb:
            G.DEQUANT_CHUNK_BYTES = mb << 20
            cells.append(time_median(cp, s, lambda: site(x, ws, o), iters, warmup=3, repeats=5))
        cells.append(time_median(cp, s, lambda: bf16(x, ws, o), iters, warmup=3, repeats=5))
        cells.append(time_median(cp, s, lambda: gemm(x, ws, o), iters, warmup=3, repeats=5))
        print(f"{rows} | " + " | ".join(f"{c:.1f}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Measurement: the routed-expert GEMMs of one width and one grouped-GEMM variant, launched a few
times each at the GLM-5.3-Flash shape (synthetic weights, one site's routing), for a profiler to
pick up one launch of each projection:

    ncu --clock-control none --kernel-name regex:nvfp4_gemm_sorted_glu --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 tools/gemm_profile.py 128,1,4,64,4,wgmma

The variant is a ``GEMM_VARIANTS`` tuple written with commas (``--rows``: the width, 4096 by default).
Without a profiler it prints the median time of each projection.
"""

from __future__ import annotations

import argparse


def main() -> int:
    import cupy as cp

    from glm_ep.backend.cuda import CudaBackend
    from glm_ep.backend.cuda import grouped as NV
    from glm_ep.bench.common import bench_workspace, glm_model, gpu_bf16, gpu_moe, time_median, world1_cfg
    from glm_ep.dist.comm import SelfComm
    from glm_ep.mlp.dispatch import ExpertDispatch
    from glm_ep.mlp.site import MoeSite
    from glm_ep.config.topology import PathLevers

    ap = argparse.ArgumentParser()
    ap.add_argument("variant", help="a GEMM_VARIANTS tuple, e.g. 128,1,4,64,4,wgmma")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--launches", type=int, default=3)
    args = ap.parse_args()
    variant = tuple(int(a) if a.isdigit() else a for a in args.variant.split(","))
    geo = NV.GemmGeometry.of(variant)  # a clear error for a variant gemm_nvfp4.cu does not build

    model = glm_model()
    cfg = world1_cfg(model)
    be = CudaBackend(0)
    stream = be.stream
    rows, h, m, k, e = (args.rows, model.hidden_size, model.moe_intermediate_size, model.num_experts_per_tok,
                        model.n_routed_experts)
    with stream:
        moe = be.upload_moe(gpu_moe(cp, model), model.swiglu_limit)
    ws = bench_workspace(be, cfg, rows)
    site = MoeSite(be, SelfComm(), cfg, moe, ExpertDispatch.routed(be, cfg, PathLevers()))
    x = gpu_bf16(cp, (rows, h), 1.0)
    stream.synchronize()
    ids = site.route(x, ws).ids_TK
    s = rows * k
    tok, eid = ws.view("sorted_token_ids", s), ws.view("sorted_expert_ids", s)
    offsets = ws.view("expert_offsets", e + 1)
    be.sort_by_expert(ids, e, tok, eid, offsets, ws.view("token_to_perm", rows, k))
    act, out = ws.view("a_act", s, m), ws.view("expert_out", s, h)

    def glu() -> None:
        with stream:
            NV.nvfp4_gemm_sorted_glu(x, tok, offsets, e, moe.experts, cfg.swiglu_limit, act, variant=variant)

    def down() -> None:
        with stream:
            NV.nvfp4_gemm_sorted(act, False, tok, offsets, e, moe.experts.down, out, variant=variant)

    for fn in (glu, down):
        for _ in range(args.launches):
            fn()
    stream.synchronize()
    t_glu, t_down = (time_median(cp, stream, fn, iters=3, warmup=1, repeats=5) for fn in (glu, down))
    flops = 6 * s * m * h
    print(f"{geo.suffix}, {rows} rows: gate+up+SwiGLU {t_glu:.1f} us, down {t_down:.1f} us, "
          f"{flops / ((t_glu + t_down) * 1e-6) / 1e12:.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

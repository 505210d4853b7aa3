"""Measurement: the grouped GEMM's K split on a dense FFN stored NVFP4 (ONE expert that every row chooses,
GLM-5.3-Flash's 12288 x 4096), launch by launch. For each width: gate + up + SwiGLU and the down projection
at 1 (no split) .. 16 splits, each as a captured CUDA graph of 10 calls (device time only; a split's reduce
launch included); then the whole site eager (as ``bench --prefill`` times it), as a graph, and its host
time per eager call, on the default levers and with ``prefill_k_split = false``.

    python tools/ksplit_probe.py [--rows 9 16 24 64] [--splits 1 2 3 4 6 8 12 16] [--variants] [--profile]
                                 [--one-row]

``--variants``: every grouped-GEMM variant that runs here at each width and split count, not only the default.
``--one-row``: instead, the one-row launches of that FFN (gate + up + SwiGLU, down) on the decode ring, as
shipped (``ring_min_items_per_sm``) and on the block kernels, graph-replayed.

``--profile``: instead, the Python profile (cProfile, by own time) of 200 eager site calls at the first width.

Device time >> bytes / copy bandwidth at every split says the engine's per-block rate is the limit;
eager >> graph says the site is bound by its host work.
"""

from __future__ import annotations

import argparse
from dataclasses import replace


def main() -> int:
    import cupy as cp

    from glm_ep.backend.cuda import CudaBackend
    from glm_ep.backend.cuda import grouped as G
    from glm_ep.bench.common import (BF16, bench_workspace, copy_bandwidth, eager_host_us, glm_model, gpu_bf16,
                                     gpu_nvfp4_site, time_median, world1_cfg)
    from glm_ep.dist.comm import SelfComm
    from glm_ep.mlp.dispatch import ExpertDispatch
    from glm_ep.app.footprint import nvfp4_bytes
    from glm_ep.config.topology import PathLevers

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[9, 16, 24, 64])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--one-row", action="store_true")
    args = ap.parse_args()
    model = glm_model()
    cfg = world1_cfg(model)
    be = CudaBackend(0)
    s = be.stream
    h, width, limit = model.hidden_size, model.intermediate_size, model.swiglu_limit
    gbs = copy_bandwidth(cp, s)
    with s:
        site = gpu_nvfp4_site(be, SelfComm(), cfg, model, PathLevers())
    nosplit = replace(site, dispatch=ExpertDispatch.nvfp4_dense(be, cfg, PathLevers(prefill_k_split=False)))
    mlp, max_rows = site.mlp, max(args.rows)
    ws = bench_workspace(be, cfg, max(max_rows, 256))  # the prefill bench's workspace
    scratch = cp.empty(16 * 2 * max_rows * width, dtype=cp.float32)
    out = cp.empty((max_rows, h), dtype=BF16)
    act = cp.empty((max_rows, width), dtype=BF16)
    glu_bytes, down_bytes = 2 * nvfp4_bytes(width, h), nvfp4_bytes(h, width)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, copy {gbs:.0f} GB/s; floors: gate + up "
          f"{glu_bytes / gbs / 1e3:.1f} us, down {down_bytes / gbs / 1e3:.1f} us", flush=True)

    if args.profile:
        import cProfile
        import pstats

        x, o = gpu_bf16(cp, (args.rows[0], h), 1.0), out[:args.rows[0]]
        for _ in range(5):
            site(x, ws, o)
        s.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            site(x, ws, o)
        prof.disable()
        s.synchronize()
        print(f"===== NVFP4 dense site, {args.rows[0]} rows, 200 calls", flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return 0

    def graph_us(fn, calls: int = 10) -> float:
        replay = be.capture(lambda: [fn() for _ in range(calls)])
        return time_median(cp, s, replay, iters=3, warmup=2, repeats=5) / calls

    if args.one_row:
        from glm_ep.backend.cuda import routed as NV

        x1, ids = gpu_bf16(cp, (1, h), 1.0), cp.zeros(1, dtype=cp.int32)
        g, u, a1 = (cp.empty((1, width), dtype=BF16) for _ in range(3))
        o1 = out[:1]
        print("one row: launch glu_us down_us", flush=True)
        for name, ring in (("ring, every launch", replace(be.ring, min_items_per_sm=0)), ("as shipped", be.ring),
                           ("block kernels", replace(be.ring, enabled=False))):
            glu = graph_us(lambda: NV.nvfp4_moe_glu(x1, mlp, ids, limit, g, u, a1, ring))
            down = graph_us(lambda: NV.nvfp4_moe_gemv(a1, True, mlp.down, ids, o1, ring))
            print(f"{name}: {glu:.1f} {down:.1f}", flush=True)
        return 0

    print("rows variant splits glu_us down_us", flush=True)
    for rows in args.rows:
        x = gpu_bf16(cp, (rows, h), 1.0)
        a, o = act[:rows], out[:rows]
        default = G.gemm_variant(rows, 1, h, G.wgmma_here())
        for v in [w for w in G.GEMM_VARIANTS if G.runs_here(w)] if args.variants else [default]:
            geo = G.GemmGeometry.of(v)
            for n in args.splits:
                if n > h // geo.bk:
                    continue
                glu = graph_us(lambda: G.nvfp4_gemm_sorted_glu(x, None, None, 1, mlp, limit, a, variant=v,
                                                               scratch=scratch, splits=n))
                down = graph_us(lambda: G.nvfp4_gemm_sorted(a, False, None, None, 1, mlp.down, o, variant=v,
                                                            scratch=scratch, splits=n))
                print(f"{rows} {geo.suffix}{' (default)' if v == default else ''} {n} {glu:.1f} {down:.1f}",
                      flush=True)
    print("rows levers eager_us graph_us host_us_per_call", flush=True)
    for rows in args.rows:
        x = gpu_bf16(cp, (rows, h), 1.0)
        o = out[:rows]
        for name, st in (("default", site), ("no K split", nosplit)):
            def fn(st=st):
                st(x, ws, o)

            eager, host = eager_host_us(cp, s, fn)
            print(f"{rows} {name!r} {eager:.1f} {graph_us(fn, 5):.1f} {host:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

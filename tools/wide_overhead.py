"""Measurement: where the time of a wide (9..256-row) call goes. For each width, the sparse site,
the dense site, the shared expert and the router are timed as the prefill bench times them (eager,
back to back) and as one captured CUDA graph of the same calls (device time only), next to the host
time of one eager call; then cuBLAS GemmEx's algorithms on the dense FFN's gate shape.

    python tools/wide_overhead.py [--rows 16 64 256] [--profile]

``--profile``: instead, the Python profile (cProfile, by own time) of 200 eager calls of each at
the first width.

Eager >> graph says the call is host-bound (Python and launch overhead); eager ~ graph says the
kernels themselves are the cost.
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> int:
    import cupy as cp

    from glm_ep.backend.cuda import CudaBackend
    from glm_ep.backend.cuda import dense as D
    from glm_ep.bench.common import (BF16, bench_workspace, eager_host_us, glm_model, gpu_bf16, gpu_dense, gpu_moe,
                                     time_median, world1_cfg)
    from glm_ep.dist.comm import SelfComm
    from glm_ep.mlp.dispatch import ExpertDispatch
    from glm_ep.mlp.site import DenseSite, MoeSite, clamped_swiglu_mlp
    from glm_ep.config.topology import PathLevers

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    model = glm_model()
    cfg = world1_cfg(model)
    be = CudaBackend(0)
    s = be.stream
    with s:
        moe = be.upload_moe(gpu_moe(cp, model), model.swiglu_limit)
        dense = be.upload_dense(gpu_dense(cp, model.intermediate_size, model.hidden_size))
    max_rows = max(args.rows)
    ws = bench_workspace(be, cfg, max_rows)
    out = cp.empty((max_rows, model.hidden_size), dtype=BF16)
    comm = SelfComm()
    sparse = MoeSite(be, comm, cfg, moe, ExpertDispatch.routed(be, cfg, PathLevers()))
    dense_site = DenseSite(be, comm, cfg, dense)
    def router(x):  # the router alone (the site's route stage may run the shared gate/up beside it)
        t, e, k = x.shape[0], model.n_routed_experts, model.num_experts_per_tok
        be.route(x, moe.router, moe.bias, sparse.route_params, ws.view("logits", t, e), ws.view("ids", t, k),
                 ws.view("wts", t, k))

    if args.profile:
        import cProfile
        import pstats

        x, o = gpu_bf16(cp, (args.rows[0], model.hidden_size), 1.0), out[:args.rows[0]]
        for name, fn in (("router", lambda: router(x)), ("dense site", lambda: dense_site(x, ws, o)),
                         ("shared expert", lambda: clamped_swiglu_mlp(be, moe.shared, cfg.swiglu_limit, x, ws, o))):
            for _ in range(5):
                fn()
            s.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            s.synchronize()
            print(f"===== {name}, {args.rows[0]} rows, 200 calls", flush=True)
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        return 0
    print("what rows eager_us graph_us host_us_per_call", flush=True)
    for rows in args.rows:
        x = gpu_bf16(cp, (rows, model.hidden_size), 1.0)
        o = out[:rows]
        calls = {"sparse site": lambda: sparse(x, ws, o),
                 "dense site": lambda: dense_site(x, ws, o),
                 "shared expert": lambda: clamped_swiglu_mlp(be, moe.shared, cfg.swiglu_limit, x, ws, o),
                 "router": lambda: router(x)}
        for name, fn in calls.items():
            eager, host = eager_host_us(cp, s, fn)
            try:
                graph = be.capture(fn)
                gt = time_median(cp, s, graph, iters=20, warmup=3, repeats=5)
            except Exception as e:  # a path that cannot be captured
                gt = float("nan")
                print(f"  ({name}, {rows} rows: no graph: {type(e).__name__}: {e})")
            print(f"{name} {rows} {eager:.1f} {gt:.1f} {host:.1f}", flush=True)

    # cuBLAS GemmEx algorithms on the dense gate shape [12288, 4096]
    cb = D._cublas()
    handle = cp.cuda.device.get_cublas_handle()
    n, k = model.intermediate_size, model.hidden_size
    w = dense.gate
    print("cublas rows algo us", flush=True)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    for rows in args.rows:
        xx = gpu_bf16(cp, (rows, k), 1.0)
        oo = cp.empty((rows, n), dtype=BF16)
        res = []
        for algo in [-1, 99] + list(range(0, 24)) + list(range(100, 116)):
            def g(algo=algo):
                cb.setStream(handle, s.ptr)
                cb.gemmEx(handle, cb.CUBLAS_OP_T, cb.CUBLAS_OP_N, n, rows, k, one.ctypes.data, w.data.ptr, 14, k,
                          xx.data.ptr, 14, k, zero.ctypes.data, oo.data.ptr, 14, n, cb.CUBLAS_COMPUTE_32F, algo)
            try:
                with s:
                    res.append((time_median(cp, s, g, iters=20, warmup=2, repeats=3), algo))
            except Exception:
                pass
        res.sort()
        dflt = next(t for t, a in res if a == -1)
        print(f"cublas {rows} default {dflt:.1f} best " + ", ".join(f"{a}:{t:.1f}" for t, a in res[:4]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Lab: the sparse site's route stage (router + top-k + shared gate + up) at wide widths, op by op, one call's GPU
time each (bench.common.time_gpu_us, L2 flushed), as the stage table times it; plus the router's logits on cuBLAS."""
from __future__ import annotations

import functools
import sys

import cupy as cp

from glm_ep.backend.cuda import dense as D
from glm_ep.backend.cuda import elementwise as EW
from glm_ep.bench.common import (bench_backend, bench_workspace, glm_model, gpu_bf16, gpu_moe, time_gpu_us, time_median,
                                 world1_cfg)
from glm_ep.bench.stages import OpRecorder
from glm_ep.config.topology import PathLevers, Topology
from glm_ep.dist.comm import SelfComm
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.mlp.site import MoeSite

lv = Topology.load(sys.argv[1]).levers if len(sys.argv) > 1 else PathLevers()
model, rows_list = glm_model(), (9, 16, 24, 32, 48, 64, 128, 256, 1024)
cfg = world1_cfg(model)
be = bench_backend(lv, max(rows_list))
stream = be.stream
with stream:
    moe = be.upload_moe(gpu_moe(cp, model), model.swiglu_limit)
ws = bench_workspace(be, cfg, max(rows_list))
rec = OpRecorder(be)
site = MoeSite(rec, SelfComm(), cfg, moe, ExpertDispatch.routed(rec, cfg, lv))
one = functools.partial(time_gpu_us, cp, stream)
def eager(fn):
    with stream:
        return time_median(cp, stream, fn, 20)
print("GPU time (L2 flushed, host held out), then eager back to back [brackets]")
print("rows | route stage (as recorded) | router logits (as chosen) | logits on cuBLAS | top-k | shared gate+up+act "
      "(as chosen) | shared gate+up on cuBLAS's pair + SwiGLU | beside")
for rows in rows_list:
    cp.random.seed(rows)
    x = gpu_bf16(cp, (rows, model.hidden_size), 1.0)
    o = cp.empty((rows, model.hidden_size), dtype=x.dtype)
    ops = rec.record(lambda: site(x, ws, o))
    route = next(op for op in ops if op.name == "route")
    xa, router, bias, p, logits, ids, wts, *rest = route.args
    beside = rest[0] if rest else route.kwargs.get("beside")
    lg = lambda: be.router_logits(xa, router, logits)
    def lc():
        with stream:
            D.gemm_bf16(xa, router, logits)
    r = {"stage": one(route), "logits": one(lg), "cublas": one(lc), "topk": one(lambda: be.router_topk(logits, bias, p, ids, wts))}
    e = {"logits": eager(lg), "cublas": eager(lc)}
    if beside is not None:
        w = beside.w
        gc = lambda: be.gate_up_act(xa, w, beside.limit, beside.gate_TI, beside.up_TI, beside.act_TI)
        def pair():
            with stream:
                D.gemm_bf16_pair(xa, w.gate, w.up, beside.gate_TI, beside.up_TI)
                EW.swiglu(beside.gate_TI, beside.up_TI, beside.limit, beside.act_TI)
        r["glu"], r["pair"], e["glu"], e["pair"] = one(gc), one(pair), eager(gc), eager(pair)
    c = lambda key: f"{r.get(key, float('nan')):.1f} [{e.get(key, float('nan')):.1f}]"
    print(f"{rows} | {r['stage']:.1f} | {c('logits')} | {c('cublas')} | {r['topk']:.1f} | {c('glu')} | {c('pair')} | "
          f"{beside is not None}", flush=True)

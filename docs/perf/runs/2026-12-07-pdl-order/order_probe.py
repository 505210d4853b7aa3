"""Does the stage table's plain-launch column measure plain launches, or its place in the run? The sparse site at
64 / 256 / 448 rows on the card's levers (pdl_sorted as the tree has it), one call's GPU time (bench.common.time_gpu_us,
as the stage table times it) in this order:
  after a sustained run of back-to-back calls (as the bench's site column): programmatic (as built), plain (be.pdl off)
  after 3 s of an idle GPU:                                                   plain, then programmatic
  after another sustained run:                                                programmatic, plain
with the SM clock and power that nvidia-smi reads at each point.
python docs/perf/runs/2026-12-07-pdl-order/order_probe.py [pdl_sorted]  (the argument, on trees 108c7c7..96c8abb only: the
sorted path's launches programmatic; since 0bf9a13 they are without it)"""
import subprocess
import sys
import time

import cupy as cp

from glm_ep.bench.common import (BF16, bench_backend, bench_workspace, glm_model, gpu_bf16, gpu_moe, plain_launches,
                                 time_gpu_us, time_median, world1_cfg)
from glm_ep.config.topology import PathLevers
from glm_ep.dist.comm import SelfComm
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.mlp.site import MoeSite


def smi() -> str:
    q = "clocks.sm,power.draw,temperature.gpu"
    return subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.strip()


model = glm_model()
cfg = world1_cfg(model)
levers = PathLevers(prefill_gemm_min_rows=9, **({"pdl_sorted": True} if "pdl_sorted" in sys.argv[1:] else {}))
be = bench_backend(levers, 448)
cp.random.seed(0)
with be.stream:
    moe = be.upload_moe(gpu_moe(cp, model), model.swiglu_limit)
ws = bench_workspace(be, cfg, 448)
out = cp.empty((448, model.hidden_size), dtype=BF16)
site = MoeSite(be, SelfComm(), cfg, moe, ExpertDispatch.routed(be, cfg, levers))
print("pdl", be.pdl, "pdl_sorted", getattr(levers, "pdl_sorted", None), flush=True)
for rows in (64, 256, 448):
    cp.random.seed(rows)
    x = gpu_bf16(cp, (rows, model.hidden_size), 1.0)
    o = out[:rows]
    call = lambda: site(x, ws, o)
    one = lambda: time_gpu_us(cp, be.stream, call)
    plain = lambda: plain_launches(be, one)
    sustained = lambda: time_median(cp, be.stream, call, iters=max(2, min(40, 8192 // rows)), warmup=2, repeats=5)
    r = {"rows": rows, "sustained_us": round(sustained(), 1), "smi_after_sustained": smi()}
    r["a_prog"], r["a_plain"] = round(one(), 1), round(plain(), 1)
    be.stream.synchronize()
    time.sleep(3)
    r["smi_after_idle"] = smi()
    r["b_plain"], r["b_prog"] = round(plain(), 1), round(one(), 1)
    r["sustained2_us"] = round(sustained(), 1)
    r["c_prog"], r["c_plain"] = round(one(), 1), round(plain(), 1)
    r["smi_end"] = smi()
    print(r, flush=True)

"""The sparse site at ROWS rows, called 4 times on the card's default levers (grouped GEMM from 9 rows), for ncu to
profile every launch of it: python docs/perf/queue/route-ncu/site_probe.py ROWS"""
import sys

import cupy as cp

from glm_ep.bench.common import (BF16, bench_backend, bench_workspace, glm_model, gpu_bf16, gpu_moe, world1_cfg)
from glm_ep.config.topology import PathLevers
from glm_ep.dist.comm import SelfComm
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.mlp.site import MoeSite

rows = int(sys.argv[1])
model = glm_model()
cfg = world1_cfg(model)
levers = PathLevers(prefill_gemm_min_rows=9)
be = bench_backend(levers, rows)
cp.random.seed(0)
with be.stream:
    moe = be.upload_moe(gpu_moe(cp, model), model.swiglu_limit)
ws = bench_workspace(be, cfg, rows)
out = cp.empty((rows, model.hidden_size), dtype=BF16)
site = MoeSite(be, SelfComm(), cfg, moe, ExpertDispatch.routed(be, cfg, levers))
cp.random.seed(rows)
x = gpu_bf16(cp, (rows, model.hidden_size), 1.0)
with be.stream:
    for _ in range(4):
        site(x, ws, out)
be.stream.synchronize()
print("ran", rows, "rows, path", site.experts.path_for(rows) if hasattr(site.experts, "path_for") else "?")

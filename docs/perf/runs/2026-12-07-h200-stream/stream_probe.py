"""Lab: the streaming grouped-GEMM variants (weights straight into registers) against the shipped narrow tiles, on
the sparse site's own routing at 16..256 rows: gate + up + SwiGLU and down, one call's GPU time each
(time_gpu_us, L2 flushed), the routed bytes over it as % of copy; outputs against the default variant's."""
from __future__ import annotations

import sys

import cupy as cp
import numpy as np

from glm_ep.backend.cuda import grouped as NV
from glm_ep.bench.common import (bench_backend, bench_workspace, copy_bandwidth, glm_model, gpu_bf16, gpu_moe,
                                 time_gpu_us, world1_cfg)
from glm_ep.config.topology import PathLevers, Topology
from glm_ep.dist.comm import SelfComm
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.mlp.site import MoeSite

lv = Topology.load(sys.argv[1]).levers if len(sys.argv) > 1 else PathLevers()
rows_list = tuple(int(a) for a in sys.argv[2:]) or (16, 64, 128, 256)
model = glm_model()
cfg = world1_cfg(model)
be = bench_backend(lv, max(rows_list))
stream = be.stream
with stream:
    moe = be.upload_moe(gpu_moe(cp, model), model.swiglu_limit)
ws = bench_workspace(be, cfg, max(rows_list))
site = MoeSite(be, SelfComm(), cfg, moe, ExpertDispatch.routed(be, cfg, lv))
copy = copy_bandwidth(cp, stream)
print(f"copy {copy:.0f} GB/s")
h, m, k, E = model.hidden_size, model.moe_intermediate_size, model.num_experts_per_tok, model.n_routed_experts
names = ["m16w4k128p", "m16w4k128n", "m8w4d4s", "m8w4d4sp", "m8w8d3sp", "m16w8d3s", "m32w4d3sp", "m64w4k64n"]
by = {NV.GemmGeometry.of(v).suffix: v for v in NV.GEMM_VARIANTS}
print("rows | experts | variant: glu us (% copy) / down us (% copy) / rel err act, routed")
for rows in rows_list:
    cp.random.seed(rows)
    x = gpu_bf16(cp, (rows, h), 1.0)
    ids = site.route(x, ws).ids_TK
    s = rows * k
    tok, eid, offsets = ws.view("sorted_token_ids", s), ws.view("sorted_expert_ids", s), ws.view("expert_offsets", E + 1)
    perm = ws.view("token_to_perm", rows, k)
    act, routed = ws.view("a_act", s, m), ws.view("expert_out", s, h)
    be.sort_by_expert(ids, E, tok, eid, offsets, perm)
    stream.synchronize()
    n_exp = len(np.unique(cp.asnumpy(ids)))
    glu_bytes, down_bytes = n_exp * 2 * m * h * 0.5625, n_exp * m * h * 0.5625
    ref = None
    cells = []
    for name in names:
        v = by[name]
        glu = lambda: NV.nvfp4_gemm_sorted_glu(x, tok, offsets, E, moe.experts, cfg.swiglu_limit, act, variant=v)
        down = lambda: NV.nvfp4_gemm_sorted(act, False, tok, offsets, E, moe.experts.down, routed, variant=v)
        with stream:
            glu(); a = act.astype(cp.float32).copy()
            down(); o = routed.astype(cp.float32).copy()
        if ref is None:
            ref = (a, o)
        err = [float(cp.linalg.norm(p - q) / cp.linalg.norm(q)) for p, q in zip((a, o), ref)]
        with stream:
            tg = time_gpu_us(cp, stream, glu)
            td = time_gpu_us(cp, stream, down)
        cells.append(f"{name}: {tg:.1f} ({100 * glu_bytes / tg / 1e3 / copy:.0f}%) / {td:.1f} "
                     f"({100 * down_bytes / td / 1e3 / copy:.0f}%) / {err[0]:.1e}, {err[1]:.1e}")
    print(f"{rows} | {n_exp} | " + " | ".join(cells), flush=True)

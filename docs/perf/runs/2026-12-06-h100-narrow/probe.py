"""Device probe (not shipped): the m16 grouped GEMM at batched-decode widths, the per-card crossover, and single
launches for ncu. python probe.py times | python probe.py once ROWS"""
import sys, json, os
import cupy as cp
import numpy as np
from glm_ep.backend.cuda import CudaBackend
from glm_ep.backend.cuda import grouped as NV
from glm_ep.bench.common import (glm_model, world1_cfg, gpu_moe, gpu_bf16, bench_workspace, time_median,
                                 copy_bandwidth, expert_bytes, BF16)
from glm_ep.config.topology import PathLevers
from glm_ep.mlp.site import MoeSite
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.dist.comm import SelfComm

mode = sys.argv[1]
KDIR = next((a.split("=")[1] for a in sys.argv if a.startswith("--kdir=")), "")
OLD = bool(KDIR)
if KDIR:
    from pathlib import Path
    from glm_ep.backend.cuda import kernel_loader
    kernel_loader.KERNEL_DIR = Path(__file__).resolve().parent / KDIR
model = glm_model(); cfg = world1_cfg(model)
be = CudaBackend(0); stream = be.stream
cp.random.seed(0)
h, m, k, E = model.hidden_size, model.moe_intermediate_size, model.num_experts_per_tok, model.n_routed_experts
with stream:
    moe = be.upload_moe(gpu_moe(cp, model), model.swiglu_limit)
ws = bench_workspace(be, cfg, 512)
out = cp.empty((512, h), dtype=BF16)
site = lambda lv: MoeSite(be, SelfComm(), cfg, moe, ExpertDispatch.routed(be, cfg, lv))
base = site(PathLevers())

def setup(rows):
    cp.random.seed(rows)
    x = gpu_bf16(cp, (rows, h), 1.0)
    ids = base.route(x, ws).ids_TK
    s = rows * k
    tok, eid, off = ws.view("sorted_token_ids", s), ws.view("sorted_expert_ids", s), ws.view("expert_offsets", E + 1)
    perm = ws.view("token_to_perm", rows, k)
    be.sort_by_expert(ids, E, tok, eid, off, perm)
    act = ws.view("a_act", s, m); routed = ws.view("expert_out", s, h)
    return x, ids, tok, off, act, routed

V16 = (16, 1, 4, 64, 4, "sync")
if mode == "once":
    rows = int(sys.argv[2])
    V16 = next((v for v in NV.GEMM_VARIANTS if NV.GemmGeometry.of(v).suffix == sys.argv[3]), V16) if len(sys.argv) > 3 else V16
    x, ids, tok, off, act, routed = setup(rows)
    with stream:
        if rows == 1:
            base(x, ws, out[:1])
        else:
            NV.nvfp4_gemm_sorted_glu(x, tok, off, E, moe.experts, cfg.swiglu_limit, act, variant=V16)
            NV.nvfp4_gemm_sorted(act, False, tok, off, E, moe.experts.down, routed, variant=V16)
    stream.synchronize()
    sys.exit(0)

copy = copy_bandwidth(cp, stream)
res = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "copy_gbs": copy, "gemm": [], "cross": []}
eb = expert_bytes(model)
VARIANTS = [V16, (8, 1, 4, 64, 4, "narrow"), (16, 1, 4, 64, 4, "narrow"), (16, 1, 4, 128, 3, "narrow")]
for rows in (16, 64, 256):
    x, ids, tok, off, act, routed = setup(rows)
    used = len(np.unique(cp.asnumpy(ids)))
    t = lambda fn: time_median(cp, stream, fn, iters=20, warmup=3, repeats=5)
    for v in VARIANTS:
        if KDIR and NV.GemmGeometry.of(v).suffix + "(" not in open(os.path.join(os.path.dirname(__file__), KDIR, "gemm_nvfp4.cu")).read().replace("GEMM_NARROW(16, 2, 4, 128, 3", "m16w4k128n(").replace("GEMM_NARROW(8, 1, 4, 64, 4", "m8w4k64n(").replace("GEMM_NARROW(16, 2, 4, 64, 4", "m16w4k64n(").replace("GEMM_VARIANT(16, 1, 4, 64, 4", "m16w4k64("):
            continue  # a variant that kernel folder does not instantiate
        with stream:
            glu = t(lambda: NV.nvfp4_gemm_sorted_glu(x, tok, off, E, moe.experts, cfg.swiglu_limit, act, variant=v))
            down = t(lambda: NV.nvfp4_gemm_sorted(act, False, tok, off, E, moe.experts.down, routed, variant=v))
        floor = used * eb / copy / 1e3
        r = {"kdir": KDIR or "tree", "variant": NV.GemmGeometry.of(v).suffix, "rows": rows, "experts": used, "glu_us": round(glu, 1),
             "down_us": round(down, 1), "routed_floor_us": round(floor, 1), "pct": round(100 * floor / (glu + down), 1)}
        res["gemm"].append(r); print(r, flush=True)
if "--cross" not in sys.argv:
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), f"probe_{KDIR or 'tree'}.json"), "w"), indent=1)
    sys.exit(0)
gemm = site(PathLevers(prefill_gemm_min_rows=2))
for rows in (9, 12, 16, 20, 24):
    x = gpu_bf16(cp, (rows, h), 1.0)
    t = lambda fn: time_median(cp, stream, fn, iters=20, warmup=3, repeats=5)
    r = {"rows": rows, "default_us": t(lambda: base(x, ws, out[:rows])), "gemm_us": t(lambda: gemm(x, ws, out[:rows])),
         "default_path": base.experts.path_for(rows), "gemm_path": gemm.experts.path_for(rows)}
    res["cross"].append(r); print(r, flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe.json"), "w"), indent=1)

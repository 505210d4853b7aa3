"""Device probe (not shipped): grouped-GEMM variants at 16..4096 rows on seeded routing; --kdir=DIR times the
kernel sources in .devrun/DIR (only the variants it instantiates; their wgmma engine reads x in the natural k
order). The tree's wgmma variant reads x staged (stage_k, timed as stage_us) and writes act staged; --save
keeps act in the natural order. python probe3.py [--kdir=DIR] [--rows=a,b] [--variants=suffix,...] [--save] [--natural]"""
import sys, json, os, re
import cupy as cp
import numpy as np
from pathlib import Path
from glm_ep.backend.cuda import CudaBackend
from glm_ep.backend.cuda import grouped as NV
from glm_ep.backend.cuda import kernel_loader
from glm_ep.bench.common import (glm_model, world1_cfg, gpu_moe, gpu_bf16, bench_workspace, time_median,
                                 copy_bandwidth, expert_bytes, BF16)
from glm_ep.config.topology import PathLevers
from glm_ep.mlp.site import MoeSite
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.dist.comm import SelfComm

arg = lambda name, d: next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), d)
KDIR = arg("kdir", "")
ROWS = [int(r) for r in arg("rows", "16,64,256,512,1024,2048,4096").split(",")]
WANT = arg("variants", "")
if KDIR:
    kernel_loader.KERNEL_DIR = Path(__file__).resolve().parent / KDIR
if KDIR and "--natural" in sys.argv:  # an engine from before the staged order reads x as it is
    NV._staged_checks = lambda *a: None  # the engine before reads x as it is
    NV.GemmGeometry.staged = property(lambda self: False)
src = (kernel_loader.KERNEL_DIR / "gemm_nvfp4.cu").read_text()
built = set()
for m in re.finditer(r"^GEMM_(NARROW|PLACED|VARIANT|TILED|WGMMA_WS|WGMMA|WGREG)\(([^)]*)\)", src, re.M):
    a = [int(x) for x in m.group(2).split(",")]
    kind = m.group(1)
    if kind == "PLACED": built.add(NV.gemm_suffix(a[0], 1, a[2], a[3], a[4], "placed")); continue
    if kind == "NARROW": built.add(NV.gemm_suffix(a[0], 1, a[2], a[3], a[4], "narrow"))
    elif kind == "VARIANT": built.add(NV.gemm_suffix(a[0], 1, a[2], a[3], a[4], "sync"))
    elif kind == "TILED": built.add(NV.gemm_suffix(a[0], a[2], a[3], a[4], a[5], "sync"))
    else: built.add(f"m128wg{a[0]}k64" if len(a) == 3 else f"m{a[0]}wg{a[1]}k64")
model = glm_model(); cfg = world1_cfg(model)
be = CudaBackend(0); stream = be.stream
cp.random.seed(0)
h, m, k, E = model.hidden_size, model.moe_intermediate_size, model.num_experts_per_tok, model.n_routed_experts
with stream:
    moe = be.upload_moe(gpu_moe(cp, model), model.swiglu_limit)
ws = bench_workspace(be, cfg, max(ROWS))
base = MoeSite(be, SelfComm(), cfg, moe, ExpertDispatch.routed(be, cfg, PathLevers()))
copy = copy_bandwidth(cp, stream)
eb = expert_bytes(model)
print({"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "copy_gbs": round(copy), "kdir": KDIR or "tree"})
SMALL = ["m8w4k64n", "m16w4k64n", "m16w4k128n", "m32w4k64n"]
LARGE = ["m16w4k128n", "m32w4k64n", "m32w4k128n", "m64w4k64n", "m32w4k64", "m64w4k128", "m128w2x4k64", "m128wgk64"]
res = []
for rows in ROWS:
    cp.random.seed(rows)
    x = gpu_bf16(cp, (rows, h), 1.0)
    ids = base.route(x, ws).ids_TK
    s = rows * k
    tok, eid, off = ws.view("sorted_token_ids", s), ws.view("sorted_expert_ids", s), ws.view("expert_offsets", E + 1)
    perm = ws.view("token_to_perm", rows, k)
    be.sort_by_expert(ids, E, tok, eid, off, perm)
    act = ws.view("a_act", s, m); routed = ws.view("expert_out", s, h)
    used = len(np.unique(cp.asnumpy(ids)))
    floor = used * eb / copy / 1e3
    it = 20 if rows <= 1024 else 8
    t = lambda fn: time_median(cp, stream, fn, iters=it, warmup=3, repeats=5)
    names = WANT.split(",") if WANT else (SMALL if rows <= 256 else []) + (LARGE if rows >= 256 else [])
    for name in dict.fromkeys(names):
        if name not in built:
            continue
        v = next(v for v in NV.GEMM_VARIANTS if NV.GemmGeometry.of(v).suffix == name)
        if not NV.runs_here(v):
            print("not here:", NV.why_not_here(v)); continue
        st = NV.GemmGeometry.of(v).staged
        xs = ws.view("a_up", s, m).reshape(-1)[:x.size].reshape(x.shape)
        with stream:
            stage = t(lambda: NV.stage_k(x, xs)) if st else 0.0
            glu = t(lambda: NV.nvfp4_gemm_sorted_glu(xs if st else x, tok, off, E, moe.experts, cfg.swiglu_limit, act,
                                                     variant=v, x_staged=st, act_staged=st))
            down = t(lambda: NV.nvfp4_gemm_sorted(act, False, tok, off, E, moe.experts.down, routed, variant=v,
                                                  x_staged=st))
        tot = stage + glu + down
        r = {"kdir": KDIR or "tree", "variant": name, "rows": rows, "experts": used, "stage_us": round(stage, 1),
             "glu_us": round(glu, 1), "down_us": round(down, 1), "total_us": round(tot, 1),
             "routed_floor_us": round(floor, 1), "pct": round(100 * floor / tot, 1),
             "tflops": round(6 * s * m * h / (tot * 1e-6) / 1e12)}
        res.append(r); print(r, flush=True)
        if "--save" in sys.argv:  # the outputs of this variant, for a comparison across kernel folders
            with stream:
                if st:
                    NV.stage_k(x, xs)
                NV.nvfp4_gemm_sorted_glu(xs if st else x, tok, off, E, moe.experts, cfg.swiglu_limit, act, variant=v,
                                         x_staged=st, act_staged=st)
                NV.nvfp4_gemm_sorted(act, False, tok, off, E, moe.experts.down, routed, variant=v, x_staged=st)
            stream.synchronize()
            a = cp.asnumpy(act).view(np.uint16)
            if st:
                a = a[:, np.argsort(NV.staged_order(m))]
            np.save(f"/tmp/out_{KDIR or 'tree'}_{name}_{rows}_act.npy", a)
            np.save(f"/tmp/out_{KDIR or 'tree'}_{name}_{rows}_routed.npy", cp.asnumpy(routed).view(np.uint16))
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), f"probe_{KDIR or 'tree'}.json"), "w"), indent=1)

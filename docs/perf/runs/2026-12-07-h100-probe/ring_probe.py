"""Lab probe: per-warp timelines of the decode ring (gate + up, down + combine) and the union ring at R rows.

Patches the ring sources with %globaltimer / clock64 marks (entry, slots read, first slab landed, end, smid),
runs each launch eagerly after warm-up on distinct layers, and prints the shape of the launch: when the first
bytes land, how the warps' end times spread, and how much of the span the warps are busy.
"""
from __future__ import annotations

import re
import sys

import numpy as np

from glm_ep.backend.cuda import kernel_loader as KL

PROBE = r'''
#define PROBE_SLOTS 16
__device__ unsigned long long g_probe[65536 * PROBE_SLOTS];
__device__ __forceinline__ unsigned long long probe_gt() { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ void probe_mark(int k, unsigned long long v) {
    if ((threadIdx.x & 31) == 0) g_probe[(size_t)(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * PROBE_SLOTS + k] = v;
}
__device__ __forceinline__ unsigned probe_smid() { unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); return s; }
'''

_orig = KL.kernel_source


def patched(name: str) -> str:
    src = _orig(name)
    if name not in ("gemv_nvfp4_ring.cu", "gemv_nvfp4_union.cu"):
        return src
    src = PROBE + src
    # ring_pipeline: the first slab landed, the warp's slab count, its end
    a = "        consume(ring[stage], c_item, c_s);"
    assert a in src
    src = src.replace(a, "        if (probe_n == 0) probe_mark(2, probe_gt()); if (probe_n < 8) probe_mark(8 + probe_n, probe_gt()); ++probe_n;\n" + a)
    b = "    int c_item = w0, c_s = 0, stage = 0, fill = D - 1;"
    assert b in src
    src = src.replace(b, b + "\n    int probe_n = 0;")
    c = "    }\n}\n\ntemplate <int P>\n__device__ __forceinline__ void zero_acc"
    assert c in src
    src = src.replace(c, "    }\n    probe_mark(5, probe_n);\n}\n\ntemplate <int P>\n__device__ __forceinline__ void zero_acc")
    if name == "gemv_nvfp4_ring.cu":
        c = "    const int nlocal = local_slots<P>(ids, S, start, count, wp, sp, s2, my_slot, wb, sb, fb);"
    else:
        c = "    const int nlocal = local_entries<P, R>(u_eid, u_slot, U, rows, start, count, wp, sp, s2, wb, sb, fb, ents);"
    assert c in src, name
    src = src.replace(c, "    probe_mark(0, probe_gt()); probe_mark(6, clock64()); probe_mark(4, probe_smid());\n" + c
                      + "\n    probe_mark(1, probe_gt());")
    # the end: after ring_pipeline's call in ring_moe / ring_union (the last statement of each)
    n = 0
    for fn in ("ring_moe", "ring_union"):
        m = re.search(r"__device__ __forceinline__ void " + fn + r"\(", src)
        if not m:
            continue
        # the function ends at the first "\n}\n" after it
        end = src.index("\n}\n", m.end())
        src = src[:end] + "\n    probe_mark(3, probe_gt()); probe_mark(7, clock64());" + src[end:]
        n += 1
    assert n == 1, name
    return src


KL.kernel_source = patched


def read_probe(cp, name: str, warps: int) -> np.ndarray:
    mod = KL._module(name, 0)
    g = mod.get_global("g_probe")
    arr = cp.ndarray((65536, 16), cp.uint64, memptr=g)
    return cp.asnumpy(arr[:warps])


def clear_probe(cp, name: str) -> None:
    mod = KL._module(name, 0)
    g = mod.get_global("g_probe")
    cp.ndarray((65536 * 16,), cp.uint64, memptr=g).fill(0)


RAW = {}


def shape(tag: str, p: np.ndarray, nbytes: float, copy_gbs: float, clock_khz: int) -> None:
    RAW[tag] = p[p[:, 3] > 0].copy()
    live = p[:, 3] > 0
    p = p[live].astype(np.float64)
    busy = p[p[:, 5] > 0]
    t0 = p[:, 0].min()
    rel = lambda c: (busy[:, c] - t0) / 1000.0  # us
    ent, slots, first, end = rel(0), rel(1), rel(2), rel(3)
    span = end.max()
    cyc = (busy[:, 7] - busy[:, 6]) / clock_khz * 1000.0  # us on each warp's own SM clock
    q = lambda a: " / ".join(f"{np.percentile(a, x):.2f}" for x in (0, 10, 50, 90, 100))
    sm = busy[:, 4].astype(int)
    per_sm = np.bincount(sm, weights=busy[:, 5])
    per_sm = per_sm[per_sm > 0]
    # bytes landed over time if each warp streams evenly from first to end: the fraction of the span at rate
    tl = np.linspace(0, span, 200)
    active = np.array([((first <= t) & (end > t)).sum() for t in tl])
    print(f"== {tag}: {len(p)} warps placed, {len(busy)} with slabs; span {span:.2f} us "
          f"(bytes {nbytes / 1e6:.1f} MB -> {nbytes / span / 1e3:.0f} GB/s, {100 * nbytes / span / 1e3 / copy_gbs:.0f}% of copy)")
    print(f"   entry   min/p10/p50/p90/max us: {q(ent)}")
    print(f"   slots   read:                   {q(slots)}")
    print(f"   first   slab landed:            {q(first)}")
    print(f"   end:                            {q(end)}")
    print(f"   warp    duration (clock64) us:  {q(cyc)}")
    print(f"   slabs a warp:                   {q(busy[:, 5])}; slabs an SM min/mean/max {per_sm.min():.0f} / "
          f"{per_sm.mean():.1f} / {per_sm.max():.0f} over {len(per_sm)} SMs")
    mean_active = active.mean()
    print(f"   warps streaming over the span: mean {mean_active:.0f} of {len(busy)}; at 25/50/75/90/95% of the span: "
          + " / ".join(str(int(active[int(f * 199)])) for f in (0.25, 0.5, 0.75, 0.9, 0.95)))
    gt = np.unique(np.diff(np.unique(p[:, 3])))
    print(f"   globaltimer steps seen (ns): {gt[:6]}")


def main() -> int:
    import cupy as cp

    from glm_ep.bench.common import copy_bandwidth, expert_bytes, glm_model, gpu_bf16, graph_median_us
    from glm_ep.bench.sweep_ring import E_LOCAL, _bench_backend
    from glm_ep.checkpoint.weights import ExpertWeights, MoeWeights
    from glm_ep.bench.common import gpu_dense, gpu_nvfp4

    model = glm_model()
    h, m, k, limit, e = (model.hidden_size, model.moe_intermediate_size, model.num_experts_per_tok,
                         model.swiglu_limit, model.n_routed_experts)
    import os
    fixed = os.environ.get("CLAIMS") == "0"
    base = _bench_backend()
    be = _bench_backend(dict(claims=False), base) if fixed else base
    print("items at a fixed stride" if fixed else "items claimed")
    s = be.stream
    copy_gbs = copy_bandwidth(cp, s)
    clock_khz = cp.cuda.runtime.getDeviceProperties(0)["clockRate"]
    print(f"copy {copy_gbs:.0f} GB/s, clock {clock_khz} kHz")
    L = 8
    with s:
        layers = [MoeWeights(gpu_bf16(cp, (E_LOCAL, h), h ** -0.5), cp.zeros(E_LOCAL, cp.float32), 0,
                             tuple(ExpertWeights(gpu_nvfp4(cp, m, h), gpu_nvfp4(cp, m, h), gpu_nvfp4(cp, h, m))
                                   for _ in range(E_LOCAL)),
                             gpu_dense(cp, model.shared_intermediate, h)) for _ in range(L)]
        sites = [be.upload_moe(w, limit) for w in layers]
    x = gpu_bf16(cp, (1, h), 1.0)
    ids = cp.asarray(np.random.default_rng(0).choice(E_LOCAL, k, replace=False).astype(np.int32))
    from glm_ep.bench.common import BF16
    gate, up, act = (cp.zeros((k, m), BF16) for _ in range(3))
    act[:] = gpu_bf16(cp, (k, m), 0.5)
    routed, out = cp.zeros((k, h), BF16), cp.empty((1, h), BF16)
    wts = cp.full((1, k), 0.125, cp.float32)
    sh_act = gpu_bf16(cp, (1, model.shared_intermediate), 0.5)
    per = expert_bytes(model) // 3

    def glu(i):
        be.moe_gate_up_act(x, sites[i].experts, ids, limit, gate, up, act)

    def tail(i):
        be.moe_down_shared_combine(act, sites[i].experts.down, ids, routed, sh_act, sites[i].shared.down, wts, out, out)

    for tag, fn, nbytes in (("decode glu", glu, 2 * k * per), ("decode down + shared down + combine", tail,
                                                               k * per + h * model.shared_intermediate * 2)):
        with s:
            for i in range(L):
                fn(i)
            s.synchronize()
            us = graph_median_us(cp, s, be.capture, lambda: [fn(i) for i in range(L)], 20, L)
            for rep in range(3):
                clear_probe(cp, "gemv_nvfp4_ring.cu")
                fn(rep % L)
                s.synchronize()
                shape(f"{tag} (graph {us:.1f} us a layer), eager rep {rep}", read_probe(cp, "gemv_nvfp4_ring.cu", 8192),
                      nbytes, copy_gbs, clock_khz)

    # the union ring at R rows over 288 experts (the ring to 8 rows)
    be = _bench_backend(dict(union_max_rows=8, claims=not fixed), be)
    with s:
        ulayers = [tuple(ExpertWeights(gpu_nvfp4(cp, m, h), gpu_nvfp4(cp, m, h), gpu_nvfp4(cp, h, m)) for _ in range(e))
                   for _ in range(3)]
        tables = [be.upload_experts(w, 0, limit) for w in ulayers]
    rng = np.random.default_rng(0)
    ids_host = np.stack([rng.choice(e, k, replace=False) for _ in range(8)]).astype(np.int32)
    uids, ux = cp.asarray(ids_host), gpu_bf16(cp, (8, h), 1.0)
    ug, uu, ua = (cp.empty((8, k, m), BF16) for _ in range(3))
    ua[:] = gpu_bf16(cp, (8, k, m), 0.5)
    ur = cp.empty((8, k, h), BF16)
    u_eid, u_slot = cp.empty(8 * k, cp.int32), cp.empty(8 * k * 8, cp.int32)
    for r in (4, 8):
        ue, us_ = u_eid[:r * k], u_slot[:r * k * r].reshape(r * k, r)
        union = len(np.unique(ids_host[:r]))
        for tag, part in (("glu", 0), ("down", 1)):
            def fn(i, part=part, r=r, ue=ue, us_=us_):
                be.union_table(uids[:r], ue, us_)
                if part == 0:
                    be.moe_gate_up_act_union(ux[:r], tables[i], ue, us_, limit, ug[:r], uu[:r], ua[:r])
                else:
                    be.moe_gemv_union(ua[:r], tables[i].down, ue, us_, ur[:r], per_slot_input=True)
            with s:
                for i in range(3):
                    fn(i)
                s.synchronize()
                for rep in range(2):
                    clear_probe(cp, "gemv_nvfp4_union.cu")
                    fn(rep)
                    s.synchronize()
                    shape(f"union {tag} at {r} rows ({union} experts), eager rep {rep}",
                          read_probe(cp, "gemv_nvfp4_union.cu", 8192), union * per * (2 if part == 0 else 1),
                          copy_gbs, clock_khz)
    import os
    np.savez_compressed(os.path.join(os.environ.get("OUT", "."), "ring_probe_raw.npz"),
                        **{k.replace(" ", "_"): v for k, v in RAW.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Lab probe: per-block timelines of the grouped GEMM (gate + up + SwiGLU, and down) inside the sparse site at
prefill widths: when blocks start and end, how many are resident over the launch, and the tail.
"""
from __future__ import annotations

import sys

import numpy as np

from glm_ep.backend.cuda import kernel_loader as KL

PROBE = r'''
__device__ unsigned long long g_probe[2 * 65536 * 4];
__device__ __forceinline__ unsigned long long probe_gt() { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ unsigned probe_smid() { unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); return s; }
'''

_orig = KL.kernel_source


def patched(name: str) -> str:
    src = _orig(name)
    if name != "gemm_nvfp4.cu":
        return src
    src = PROBE + src
    for kind, call in ((0, "        gemm_sorted<G>("), (1, "        gemm_sorted_glu<G>(")):
        assert call in src
        head = "        unsigned long long __t0 = probe_gt(); const unsigned __sm = probe_smid();\\\n"
        tail = (f"        __syncthreads(); if (threadIdx.x == 0) {{ unsigned long long* __p = g_probe + "
                f"((size_t){kind} * 65536 + blockIdx.x) * 4; __p[0] = __t0; __p[1] = probe_gt(); __p[2] = __sm; "
                f"__p[3] = 1 + blockIdx.y; }} \\\n")
        i = src.index(call)
        j = src.index(";", i)  # the call's end (its arguments hold no ';')
        src = src[:i] + head + src[i:j + 1] + " \\\n" + tail + src[j + 2:]
    return src


KL.kernel_source = patched


def timeline(tag: str, p: np.ndarray, nbytes: float, copy_gbs: float, sms: int) -> None:
    live = p[:, 3] > 0
    p = p[live].astype(np.float64)
    t0 = p[:, 0].min()
    st, en = (p[:, 0] - t0) / 1e3, (p[:, 1] - t0) / 1e3
    dur = en - st
    work = dur > 0.5 * np.median(dur)  # blocks with a tile (the others return at once)
    span = en.max()
    tl = np.linspace(0, span, 400)
    res = np.array([((st <= t) & (en > t) & work).sum() for t in tl])
    full = np.percentile(res, 90)
    below = tl[res < 0.9 * full]
    tail_from = below[below > span * 0.3].min() if (below > span * 0.3).any() else span
    q = lambda a: " / ".join(f"{np.percentile(a, x):.1f}" for x in (0, 10, 50, 90, 100))
    per_sm = np.bincount(p[work, 2].astype(int), weights=dur[work], minlength=sms)
    print(f"== {tag}: {len(p)} blocks ({work.sum()} with a tile), span {span:.1f} us, "
          f"{nbytes / span / 1e3:.0f} GB/s ({100 * nbytes / span / 1e3 / copy_gbs:.0f}% of copy)")
    print(f"   block duration us min/p10/p50/p90/max: {q(dur[work])}")
    print(f"   resident tiles: p90 {full:.0f}; below 90% of that from {tail_from:.1f} us ({100 * (span - tail_from) / span:.0f}% of the span)")
    print("   resident at 10..100% of the span: " + " ".join(str(int(res[min(399, int(f * 399))])) for f in np.arange(0.1, 1.01, 0.1)))
    print(f"   last block start {st[work].max():.1f} us; busy time an SM min/mean/max {per_sm.min():.0f} / "
          f"{per_sm.mean():.0f} / {per_sm.max():.0f} (block-us)")


def main() -> int:
    import cupy as cp

    from glm_ep.app.footprint import nvfp4_bytes
    from glm_ep.bench.common import (BF16, bench_backend, bench_workspace, copy_bandwidth, glm_model, gpu_bf16,
                                     gpu_moe, world1_cfg)
    from glm_ep.bench import bench_levers
    from glm_ep.dist.comm import SelfComm
    from glm_ep.mlp.dispatch import ExpertDispatch
    from glm_ep.mlp.site import MoeSite

    topo = sys.argv[1] if len(sys.argv) > 1 else "h100-1"
    lv, _ = bench_levers(topo)
    model = glm_model()
    cfg = world1_cfg(model)
    h, m = model.hidden_size, model.moe_intermediate_size
    be = bench_backend(lv, 4096)
    s = be.stream
    copy_gbs = copy_bandwidth(cp, s)
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    cp.random.seed(0)
    with s:
        moe = be.upload_moe(gpu_moe(cp, model), model.swiglu_limit)
    ws = bench_workspace(be, cfg, 4096)
    out = cp.empty((4096, h), dtype=BF16)
    site = MoeSite(be, SelfComm(), cfg, moe, ExpertDispatch.routed(be, cfg, lv))
    mod = KL._module("gemm_nvfp4.cu", 0)
    g = cp.ndarray((2, 65536, 4), cp.uint64, memptr=mod.get_global("g_probe"))
    print(f"copy {copy_gbs:.0f} GB/s, {sms} SMs, topology {topo}")
    for rows in (16, 64, 256, 1024, 4096):
        cp.random.seed(rows)
        x = gpu_bf16(cp, (rows, h), 1.0)
        with s:
            for _ in range(3):
                site(x, ws, out[:rows])
            g.fill(0)
            site(x, ws, out[:rows])
            s.synchronize()
        ids = be.to_host(ws.view("ids", rows, model.num_experts_per_tok))
        union = len(np.unique(ids))
        p = cp.asnumpy(g)
        timeline(f"{rows} rows ({union} experts) gate + up + SwiGLU", p[1], union * 2 * nvfp4_bytes(m, h), copy_gbs, sms)
        timeline(f"{rows} rows down", p[0], union * nvfp4_bytes(h, m), copy_gbs, sms)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measurement: does the one-row routed gate + up launch (the decode glu ring) run faster with more
resident warps? The same bytes two ways (one GPU, random NVFP4 weights, graph replay over --layers
distinct layers, medians):

    python3 tools/glu_occupancy_probe.py [--layers 8] [--iters 20] [--sweep] [--ring-ablate 0|1|2]

- the site's shape: 8 slots of [2048, 4096] gate and up, 1024 items of 16 rows (one per warp);
- the same weights split along K: 16 slots of [2048, 2048], 2048 items of half the slabs, what a
  glu ring whose items are K halves would sweep (without the halves' combine).
Each under every (slab T, depth D) of ``loader.RING_KERNELS`` with T x D <= 12 (T = 4, D = 2: 20 KB a warp,
10 warps an SM; half-size T = 2 entries, added for a run and held to 128 registers, gave 16), in the
unscaled bf16 and the placed forms. ``--sweep``: the site's glu at 2..32 slots of [2048, 4096] (T = 4,
bf16u), time against bytes, whose intercept is what a launch costs besides its bytes. ``--eager N``: N
eager launches of the site's glu, for a profiler. ``--ring-ablate 1|2``: the ring built without its
dequantization or without any math (``RING_ABLATE``, results meaningless; NOTES "Where the one-row ring's time
goes").
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
M, E_LOCAL, LIMIT = 2048, 32, 10.0


def main() -> int:
    from glm_ep.backend.cuda import kernel_loader as loader

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="only the slot sweep")
    ap.add_argument("--eager", type=int, default=0, help="only N eager launches of the site's glu (for ncu)")
    ap.add_argument("--ring-ablate", type=int, choices=(0, 1, 2), default=0,
                    help="the ring built with RING_ABLATE (1: no dequantization, 2: no math; results meaningless)")
    args = ap.parse_args()
    with loader.extra_defines(**({"RING_ABLATE": args.ring_ablate} if args.ring_ablate else {})):
        return run(args)


def run(args) -> int:
    import cupy as cp

    from glm_ep.backend.cuda import CudaBackend, RingConfig
    from glm_ep.backend.cuda.kernel_loader import RING_KERNELS
    from glm_ep.bench.common import gpu_nvfp4, graph_median_us
    from glm_ep.checkpoint.weights import ExpertWeights, MoeWeights

    base = CudaBackend(0)
    s = base.stream

    def layers(h):
        return [MoeWeights(cp.zeros((E_LOCAL, h), BF16), cp.zeros(E_LOCAL, cp.float32), 0,
                           tuple(ExpertWeights(gpu_nvfp4(cp, M, h), gpu_nvfp4(cp, M, h), gpu_nvfp4(cp, h, M))
                                 for _ in range(E_LOCAL)), None)
                for _ in range(args.layers)]

    with s:
        shapes = {4096: layers(4096), 2048: layers(2048)}
        x = {h: (cp.random.standard_normal((1, h), dtype=cp.float32)).astype(BF16) for h in shapes}
        gate, up, act = (cp.empty((E_LOCAL, M), BF16) for _ in range(3))
    rng = np.random.default_rng(0)
    ids = {n: cp.asarray(rng.choice(E_LOCAL, n, replace=False).astype(np.int32)) for n in (2, 4, 8, 16, 24, 32)}

    def glu_bytes(slots):  # gate + up of the slots at K 4096: packed nibbles and E4M3 scales
        return slots * 2 * M * 4096 * 9 // 16

    nbytes = glu_bytes(8)

    def timed(fn, label, nbytes=nbytes):
        us = graph_median_us(cp, s, base.capture, fn, args.iters, args.layers)
        print(f"{label:<58s} {us:7.1f} us  {nbytes / us / 1e3:6.0f} GB/s", flush=True)
        return us

    if args.eager:
        with s:
            moes = [base.upload_moe(w, LIMIT) for w in shapes[4096]]
            for i in range(args.eager):
                base.moe_gate_up_act(x[4096], moes[i % len(moes)].experts, ids[8], LIMIT, gate[:8], up[:8], act[:8])
        s.synchronize()
        return 0

    if args.sweep:
        rb = CudaBackend(0, RingConfig(placed=False, min_items_per_sm=0), stream=s)
        with s:
            moes = [rb.upload_moe(w, LIMIT) for w in shapes[4096]]
        pts = []
        for slots in (2, 4, 8, 16, 24, 32):
            def glu(slots=slots):
                for m in moes:
                    rb.moe_gate_up_act(x[4096], m.experts, ids[slots], LIMIT, gate[:slots], up[:slots], act[:slots])

            pts.append((glu_bytes(slots), timed(glu, f"bf16u T=4: {slots} slots x K 4096", glu_bytes(slots))))
        b, t = np.array(pts, dtype=np.float64).T
        slope, icpt = np.polyfit(b, t, 1)
        print(f"fit: {icpt:.1f} us + bytes / {1e-3 / slope:.0f} GB/s")
        return 0

    for rep in range(2):
        for form, placed in (("bf16u", False), ("placed", True)):
            for t, depth in sorted({(t, d) for t, d in RING_KERNELS if t * d <= 12}, reverse=True):
                cfg = RingConfig(slab=(4, t), depth=(2, depth), placed=False, placed_hidden=placed,
                                 min_items_per_sm=0)
                rb = CudaBackend(0, cfg, stream=s)
                for h, slots in ((4096, 8), (2048, 16)):
                    with s:
                        moes = [rb.upload_moe(w, LIMIT) for w in shapes[h]]

                    def glu(rb=rb, moes=moes, h=h, slots=slots):
                        for m in moes:
                            rb.moe_gate_up_act(x[h], m.experts, ids[slots], LIMIT, gate[:slots], up[:slots],
                                               act[:slots])

                    timed(glu, f"[{rep}] {form} T={t} D={depth}: {slots} slots x K {h} ({slots * M // 16} items)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Time the CUDA backend's decode and verify steps at the GLM-5.3-Flash shape (one GPU).

    python tools/kernel_timing.py [--layers 8] [--iters 20] [--ring-variants] [--no-pdl]
    python tools/kernel_timing.py --union-variants [--layers 4]
    python tools/kernel_timing.py --ring-ablation [--layers 8]

Each figure is the median replay time of a CUDA graph over ``--layers`` distinct layers (so the
weights stream from HBM, not L2), divided by the layer count, with the bytes it must read and
that over the measured device copy bandwidth. Weights are random NVFP4 bytes and bf16 values:
timing only, no numerics. ``--ring-variants`` first times the one-row routed kernels (glu, down,
both) under each ``RingConfig`` (gemv_nvfp4.cu's block kernels, ring depths, warps per SM, the operand
forms; a backend built with each, on one stream, the experts uploaded again for its operand
forms), side by side in one run. ``--union-variants`` times only the verify (union) routed experts at 2..8 rows
under each union lever set (block kernels; the union ring, its stage holding the rows rounded up to 2, 4 or 8
x columns), on all 288 experts of the GLM-5.3-Flash site with rows drawn as the router would (8 distinct
experts a row, few shared between rows). ``--ring-ablation`` times the one-row routed glu and down in the
unscaled bf16 form as built, without their dequantization, and without any math (``RING_ABLATE`` in
gemv_nvfp4_ring.cu; results meaningless), then as built again: where the ring's time goes.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
H, M, I, E_LOCAL, E_ROUTER, TOP_K = 4096, 2048, 12288, 32, 288, 8
LIMIT = 10.0  # swiglu_limit of the timed sites


def main() -> int:
    import cupy as cp

    from glm_ep.backend.cuda import CudaBackend, RingConfig
    from glm_ep.bench.common import bench_workspace, glm_model, gpu_nvfp4, graph_median_us, world1_cfg
    from glm_ep.mlp.routing import RouteParams
    from glm_ep.checkpoint.weights import DenseWeights, ExpertWeights, MoeWeights

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ring-variants", action="store_true")
    ap.add_argument("--union-variants", action="store_true", help="only the union (verify) lever sets")
    ap.add_argument("--ring-ablation", action="store_true",
                    help="only the one-row routed kernels as built, without dequantization, without math")
    ap.add_argument("--no-pdl", action="store_true", help="plain launches (no programmatic dependent launch)")
    args = ap.parse_args()
    be = CudaBackend(0, dependent_launch=not args.no_pdl)
    bench_workspace(be, world1_cfg(glm_model()), 8)  # binds the kernels' scratch (fused router, down ring's combine)
    s = be.stream

    def bf16(shape, std):
        return (cp.random.standard_normal(shape, dtype=cp.float32) * std).astype(BF16)

    def dense(width):
        return DenseWeights(bf16((width, H), H ** -0.5), bf16((width, H), H ** -0.5), bf16((H, width), width ** -0.5))

    def timed(fn, nbytes, label, per=1):
        us = graph_median_us(cp, s, be.capture, fn, args.iters, per)
        print(f"{label:<44s} {us:9.1f} us  {nbytes / 1e6:8.1f} MB  {nbytes / us / 1e3:7.0f} GB/s  "
              f"{100 * nbytes / us / 1e3 / copy_gbs:5.1f}% of copy", flush=True)
        return us

    # device copy bandwidth (read + write)
    src, dst = cp.empty(1 << 31, cp.uint8), cp.empty(1 << 31, cp.uint8)
    with s:
        dst[...] = src
        s.synchronize()
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(s)
        for _ in range(10):
            dst[...] = src
        b.record(s)
        b.synchronize()
    copy_gbs = 2 * 10 * src.nbytes / (cp.cuda.get_elapsed_time(a, b) * 1e-3) / 1e9
    del src, dst
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s", flush=True)

    L = args.layers
    if args.union_variants:
        return union_variants(cp, be, args, copy_gbs)
    with s:
        weights = [MoeWeights(bf16((E_ROUTER, H), H ** -0.5),
                              (7 + 0.02 * cp.random.standard_normal(E_ROUTER, dtype=cp.float32)),
                              0, tuple(ExpertWeights(gpu_nvfp4(cp, M, H), gpu_nvfp4(cp, M, H), gpu_nvfp4(cp, H, M))
                                       for _ in range(E_LOCAL)),
                              dense(M))
                   for _ in range(L)]
        moes = [be.upload_moe(w, LIMIT) for w in weights]
        denses = [be.upload_dense(dense(I)) for _ in range(max(L // 4, 2))]
        x = bf16((8, H), 1.0)
        ids = cp.asarray(np.stack([np.random.default_rng(r).choice(E_LOCAL, TOP_K, replace=False)
                                   for r in range(8)]).astype(np.int32))
        gate, up, act = (cp.empty(8 * TOP_K * max(M, I), BF16) for _ in range(3))
        routed = cp.empty((8, TOP_K, H), BF16)
        logits, wts = cp.empty((8, E_ROUTER), cp.float32), cp.empty((8, TOP_K), cp.float32)
        ids_out = cp.empty((8, TOP_K), cp.int32)
        u_eid, u_slot = cp.empty(64, cp.int32), cp.empty(64 * 8, cp.int32)
        out = cp.empty((8, H), BF16)

    def v(buf, *shape):  # a contiguous view of a flat scratch buffer, as the workspace gives
        return buf[:int(np.prod(shape))].reshape(shape)

    expert_mb = 3 * (M * H // 2 + M * H // 16)
    shared_mb = 3 * M * H * 2
    p = RouteParams(TOP_K, 2.5, True)

    def routed_decode():
        for m in moes:
            t = m.experts
            g, u, a = (v(b, TOP_K, M) for b in (gate, up, act))
            be.moe_gate_up_act(x[:1], t, ids[0], LIMIT, g, u, a)
            be.moe_gemv(a, t.down, ids[0], routed[0], per_slot_input=True)

    def shared_fused():
        for m in moes:
            be.gate_up_act(x[:1], m.shared, LIMIT, *(v(b, 1, M) for b in (gate, up, act)))
            be.linear(v(act, 1, M), m.shared.down, out[:1])

    def shared_unfused():
        for m in moes:
            g, u, a = (v(b, 1, M) for b in (gate, up, act))
            be.linear(x[:1], m.shared.gate, g)
            be.linear(x[:1], m.shared.up, u)
            be.swiglu(g, u, LIMIT, a)
            be.linear(a, m.shared.down, out[:1])

    def router():
        for m in moes:
            be.route(x[:1], m.router, m.bias, p, logits[:1], ids_out[:1], wts[:1])

    def router_two_launches():
        for m in moes:
            be.router_logits(x[:1], m.router, logits[:1])
            be.router_topk(logits[:1], m.bias, p, ids_out[:1], wts[:1])

    def router_shared_glu_fused():
        for m in moes:
            be.route_and_gate_up_act(x[:1], m.router, m.bias, p, logits[:1], ids_out[:1], wts[:1], m.shared, LIMIT,
                                     *(v(b, 1, M) for b in (gate, up, act)))

    def router_shared_glu_apart():
        for m in moes:
            be.route(x[:1], m.router, m.bias, p, logits[:1], ids_out[:1], wts[:1])
            be.gate_up_act(x[:1], m.shared, LIMIT, *(v(b, 1, M) for b in (gate, up, act)))

    def router_gemv_only():
        for m in moes:
            be.router_logits(x[:1], m.router, logits[:1])

    def router_topk_only():
        for m in moes:
            be.router_topk(logits[:1], m.bias, p, ids_out[:1], wts[:1])

    def shared_glu_only():
        for m in moes:
            be.gate_up_act(x[:1], m.shared, LIMIT, *(v(b, 1, M) for b in (gate, up, act)))

    def shared_down_combine():
        for m in moes:
            be.shared_down_combine(v(act, 1, M), m.shared.down, routed[0], wts[:1], out[:1], out[:1])

    def down_shared_combine_fused():
        for m in moes:
            be.moe_down_shared_combine(v(act, TOP_K, M), m.experts.down, ids[0], routed[0], v(act, 1, M),
                                       m.shared.down, wts[:1], out[:1], out[:1])

    def down_then_shared_down_combine():
        for m in moes:
            be.moe_gemv(v(act, TOP_K, M), m.experts.down, ids[0], routed[0], per_slot_input=True)
            be.shared_down_combine(v(act, 1, M), m.shared.down, routed[0], wts[:1], out[:1], out[:1])

    def dense_fused():
        for d in denses:
            be.gate_up_act(x[:1], d, LIMIT, *(v(b, 1, I) for b in (gate, up, act)))
            be.linear(v(act, 1, I), d.down, out[:1])

    def combine():
        for _ in moes:
            be.combine(routed[0], wts[:1], out[:1], out[:1])

    def time_ring(name: str, cfg: RingConfig, with_both: bool = True) -> None:
        """The one-row routed glu, down (and both, layer by layer) on a backend built with ``cfg``."""
        rb = CudaBackend(0, cfg, stream=s, dependent_launch=not args.no_pdl)
        with s:
            variant = [rb.upload_moe(w, LIMIT) for w in weights]  # device arrays: only the tables are new

        def glu_only():
            for m in variant:
                rb.moe_gate_up_act(x[:1], m.experts, ids[0], LIMIT, *(v(b, TOP_K, M) for b in (gate, up, act)))

        def down_only():
            for m in variant:
                rb.moe_gemv(v(act, TOP_K, M), m.experts.down, ids[0], routed[0], per_slot_input=True)

        def both():  # as routed_decode: glu then down, layer by layer
            for m in variant:
                g, u, a = (v(b, TOP_K, M) for b in (gate, up, act))
                rb.moe_gate_up_act(x[:1], m.experts, ids[0], LIMIT, g, u, a)
                rb.moe_gemv(a, m.experts.down, ids[0], routed[0], per_slot_input=True)

        timed(glu_only, expert_mb * TOP_K * 2 // 3, f"[{name}] routed glu, 1 row", L)
        timed(down_only, expert_mb * TOP_K // 3, f"[{name}] routed down, 1 row", L)
        if with_both:
            timed(both, expert_mb * TOP_K, f"[{name}] routed glu + down, 1 row", L)

    if args.ring_ablation:
        return ring_ablation(time_ring)
    if args.ring_variants:
        for name, cfg in (("blocks", RingConfig(enabled=False)),
                          ("ring t4 d2/2 w16 bf16", RingConfig(unscaled=False)),
                          ("ring t4 d2/2 w16 bf16u", RingConfig(placed=False)),
                          ("ring t4 d2/2 w16 placed down (default)", RingConfig()),
                          ("ring t4 d2/2 w16 placed all", RingConfig(placed_hidden=True)),
                          ("ring t4 d2/2 w16 bf16u, f16 down", RingConfig(f16=True)),
                          ("ring t4 d2/2 w16 f16 all", RingConfig(f16=True, f16_hidden=True)),
                          ("ring t4 d4/3 w8", RingConfig(depth=(4, 3), warps_per_sm=8)),
                          ("ring t4 d2/2 w16 bf16 (again)", RingConfig(unscaled=False)),
                          ("ring t4 d2/2 w16 bf16u (again)", RingConfig(placed=False)),
                          ("ring t4 d2/2 w16 placed down (again)", RingConfig()),
                          ("ring t4 d2/2 w16 bf16u, f16 down (again)", RingConfig(f16=True))):
            time_ring(name, cfg)
    timed(routed_decode, expert_mb * TOP_K, "routed experts, 1 row (glu + down)", L)
    timed(shared_fused, shared_mb, "shared expert, 1 row (fused glu + down)", L)
    timed(shared_unfused, shared_mb, "shared expert, 1 row (gate, up, swiglu, down)", L)
    timed(router, E_ROUTER * H * 2, "router gemv + top-k, 1 row (one launch)", L)
    timed(router_two_launches, E_ROUTER * H * 2, "router gemv + top-k, 1 row (two launches)", L)
    timed(router_shared_glu_fused, E_ROUTER * H * 2 + 2 * M * H * 2, "router + shared gate/up, 1 row (one launch)", L)
    timed(router_shared_glu_apart, E_ROUTER * H * 2 + 2 * M * H * 2, "router + shared gate/up, 1 row (two launches)",
          L)
    timed(router_gemv_only, E_ROUTER * H * 2, "router gemv alone, 1 row", L)
    timed(router_topk_only, E_ROUTER * 4, "router top-k alone, 1 row", L)
    timed(shared_glu_only, 2 * M * H * 2, "shared expert gate + up + SwiGLU, 1 row", L)
    timed(shared_down_combine, M * H * 2, "shared expert down + combine, 1 row", L)
    timed(combine, TOP_K * H * 2, "combine, 1 row", L)
    down_mb_all = expert_mb * TOP_K // 3 + M * H * 2
    timed(down_shared_combine_fused, down_mb_all, "routed down + shared down + combine, 1 row (one launch)", L)
    timed(down_then_shared_down_combine, down_mb_all, "routed down, then shared down + combine, 1 row (two launches)", L)
    timed(dense_fused, 3 * I * H * 2, "dense MLP, 1 row (fused glu + down)", len(denses))

    for r in (2, 4, 8):
        uniq = len(np.unique(ids[:r].get()))
        ue, us = v(u_eid, r * TOP_K), v(u_slot, r * TOP_K, r)

        def routed_union(r=r, ue=ue, us=us):
            for m in moes:
                t = m.experts
                be.union_table(ids[:r], ue, us)
                g, u, a = (v(b, r, TOP_K, M) for b in (gate, up, act))
                be.moe_gate_up_act_union(x[:r], t, ue, us, LIMIT, g, u, a)
                be.moe_gemv_union(a, t.down, ue, us, routed[:r], per_slot_input=True)

        def dense_rows(r=r):
            for d in denses:
                be.gate_up_act(x[:r], d, LIMIT, *(v(b, r, I) for b in (gate, up, act)))
                be.linear(v(act, r, I), d.down, out[:r])

        timed(routed_union, expert_mb * uniq, f"routed experts, {r} rows (union of {uniq})", L)
        timed(dense_rows, 3 * I * H * 2, f"dense MLP, {r} rows", len(denses))
    return 0


def ring_ablation(time_ring) -> int:
    """The one-row routed glu and down of the unscaled bf16 form (``RingConfig(placed=False)``) built with
    ``-DRING_ABLATE=`` 1 (no dequantization) and 2 (no math) between two runs as built; each a module of its own."""
    from glm_ep.backend.cuda import RingConfig, kernel_loader as loader

    for ablate, what in ((0, "as built"), (1, "no dequantization"), (2, "no math: streaming alone"),
                         (0, "as built, again")):
        with loader.extra_defines(**({"RING_ABLATE": ablate} if ablate else {})):
            time_ring(f"bf16u, {what}", RingConfig(placed=False), with_both=False)
    return 0


def union_variants(cp, be, args, copy_gbs: float) -> int:
    """The union (verify) routed experts, gate + up + SwiGLU and down, at 2..8 rows under each union lever set, on
    ``--layers`` layers of all 288 experts (world 1), each lever set in turn on the same rows; the bytes are the
    union's experts."""
    from glm_ep.backend.cuda import CudaBackend, RingConfig
    from glm_ep.bench.common import gpu_nvfp4, graph_median_us
    from glm_ep.checkpoint.weights import ExpertWeights

    s, L = be.stream, args.layers
    with s:
        layers = [tuple(ExpertWeights(gpu_nvfp4(cp, M, H), gpu_nvfp4(cp, M, H), gpu_nvfp4(cp, H, M))
                        for _ in range(E_ROUTER)) for _ in range(L)]
        x = (cp.random.standard_normal((8, H), dtype=cp.float32)).astype(BF16)
        rng = np.random.default_rng(0)
        ids = cp.asarray(np.stack([rng.choice(E_ROUTER, TOP_K, replace=False) for _ in range(8)]).astype(np.int32))
        gate, up, act = (cp.empty((8, TOP_K, M), BF16) for _ in range(3))
        routed = cp.empty((8, TOP_K, H), BF16)
        u_eid, u_slot = cp.empty(64, cp.int32), cp.empty(64 * 8, cp.int32)
    expert_bytes = 3 * (M * H // 2 + M * H // 16)
    variants = (("blocks", RingConfig(union_max_rows=0)),
                ("ring t2 d3", RingConfig(union_max_rows=8)),
                ("ring t4 d2", RingConfig(union_max_rows=8, union_slab=(4, 4), union_depth=(2, 2))),
                ("blocks (again)", RingConfig(union_max_rows=0)),
                ("ring t2 d3 (again)", RingConfig(union_max_rows=8)))
    backends = []
    for name, cfg in variants:
        rb = CudaBackend(0, cfg, stream=s, dependent_launch=not args.no_pdl)
        with s:
            backends.append((name, rb, [rb.upload_experts(w, 0, LIMIT, what="experts") for w in layers]))
    print(f"{'rows':>4s} {'union':>5s}  " + "  ".join(f"{n[:26]:>26s}" for n, _, _ in backends), flush=True)
    for r in (2, 3, 4, 5, 6, 8):
        uniq = len(np.unique(ids[:r].get()))
        ue, uslot = u_eid[:r * TOP_K], u_slot[:r * TOP_K * r].reshape(r * TOP_K, r)
        cells = []
        for name, rb, tables in backends:
            def routed_union(rb=rb, tables=tables):
                rb.union_table(ids[:r], ue, uslot)
                for t in tables:
                    rb.moe_gate_up_act_union(x[:r], t, ue, uslot, LIMIT, gate[:r], up[:r], act[:r])
                    rb.moe_gemv_union(act[:r], t.down, ue, uslot, routed[:r], per_slot_input=True)

            t_us = graph_median_us(cp, s, rb.capture, routed_union, args.iters, L)
            cells.append(f"{t_us:8.1f} us {100 * expert_bytes * uniq / t_us / 1e3 / copy_gbs:5.1f}%")
        print(f"{r:4d} {uniq:5d}  " + "  ".join(f"{c:>26s}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

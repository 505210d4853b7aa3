"""``glm-ep bench --sweep ring`` and ``--sweep union``: the routed experts' one-row (decode) and 2..8-row (verify)
kernels under each lever set their defaults were chosen from, side by side in ONE run on one GPU, at the
GLM-5.3-Flash shape, against the measured copy bandwidth.

- ``ring``: gate + up + SwiGLU, the down projection, both, and the down projection with the shared expert's
  and the combine (``moe_down_shared_combine``), over 8 slots of 32 local experts, for: the block kernels
  (``ring = false``), the ring as shipped, its down projection unscaled (``ring_placed = false``) or in fp16
  (``ring_f16``), fp16 everywhere (``ring_f16_hidden``), 8 warps an SM, the shared down and combine as their
  own launch (``ring_down_combine = false``), gate + up at slab 2 (``ring_glu_slab``, ``ring_glu_depth``: more
  warps an SM), and the shipped set again (the run's spread); then ONE expert
  (a dense FFN stored NVFP4) at one row on the ring, as shipped (``ring_min_items_per_sm``) and on the block
  kernels.
- ``union``: gate + up + SwiGLU and down of the union of 2..8 rows over all 288 experts (rows drawn as the
  router would), for the block kernels and each union ring geometry (slab and depth: ``ring_union_slab`` and
  ``ring_union_depth``, one projection's and gate + up's), h100-1's with each warp's items at a fixed stride
  instead of claimed (``ring_claims = false``; claims run where a launch has 3 items a warp or more), and the
  widest row count up to which the shipped ring is never slower than the block kernels (the
  ``ring_union_max_rows`` lever).

Each figure is the median replay time of a CUDA graph over ``--layers`` distinct layers (the weights stream
from HBM, not L2), per layer; random NVFP4 weights, timing only. Writes SWEEP_RING.md / sweep_ring.json or
SWEEP_UNION.md / sweep_union.json to ``--out``. Shape suffixes: S slots, M moe width, H hidden, R rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from glm_ep.bench.common import (BF16, bench_meta, bench_workspace, copy_bandwidth, expert_bytes, glm_model, gpu_bf16,
                                 gpu_dense, gpu_nvfp4, graph_median_us, results_header, world1_cfg)

E_LOCAL = 32  # local experts of the one-row sweep's layers (the slots draw 8 of them)
RING_VARIANTS = (("block kernels (ring = false)", dict(enabled=False)),
                 ("ring, as shipped", {}),
                 ("ring, down unscaled bf16 (ring_placed = false)", dict(placed=False)),
                 ("ring, down fp16 (ring_f16)", dict(f16=True)),
                 ("ring, fp16 everywhere (ring_f16_hidden)", dict(f16=True, f16_hidden=True)),
                 ("ring, 8 warps an SM (ring_warps_per_sm = 8)", dict(warps_per_sm=8)),
                 ("ring, shared down + combine apart (ring_down_combine = false)", dict(down_combine=False)),
                 ("ring, gate + up at slab 2, depth 3 (ring_glu_slab = 2, ring_glu_depth = 3)",
                  dict(glu_slab=2, glu_depth=3)),
                 ("ring, gate + up at slab 2, depth 2 (ring_glu_slab = 2, ring_glu_depth = 2)",
                  dict(glu_slab=2, glu_depth=2)),
                 ("ring, as shipped (again)", {}))
ONE_EXPERT_VARIANTS = (("ring, every launch (ring_min_items_per_sm = 0)", dict(min_items_per_sm=0)),
                       ("as shipped", {}),
                       ("block kernels (ring = false)", dict(enabled=False)))
UNION_VARIANTS = (("block kernels (ring_union_max_rows = 0)", dict(union_max_rows=0)),
                  ("union ring, slab 2 depth 3 (as shipped)", dict(union_max_rows=8)),
                  ("union ring, slab 4 depth 2", dict(union_max_rows=8, union_slab=(4, 4), union_depth=(2, 2))),
                  ("union ring, the down at depth 2 (ring_union_depth = [2, 3], h100-1)",
                   dict(union_max_rows=8, union_depth=(2, 3))),
                  ("union ring, slab 2 depth 2", dict(union_max_rows=8, union_depth=(2, 2))),
                  ("union ring, depth [2, 3], items at a fixed stride (ring_claims = false)",
                   dict(union_max_rows=8, union_depth=(2, 3), claims=False)),
                  ("block kernels (again)", dict(union_max_rows=0)),
                  ("union ring, slab 2 depth 3 (again)", dict(union_max_rows=8)))
UNION_ROWS = (2, 3, 4, 5, 6, 7, 8)
PARTS = ("glu", "down")  # the union sweep's projections timed alone: gate + up + SwiGLU, and down


def run_sweep_ring(args: argparse.Namespace) -> int:
    import cupy as cp

    from glm_ep.checkpoint.weights import ExpertWeights, MoeWeights

    model, L = glm_model(), max(args.layers or 8, 2)
    h, m, i, k, limit = (model.hidden_size, model.moe_intermediate_size, model.intermediate_size,
                         model.num_experts_per_tok, model.swiglu_limit)
    be = _bench_backend()
    s, iters = be.stream, max(args.iters // 10, 10)
    copy_gbs = copy_bandwidth(cp, s)
    with s:
        layers = [MoeWeights(gpu_bf16(cp, (E_LOCAL, h), h ** -0.5), cp.zeros(E_LOCAL, cp.float32), 0,
                             tuple(ExpertWeights(gpu_nvfp4(cp, m, h), gpu_nvfp4(cp, m, h), gpu_nvfp4(cp, h, m))
                                   for _ in range(E_LOCAL)),
                             gpu_dense(cp, model.shared_intermediate, h)) for _ in range(L)]
        one = ExpertWeights(gpu_nvfp4(cp, i, h), gpu_nvfp4(cp, i, h), gpu_nvfp4(cp, h, i))
    x = gpu_bf16(cp, (1, h), 1.0)
    ids = cp.asarray(np.random.default_rng(0).choice(E_LOCAL, k, replace=False).astype(np.int32))
    one_id = cp.zeros(1, cp.int32)
    flat = [gpu_bf16(cp, (k * max(m, i),), 0.5) for _ in range(3)]  # gate, up, act: a workspace's flat buffers

    def view(b: int, *shape: int) -> Any:
        return flat[b][:int(np.prod(shape))].reshape(shape)

    gate, up, act = (view(b, k, m) for b in range(3))
    routed, out = cp.zeros((k, h), BF16), cp.empty((1, h), BF16)
    wts = cp.full((1, k), 0.125, cp.float32)
    per = expert_bytes(model) // 3  # one projection of one expert
    rows, one_rows = [], []
    for name, levers in RING_VARIANTS:
        rb = _bench_backend(levers, be)
        with s:
            sites = [rb.upload_moe(w, limit) for w in layers]  # the same device arrays: only the tables are new

        def glu(rb=rb, sites=sites) -> None:
            for site in sites:
                rb.moe_gate_up_act(x, site.experts, ids, limit, gate, up, act)

        def down(rb=rb, sites=sites) -> None:
            for site in sites:
                rb.moe_gemv(act, site.experts.down, ids, routed, per_slot_input=True)

        def tail(rb=rb, sites=sites) -> None:  # the routed down, the shared expert's down, the combine
            for site in sites:
                rb.moe_down_shared_combine(act, site.experts.down, ids, routed, view(2, 1, m), site.shared.down,
                                           wts, out, out)

        t = {key: graph_median_us(cp, s, rb.capture, fn, iters, L) for key, fn in
             (("glu_us", glu), ("down_us", down), ("tail_us", tail))}
        t["both_us"] = graph_median_us(cp, s, rb.capture, lambda: (glu(), down()), iters, L)
        rows.append({"variant": name, **t, "glu_bytes": 2 * k * per, "down_bytes": k * per,
                     "tail_bytes": k * per + h * m * 2})
    g1, u1, a1 = (view(b, 1, i) for b in range(3))
    for name, levers in ONE_EXPERT_VARIANTS:
        rb = _bench_backend(levers, be)
        with s:
            e = rb.upload_experts((one,), 0, limit, what="dense mlp")
        one_rows.append({
            "variant": name,
            "glu_us": graph_median_us(cp, s, rb.capture, lambda: rb.moe_gate_up_act(x, e, one_id, limit, g1, u1, a1),
                                      iters),
            "down_us": graph_median_us(cp, s, rb.capture, lambda: rb.moe_gemv(a1, e.down, one_id, out, True), iters)})
    one_bytes = expert_bytes(model) * i // m // 3
    meta = bench_meta(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), copy_gbs)
    meta.update(layers=L, one_glu_bytes=2 * one_bytes, one_down_bytes=one_bytes)
    return _write(Path(args.out), "ring", {"meta": meta, "rows": rows, "one_expert": one_rows}, render_ring)


def run_sweep_union(args: argparse.Namespace) -> int:
    import cupy as cp

    from glm_ep.checkpoint.weights import ExpertWeights

    model, L = glm_model(), max(args.layers or 4, 2)
    h, m, e, k, limit = (model.hidden_size, model.moe_intermediate_size, model.n_routed_experts,
                         model.num_experts_per_tok, model.swiglu_limit)
    be = _bench_backend()
    s, iters = be.stream, max(args.iters // 10, 10)
    copy_gbs = copy_bandwidth(cp, s)
    with s:
        layers = [tuple(ExpertWeights(gpu_nvfp4(cp, m, h), gpu_nvfp4(cp, m, h), gpu_nvfp4(cp, h, m))
                        for _ in range(e)) for _ in range(L)]
    rng = np.random.default_rng(0)
    ids_host = np.stack([rng.choice(e, k, replace=False) for _ in range(max(UNION_ROWS))]).astype(np.int32)
    ids, x = cp.asarray(ids_host), gpu_bf16(cp, (max(UNION_ROWS), h), 1.0)
    r8 = max(UNION_ROWS)
    gate, up, act = (cp.empty((r8, k, m), BF16) for _ in range(3))
    routed = cp.empty((r8, k, h), BF16)
    u_eid, u_slot = cp.empty(r8 * k, cp.int32), cp.empty(r8 * k * r8, cp.int32)
    backends = []
    for name, levers in UNION_VARIANTS:
        rb = _bench_backend(levers, be)
        with s:
            backends.append((name, rb, [rb.upload_experts(w, 0, limit) for w in layers]))
    rows = []
    for r in UNION_ROWS:
        ue, us = u_eid[:r * k], u_slot[:r * k * r].reshape(r * k, r)
        row: dict[str, Any] = {"rows": r, "union": int(len(np.unique(ids_host[:r])))}
        for name, rb, tables in backends:
            def union(rb=rb, tables=tables, glu: bool = True, down: bool = True) -> None:
                rb.union_table(ids[:r], ue, us)
                for t in tables:
                    if glu:
                        rb.moe_gate_up_act_union(x[:r], t, ue, us, limit, gate[:r], up[:r], act[:r])
                    if down:
                        rb.moe_gemv_union(act[:r], t.down, ue, us, routed[:r], per_slot_input=True)

            row[name] = graph_median_us(cp, s, rb.capture, union, iters, L)
            for part in PARTS if not name.endswith("(again)") else ():  # each projection alone (with the union
                # table): its geometry is a lever of its own
                row[f"{name} | {part}"] = graph_median_us(
                    cp, s, rb.capture, lambda u=union, g=part == "glu": u(glu=g, down=not g), iters, L)
        rows.append(row)
    meta = bench_meta(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), copy_gbs)
    meta.update(layers=L, experts=e, top_k=k, expert_bytes=expert_bytes(model), variants=[n for n, _ in UNION_VARIANTS],
                ring_up_to=ring_up_to(rows, UNION_VARIANTS[0][0], UNION_VARIANTS[1][0]))
    return _write(Path(args.out), "union", {"meta": meta, "rows": rows}, render_union)


def _bench_backend(levers: dict[str, Any] | None = None, base: Any = None) -> Any:
    """A CUDA backend on device 0: the default one, or one whose ring takes ``levers`` on ``base``'s stream and launch
    mode; either way a world-1 workspace of 8 rows binds its kernels' scratch (fused router, down ring's combine)."""
    from glm_ep.backend.cuda import CudaBackend, RingConfig

    be = CudaBackend(0) if base is None else CudaBackend(0, RingConfig(**(levers or {})), stream=base.stream,
                                                          dependent_launch=base.pdl)
    bench_workspace(be, world1_cfg(glm_model()), 8)
    return be


def _write(out_dir: Path, name: str, data: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"sweep_{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    text = render(data)
    (out_dir / f"SWEEP_{name.upper()}.md").write_text(text)
    print(text)
    return 0


def ring_up_to(rows: list[dict[str, Any]], blocks: str, ring: str) -> int:
    """The widest row count up to which the union ring (column ``ring``) is never slower than the block kernels
    (``blocks``), from 2 rows: what ``ring_union_max_rows`` is set from (0 where the ring loses at 2 rows)."""
    best = 0
    for r in sorted(rows, key=lambda r: r["rows"]):
        if r[ring] > r[blocks]:
            break
        best = r["rows"]
    return best


def _pct(nbytes: float, us: float, copy_gbs: float) -> str:
    return f"{100 * nbytes / (us * 1e3) / copy_gbs:.0f}%"


def render_ring(data: dict[str, Any]) -> str:
    meta = data["meta"]
    c = meta["copy_gbs"]
    lines = results_header("glm-ep bench --sweep ring", meta) + [
        "", f"One row, 8 slots of {E_LOCAL} local NVFP4 experts a layer, GLM-5.3-Flash's shape; µs a layer (median "
        f"graph replay over {meta['layers']} layers), % of the copy bandwidth over the bytes read.", "",
        "| lever set | gate + up + SwiGLU | down | both | down + shared down + combine |",
        "|---|---:|---:|---:|---:|"]
    for r in data["rows"]:
        glu_down = r["glu_bytes"] + r["down_bytes"]
        lines.append(f"| {r['variant']} | {r['glu_us']:.1f} ({_pct(r['glu_bytes'], r['glu_us'], c)}) | "
                     f"{r['down_us']:.1f} ({_pct(r['down_bytes'], r['down_us'], c)}) | "
                     f"{r['both_us']:.1f} ({_pct(glu_down, r['both_us'], c)}) | "
                     f"{r['tail_us']:.1f} ({_pct(r['tail_bytes'], r['tail_us'], c)}) |")
    lines += ["", "One expert at one row (a dense FFN stored NVFP4: gate + up 768 items of 16 rows, down 256 items of "
              "K = 12288), µs a launch:", "", "| launches | gate + up + SwiGLU | down |", "|---|---:|---:|"]
    for r in data["one_expert"]:
        lines.append(f"| {r['variant']} | {r['glu_us']:.1f} ({_pct(meta['one_glu_bytes'], r['glu_us'], c)}) | "
                     f"{r['down_us']:.1f} ({_pct(meta['one_down_bytes'], r['down_us'], c)}) |")
    return "\n".join(lines) + "\n"


def render_union(data: dict[str, Any]) -> str:
    meta = data["meta"]
    names = meta["variants"]
    lines = results_header("glm-ep bench --sweep union", meta) + [
        "", f"The union of R rows ({meta['top_k']} experts a row, drawn from all {meta['experts']}) over "
        f"{meta['layers']} layers; gate + up + "
        "SwiGLU and down of the union's experts, µs a layer, % of the copy bandwidth over the union's bytes. The "
        f"shipped union ring is never slower than the block kernels up to **{meta['ring_up_to']} rows** "
        "(`ring_union_max_rows`).", "",
        "| rows | union | " + " | ".join(names) + " |", "|---:|---:|" + "---:|" * len(names)]
    for r in data["rows"]:
        nbytes = meta["expert_bytes"] * r["union"]
        cells = [f"{r[n]:.1f} ({_pct(nbytes, r[n], meta['copy_gbs'])})" for n in names]
        lines.append(f"| {r['rows']} | {r['union']} | " + " | ".join(cells) + " |")
    timed = [n for n in names if f"{n} | glu" in data["rows"][0]] if data["rows"] else []
    for part, share, what in (("glu", 2 / 3, "gate + up + SwiGLU"), ("down", 1 / 3, "the down projection")):
        if not timed:
            break
        lines += ["", f"{what[0].upper()}{what[1:]} alone (with the union table), µs a layer, % of the copy bandwidth "
                  "over its share of the union's bytes: the geometry of each projection is a lever of its own "
                  "(`ring_union_slab` / `ring_union_depth`: one projection, then gate + up).", "",
                  "| rows | " + " | ".join(timed) + " |", "|---:|" + "---:|" * len(timed)]
        for r in data["rows"]:
            nbytes = meta["expert_bytes"] * r["union"] * share
            cells = [f"{r[f'{n} | {part}']:.1f} ({_pct(nbytes, r[f'{n} | {part}'], meta['copy_gbs'])})"
                     for n in timed]
            lines.append(f"| {r['rows']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"

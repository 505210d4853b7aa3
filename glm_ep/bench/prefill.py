"""``glm-ep bench --prefill``: wide calls (prefill) at the GLM-5.3-Flash shape, one GPU, against the
PyTorch peers measured in the SAME run (``prefill_peer``).

For each width: the sparse site (the path the dispatch picks; the row-group and grouped-GEMM paths
forced) and, with ``--stages``, where its time goes (one call's GPU time, the site's and each backend op's
alone: router, sort, routed experts, shared expert, combine), the routed-expert GEMMs alone (sort + grouped
gate/up/SwiGLU + grouped down, in TFLOP/s next to the measured bf16 GEMM rate), the dense site, the shared expert and the router; the peers:
HF transformers' ``Glm5NextTextMoE`` (fastest experts implementation), ``Glm5NextTextMLP``,
``torch._grouped_mm`` on bf16 experts and the HF router. A sweep of the two routed paths gives the
crossover the ``prefill_gemm_min_rows`` lever is set from; one of a dense FFN stored NVFP4 (row groups,
the grouped GEMM with and without its K split, its projections dequantized to bf16 for cuBLAS) the
``nvfp4_dense_gemm_min_rows`` and ``nvfp4_dense_dequant_min_rows`` levers'. Synthetic
weights made on the GPU; every figure a median over repeats after warm-up. The weights and each width's rows are
seeded (``SEED``, the width), so every run on every card times the same routing: the union of experts a width
reads, and so its roofline, is the same from one run (and tree) to the next. Writes PREFILL_<CARD>.md,
prefill_<card>.json, prefill_<card>.png (``card_tag``); a run of other ``--rows`` than the default widths writes
PREFILL_<CARD>_<rows>.md and the like instead (e.g. PREFILL_H100_1024_4096.md), so a partial run never overwrites
the full table.
Shape suffixes: T rows, H hidden, K top-k, M moe width, S = T*K.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from glm_ep.backend.cuda import grouped as NV
from glm_ep.bench.common import (BF16, bench_backend, bench_meta, bench_workspace, card_tag, copy_bandwidth,
                                 cupy_gemm_tflops, dense_bytes, dense_nvfp4_bytes, glm_model, gpu_bf16, gpu_dense,
                                 gpu_moe, gpu_nvfp4_site, pyplot, results_header, settle, site_and_plain_us,
                                 sparse_roofline, time_gpu_us, time_median, torch_time_us, world1_cfg)
from glm_ep.bench.stages import ONE_CALL, OpRecorder, stage_lines, stage_row
from glm_ep.dist.comm import SelfComm
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.mlp.site import DenseSite, MoeSite, clamped_swiglu_mlp
from glm_ep.backend.base import KERNEL_LIMITS
from glm_ep.config.topology import PathLevers

log = logging.getLogger(__name__)
WIDTHS = (16, 64, 128, 256, 1024, 4096)
SEED = 0  # the synthetic weights' (each width's rows are seeded by the width)
SWEEP = (9, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
NVFP4_SWEEP = SWEEP + (384, 512)  # the dense FFN stored NVFP4: past 256 rows for the dequant crossover
UNION_MAX_TIMED = 1024  # the row-group path is timed up to this width (it is the slow one past it)
NVFP4_UNION_MAX_TIMED = 256  # likewise for the dense FFN stored NVFP4 (each row group sweeps all of it)


def _iters(rows: int) -> int:
    return max(2, min(40, 8192 // rows))


def crossover(sweep: list[dict[str, Any]], slow: str = "union_us", fast: str = "sorted_us") -> int | None:
    """The smallest swept width from which path ``fast`` (default: the grouped GEMM) is never slower than ``slow``
    (row groups), over the widths where both were timed."""
    best = None
    for r in reversed(sweep):
        if r.get(fast) is None or r.get(slow) is None:
            continue
        if r[fast] > r[slow]:
            break
        best = r["rows"]
    return best


def run_prefill_bench(args: argparse.Namespace) -> int:
    import cupy as cp

    model = glm_model()
    cfg = world1_cfg(model)
    widths = sorted(set(args.rows or WIDTHS))
    max_rows = max(widths + list(SWEEP) + list(NVFP4_SWEEP))
    be = bench_backend(args.levers, max_rows)
    stream = be.stream
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    copy_gbs = copy_bandwidth(cp, stream)
    h, m, k = model.hidden_size, model.moe_intermediate_size, model.num_experts_per_tok
    cp.random.seed(SEED)
    with stream:
        moe = be.upload_moe(gpu_moe(cp, model), model.swiglu_limit)
        dense = be.upload_dense(gpu_dense(cp, model.intermediate_size, h))
    ws = bench_workspace(be, cfg, max_rows)
    out = cp.empty((max_rows, h), dtype=BF16)
    comm = SelfComm()

    def sparse(levers: PathLevers) -> MoeSite:
        return MoeSite(be, comm, cfg, moe, ExpertDispatch.routed(be, cfg, levers))

    lv = args.levers
    site, union_site, sorted_site = sparse(lv), sparse(replace(lv, prefill_gemm=False)), \
        sparse(replace(lv, prefill_gemm=True, prefill_gemm_min_rows=9))
    dense_site = DenseSite(be, comm, cfg, dense)
    rec = OpRecorder(be)  # the site's ops, each timed alone (the stage table)
    recorded_site = MoeSite(rec, comm, cfg, moe, ExpertDispatch.routed(rec, cfg, lv))
    with stream:
        dense_nvfp4_site = gpu_nvfp4_site(be, comm, cfg, model, lv)

    def seeded_rows(rows: int) -> Any:  # the same rows, so the same routing, in every run
        cp.random.seed(rows)
        return gpu_bf16(cp, (rows, h), 1.0)

    def t(fn: Callable[[], Any], rows: int) -> float:
        return time_median(cp, stream, fn, iters=_iters(rows), warmup=2, repeats=5)

    def router(x: Any) -> None:  # the router alone (the site's route stage may run the shared gate/up beside it)
        rows, e = x.shape[0], model.n_routed_experts
        be.route(x, moe.router, moe.bias, site.route_params, ws.view("logits", rows, e), ws.view("ids", rows, k),
                 ws.view("wts", rows, k))

    # the dense FFN stored NVFP4 on each path: row groups, the grouped GEMM without and with its K split, its
    # projections dequantized to bf16 for cuBLAS (each forced where the levers allow)
    gemm = replace(lv, prefill_gemm=True, nvfp4_dense_gemm_min_rows=KERNEL_LIMITS.max_row_group + 1)
    nvfp4_paths = {key: replace(dense_nvfp4_site, dispatch=ExpertDispatch.nvfp4_dense(be, cfg, path_levers))
                   for key, path_levers in (
        ("union_us", replace(lv, prefill_gemm=False, nvfp4_dense_dequant_min_rows=0)),
        ("sorted_nosplit_us", replace(gemm, prefill_k_split=False, nvfp4_dense_dequant_min_rows=0)),
        ("sorted_us", replace(gemm, prefill_k_split=True, nvfp4_dense_dequant_min_rows=0)),
        ("dequant_us", replace(gemm, nvfp4_dense_dequant_min_rows=SWEEP[0])))}
    # the dequant path's own pass: one projection of the dense FFN to bf16, against the copy bandwidth
    gate = dense_nvfp4_site.mlp.gate.weights
    w_bf16 = cp.empty((gate.n, gate.k), dtype=BF16)
    with stream:
        dequant_us = t(lambda: NV.nvfp4_dequant_bf16(gate, 0, w_bf16), 1024)
    dequant_bytes = gate.n * gate.k * (2 + 1 / 2 + 1 / 16)  # bf16 written, nibbles and block scales read
    w_bf16 = None
    results: dict[str, Any] = {"widths": [], "sweep": [], "nvfp4_sweep": [], "stages": []}
    for rows in SWEEP:
        x = seeded_rows(rows)
        o = out[:rows]
        results["sweep"].append({"rows": rows, "union_us": t(lambda: union_site(x, ws, o), rows),
                                 "sorted_us": t(lambda: sorted_site(x, ws, o), rows)})
        log.info("sweep %s", results["sweep"][-1])
    for rows in NVFP4_SWEEP:
        x = seeded_rows(rows)
        o = out[:rows]
        results["nvfp4_sweep"].append({"rows": rows, **{key: t(lambda: st(x, ws, o), rows)
                                                        for key, st in nvfp4_paths.items()
                                                        if key != "union_us" or rows <= NVFP4_UNION_MAX_TIMED}})
        log.info("NVFP4 dense sweep %s", results["nvfp4_sweep"][-1])
    for rows in widths:
        x = seeded_rows(rows)
        o = out[:rows]
        r: dict[str, Any] = {"rows": rows, "path": site.experts.path_for(rows)}
        r["variant"] = NV.experts_geometry(x, rows * k, model.n_routed_experts, moe.experts,
                                           ws.view("a_up", rows * k, m))[0].suffix  # the backend's stage buffer
        r["sparse_us"] = t(lambda: site(x, ws, o), rows)
        if args.stages:  # one call's GPU time, the site's and each of its ops alone
            one_call = functools.partial(time_gpu_us, cp, stream)
            settle(stream)  # the clock back up after the sustained calls above, for the site and its stages alike
            site_us, row_plain_us = site_and_plain_us(cp, stream, be, lambda: site(x, ws, o))
            row = _stages(rec, recorded_site, x, ws, o, site_us, model, be, one_call)
            row["site_plain_us"] = row_plain_us
            results["stages"].append(row)
        r["sparse_sorted_us"] = t(lambda: sorted_site(x, ws, o), rows)
        if rows <= UNION_MAX_TIMED:
            r["sparse_union_us"] = t(lambda: union_site(x, ws, o), rows)
        # the routed-expert GEMMs alone, on this width's routing; its union of experts sets the roofline's bytes
        ids_TK = site.route(x, ws).ids_TK
        r["ids"] = cp.asnumpy(ids_TK)
        s = rows * k
        tok, eid, offsets = ws.view("sorted_token_ids", s), ws.view("sorted_expert_ids", s), \
            ws.view("expert_offsets", model.n_routed_experts + 1)
        perm = ws.view("token_to_perm", rows, k)
        gate, up, act = (ws.view(b, s, m) for b in ("a_gate", "a_up", "a_act"))
        routed = ws.view("expert_out", s, h)
        r["sort_us"] = t(lambda: be.sort_by_expert(ids_TK, model.n_routed_experts, tok, eid, offsets, perm), rows)
        # the launches moe_experts_sorted makes, one at a time: x staged (the wgmma variant), gate + up, down
        # where the backend stages x (a_up; none where it cannot hold x)
        xs = NV.stage_view(up, x)
        glu_geo, down_geo = NV.experts_geometry(x, s, model.n_routed_experts, moe.experts, up)
        staged = glu_geo.staged
        with stream:
            r["stage_us"] = t(lambda: NV.stage_k(x, xs), rows) if staged else 0.0
            r["glu_us"] = t(lambda: NV.nvfp4_gemm_sorted_glu(xs if staged else x, tok, offsets, model.n_routed_experts,
                                                             moe.experts, cfg.swiglu_limit, act,
                                                             variant=glu_geo.variant, x_staged=staged,
                                                             act_staged=staged), rows)
            r["down_us"] = t(lambda: NV.nvfp4_gemm_sorted(act, False, tok, offsets, model.n_routed_experts,
                                                          moe.experts.down, routed, variant=down_geo.variant,
                                                          x_staged=staged), rows)
        r["gemm_tflops"] = 6 * s * m * h / ((r["stage_us"] + r["glu_us"] + r["down_us"]) * 1e-6) / 1e12
        r["variants"] = {}
        if not staged and xs is not None and NV.wgmma_here():
            with stream:
                NV.stage_k(x, xs)  # the wgmma variants' x
        # every tile shape on this width, the evidence for gemm_variant; --gemm-stages: the stage sweep's too
        for v in NV.GEMM_VARIANTS + (NV.GEMM_SWEEP_VARIANTS if args.gemm_stages else ()):
            st = NV.GemmGeometry.of(v).staged
            if not NV.runs_here(v) or (st and xs is None):
                continue
            with stream:
                glu = t(lambda: NV.nvfp4_gemm_sorted_glu(xs if st else x, tok, offsets, model.n_routed_experts,
                                                         moe.experts, cfg.swiglu_limit, act, variant=v, x_staged=st,
                                                         act_staged=st), rows)
                down = t(lambda: NV.nvfp4_gemm_sorted(act, False, tok, offsets, model.n_routed_experts,
                                                      moe.experts.down, routed, variant=v, x_staged=st), rows)
            r["variants"][NV.GemmGeometry.of(v).suffix] = [glu, down]
        r["dense_us"] = t(lambda: dense_site(x, ws, o), rows)
        r["dense_nvfp4_us"] = t(lambda: dense_nvfp4_site(x, ws, o), rows)
        r["dense_nvfp4_gemm_us"] = t(lambda: nvfp4_paths["sorted_us"](x, ws, o), rows)  # the grouped GEMM only
        r["shared_us"] = t(lambda: clamped_swiglu_mlp(be, moe.shared, cfg.swiglu_limit, x, ws, o), rows)
        r["router_us"] = t(lambda: router(x), rows)
        results["widths"].append(r)
        log.info("glm_ep %s", r)
    ws = out = None  # drop the workspace before the peers allocate theirs
    cp.get_default_memory_pool().free_all_blocks()
    peers = _peer_rows(model, widths, args) if args.peer else {"note": "peers skipped (--no-peer)"}
    meta = bench_meta(device, copy_gbs, args.levers_note)
    gemm_tflops = peers.get("gemm_tflops")
    if gemm_tflops is None:  # no PyTorch peer: the same rate through CuPy's cuBLAS
        gemm_tflops = cupy_gemm_tflops(cp, stream)
    for r in results["widths"]:
        roof = sparse_roofline(model, r.pop("ids"), copy_gbs, gemm_tflops)
        r.update(roof_experts=roof.experts, roof_bytes=roof.bytes_read, roof_flops=roof.flops,
                 byte_floor_us=roof.byte_floor_us, flop_floor_us=roof.flop_floor_us, roof_floor_us=roof.floor_us,
                 roof_bound=roof.bound)
    meta.update(gemm_tflops=gemm_tflops, dense_floor_us=dense_bytes(model) / (copy_gbs * 1e9) * 1e6,
                crossover=crossover(results["sweep"]), peer_note=peers.get("note", ""),
                nvfp4_dense_floor_us=dense_nvfp4_bytes(model) / (copy_gbs * 1e9) * 1e6,
                nvfp4_crossover=crossover(results["nvfp4_sweep"]),
                nvfp4_dequant_crossover=crossover(results["nvfp4_sweep"], "sorted_us", "dequant_us"),
                dequant_us=dequant_us, dequant_gbs=dequant_bytes / (dequant_us * 1e-6) / 1e9)
    for r in results["widths"]:
        r.update(peers.get(r["rows"], {}))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = result_stem(widths, card_tag(device))
    (out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, **results}, indent=2) + "\n")
    (out_dir / f"{stem.upper()}.md").write_text(render(meta, results))
    plot(out_dir / f"{stem}.png", meta, results)
    print((out_dir / f"{stem.upper()}.md").read_text())
    return 0


def _stages(rec: OpRecorder, site: MoeSite, x: Any, ws: Any, out: Any, site_us: float, model: Any, be: Any,
            timed: Callable[[Callable[[], Any]], float]) -> dict[str, Any]:
    """The ops one call of ``site`` (on the recorder) queues on ``x``, each (and each of its parts) timed alone
    (``timed``) with its bytes, beside ``site_us``: the stage table's row of this width (``stages.stage_row``)."""
    ops = rec.record(lambda: site(x, ws, out))
    return stage_row(model, be, x.shape[0], [ops], site_us, lambda one: timed(one[0]))


def _stage_section(meta: dict[str, Any], res: dict[str, Any]) -> list[str]:
    """The stage table (``stages.stage_lines``, single calls) without its leading blank line, and a blank line after
    it; nothing for a run without it (``--stages``)."""
    lines = stage_lines(res.get("stages") or [], None, meta["copy_gbs"], ONE_CALL)
    return [*lines[1:], ""] if lines else []


def result_stem(widths: list[int], card: str) -> str:
    """``prefill_<card>`` for the default widths, else ``prefill_<card>_<w1>_<w2>...`` (the table is the stem
    upper-cased)."""
    return f"prefill_{card}" + ("" if tuple(widths) == WIDTHS else "".join(f"_{w}" for w in widths))


def _peer_rows(model: Any, widths: list[int], args: argparse.Namespace) -> dict[Any, Any]:
    """Peer timings by width (plus the measured bf16 GEMM rate); a note where a peer cannot run."""
    try:
        import torch

        from glm_ep.bench import prefill_peer as P
    except ImportError as e:
        return {"note": f"no PyTorch peer ({e})"}
    res: dict[Any, Any] = {"gemm_tflops": P.bf16_gemm_tflops()}
    why = P.hf_available()
    if why:
        res["note"] = f"HF transformers' glm5_next is not importable here ({why})"
        return res
    h = model.hidden_size
    mlp, shared, router = P.hf_mlp(model, model.intermediate_size), P.hf_mlp(model, model.shared_intermediate), \
        P.torch_router(model)
    moe = P.hf_moe(model)
    for rows in widths:
        x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
        r = P.hf_moe_fastest(moe, x, _iters(rows))
        r["hf_mlp_us"] = torch_time_us(lambda: mlp(x), iters=_iters(rows))
        r["hf_shared_us"] = torch_time_us(lambda: shared(x), iters=_iters(rows))
        r["torch_router_us"] = torch_time_us(lambda: router(x), iters=_iters(rows))
        r["grouped_mm_us"] = torch_time_us(P.grouped_mm_experts(moe, model, x), iters=_iters(rows))
        res[rows] = r
        log.info("peers %d rows: %s", rows, r)
    return res


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "—" if v is None else fmt.format(v)


def lever_advice(crossover: int | None) -> list[str]:
    """What the sweep means for the ``prefill_gemm_min_rows`` lever: nothing where the built-in default is this
    card's crossover (or none was found), else the topology line that makes it so (the lever's floor is one row
    past the widest row group)."""
    default, floor = PathLevers().prefill_gemm_min_rows, KERNEL_LIMITS.max_row_group + 1
    if crossover is None or max(crossover, floor) == default:
        return []
    rows = max(crossover, floor)
    return [f"The built-in `prefill_gemm_min_rows` is {default}; on this card a topology's `[levers]` "
            f"`prefill_gemm_min_rows = {rows}` takes the grouped GEMM from the crossover (`configs/h100-1.toml` "
            "holds the H100's).", ""]


def roofline_lines(meta: dict[str, Any], w: list[dict[str, Any]]) -> list[str]:
    """The sparse site against its roofline at each width: the larger of (the union of chosen experts' weights +
    shared expert + router + activations) / copy bandwidth and its FLOPs / the measured bf16 GEMM rate."""
    if not w or "roof_floor_us" not in w[0]:  # a run recorded before the roofline was
        return []
    lines = [f"## Sparse site against its roofline (copy {meta['copy_gbs']:.0f} GB/s, bf16 GEMM "
             f"{_f(meta.get('gemm_tflops'), '{:.0f}')} TFLOP/s)", "",
             "| rows | experts read | MB read | GFLOP | byte floor | FLOP floor | bound | glm_ep | % of roofline "
             "| HF `Glm5NextTextMoE` | HF % of roofline |",
             "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in w:
        floor, hf = r["roof_floor_us"], r.get("hf_moe_us")
        lines.append(f"| {r['rows']} | {r['roof_experts']} | {r['roof_bytes'] / 1e6:.1f} | "
                     f"{r['roof_flops'] / 1e9:.1f} | {r['byte_floor_us']:.1f} | {_f(r.get('flop_floor_us'))} | "
                     f"{r['roof_bound']} | "
                     f"{r['sparse_us']:.1f} | {100 * floor / r['sparse_us']:.0f}% | {_f(hf)} | "
                     f"{_f(100 * floor / hf if hf else None, '{:.0f}%')} |")
    return lines + [""]


def render(meta: dict[str, Any], res: dict[str, Any]) -> str:
    w = res["widths"]
    gemm = f"; bf16 GEMM (torch.matmul 8192³): **{_f(meta['gemm_tflops'], '{:.0f}')} TFLOP/s**  "
    lines = results_header("glm-ep bench --prefill", meta, gemm) + [
        f"Shape: GLM-5.3-Flash (hidden 4096, 288 NVFP4 experts of width 2048, top-8, dense width 12288), "
        f"world 1. Times in µs, medians after warm-up. {meta['peer_note']}", "",
        *roofline_lines(meta, w),
        *_stage_section(meta, res),
        "## Sparse site (router + routed experts + shared expert + combine)", "",
        "| rows | glm_ep | path | row groups | grouped GEMM | HF `Glm5NextTextMoE` (fastest impl) | HF / glm_ep |",
        "|---:|---:|---|---:|---:|---:|---:|"]
    for r in w:
        hf = r.get("hf_moe_us")
        lines.append(f"| {r['rows']} | {r['sparse_us']:.1f} | {r['path']} | {_f(r.get('sparse_union_us'))} | "
                     f"{r['sparse_sorted_us']:.1f} | {_f(hf)} ({r.get('hf_moe_best', '—')}) | "
                     f"{_f(hf / r['sparse_us'] if hf else None, '{:.2f}x')} |")
    lines += ["", "## Routed-expert GEMMs alone (grouped path)", "",
              "x staged: the wgmma variant's x in its k order (one pass; 0 for the other variants); GEMMs TFLOP/s "
              "over the three.", "",
              "| rows | sort | x staged | gate+up+SwiGLU | down | GEMMs TFLOP/s | `torch._grouped_mm` bf16 "
              "(gate_up + down) | its TFLOP/s |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in w:
        gm = r.get("grouped_mm_us")  # the same FLOPs as the routed GEMMs' measured rate
        ours = r.get("stage_us", 0.0) + r["glu_us"] + r["down_us"]
        gm_tflops = r["gemm_tflops"] * ours / gm if gm else None
        lines.append(f"| {r['rows']} | {r['sort_us']:.1f} | {r.get('stage_us', 0.0):.1f} | {r['glu_us']:.1f} | "
                     f"{r['down_us']:.1f} | {r['gemm_tflops']:.0f} | {_f(gm)} | {_f(gm_tflops, '{:.0f}')} |")
    names = list(w[0]["variants"]) if w else []
    lines += ["", "## Grouped-GEMM variants: gate+up+SwiGLU / down µs", "",
              "m: rows per tile; w: warps of 32 weight rows, each on all rows (register engine), or WM x WN "
              "(tiled engine); wg8 / wg4: wgmma with the weights in registers as its A operand, four / two warpgroups "
              "of 64 weight rows (sm_90a); k: k per stage; a closing n: the rows as the "
              "mma's narrow (n8) side; a closing p: the same with the placed dequantization; _s{n}: the tile at n "
              "stages instead of its shipped count (`--gemm-stages`).",
              "",
              "| rows | chosen | " + " | ".join(names) + " |", "|---:|---|" + "---:|" * len(names)]
    for r in w:
        best = min(names, key=lambda n: sum(r["variants"][n]))
        cells = [f"{a:.0f} / {b:.0f}" + (" ★" if n == best else "") for n, (a, b) in r["variants"].items()]
        lines.append(f"| {r['rows']} | {r.get('variant', '')} | " + " | ".join(cells) + " |")
    lines += ["", f"## Dense site, shared expert, router (dense byte floor {meta['dense_floor_us']:.1f} µs)", "",
              "Every call here is eager, back to back, as a job's prefill runs it (the peers' too): where a call's "
              "device time is shorter than the host's launch work (the router and the shared expert, whose times stay "
              "flat over the widths), the column shows the host, not the device.", "",
              "| rows | dense glm_ep | HF `Glm5NextTextMLP` | floor / dense | dense, NVFP4 weights "
              "| NVFP4, grouped GEMM only | shared glm_ep | HF MLP (shared shape) | router glm_ep | torch router |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in w:
        lines.append(f"| {r['rows']} | {r['dense_us']:.1f} | {_f(r.get('hf_mlp_us'))} | "
                     f"{meta['dense_floor_us'] / r['dense_us']:.2f} | {_f(r.get('dense_nvfp4_us'))} | "
                     f"{_f(r.get('dense_nvfp4_gemm_us'))} | "
                     f"{r['shared_us']:.1f} | "
                     f"{_f(r.get('hf_shared_us'))} | "
                     f"{r['router_us']:.1f} | {_f(r.get('torch_router_us'))} |")
    lines += ["", f"## Crossover sweep: row groups vs grouped GEMM (sparse site) — crossover at "
                  f"**{meta['crossover']} rows**", "", *lever_advice(meta.get("crossover")),
              "| rows | row groups | grouped GEMM |", "|---:|---:|---:|"]
    for r in res["sweep"]:
        lines.append(f"| {r['rows']} | {r['union_us']:.1f} | {r['sorted_us']:.1f} |")
    if res.get("nvfp4_sweep"):
        floor = meta["nvfp4_dense_floor_us"]
        dq = meta.get("nvfp4_dequant_crossover")
        lines += ["", f"## Dense FFN stored NVFP4: row groups vs grouped GEMM — crossover at "
                      f"**{meta['nvfp4_crossover']} rows** (byte floor {floor:.1f} µs)"
                      + (f"; grouped GEMM vs bf16 weights (cuBLAS) — crossover at **{dq} rows**" if dq else ""), "",
                  *([f"One projection dequantized to bf16 ({meta['dequant_us']:.1f} µs, {meta['dequant_gbs']:.0f} "
                     f"GB/s read + written, {100 * meta['dequant_gbs'] / meta['copy_gbs']:.0f}% of copy) is the bf16 "
                     "path's pass; it runs three a call.", ""] if meta.get("dequant_us") else []),
                  "| rows | row groups | grouped GEMM, no K split | grouped GEMM, K split | dequantized to bf16, cuBLAS "
                  "| floor / best |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for r in res["nvfp4_sweep"]:
            keys = ("union_us", "sorted_nosplit_us", "sorted_us", "dequant_us")
            best = min(r[key] for key in keys if r.get(key) is not None)
            lines.append(f"| {r['rows']} | " + " | ".join(_f(r.get(key)) for key in keys) + f" | {floor / best:.2f} |")
    return "\n".join(lines) + "\n"


def plot(path: Path, meta: dict[str, Any], res: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    w = res["widths"]
    rows = [r["rows"] for r in w]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    series = (("sparse site", [("glm_ep", "sparse_us"), ("HF Glm5NextTextMoE (fastest)", "hf_moe_us"),
                               ("glm_ep routed GEMMs", None), ("torch._grouped_mm bf16 experts", "grouped_mm_us")]),
              ("dense site", [("glm_ep", "dense_us"), ("HF Glm5NextTextMLP", "hf_mlp_us")]))
    if w and "roof_floor_us" in w[0]:
        ax = axes[2]
        for label, key in (("glm_ep", "sparse_us"), ("HF Glm5NextTextMoE (fastest)", "hf_moe_us")):
            pts = [(r["rows"], 100 * r["roof_floor_us"] / r[key]) for r in w if r.get(key)]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 100)
        ax.set_xlabel("rows")
        ax.set_ylabel("% of roofline")
        ax.set_title("sparse site: % of roofline")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    for ax, (title, lines) in zip(axes, series):
        for label, key in lines:
            ys = ([r.get("stage_us", 0.0) + r["glu_us"] + r["down_us"] for r in w] if key is None
                  else [r.get(key) for r in w])
            pts = [(x, y) for x, y in zip(rows, ys) if y]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows")
        ax.set_ylabel("µs")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"glm-ep bench --prefill, {meta['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)

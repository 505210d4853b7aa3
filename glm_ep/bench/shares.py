"""``glm-ep bench --moe-tp N``: the one-row sparse site as each rank of a world of N runs its share, on ONE GPU.

Two layouts of the GLM-5.3-Flash sparse site over N ranks, the shared expert over tp = N in both: ``ep N``
(a rank holds E / N whole experts and runs the slots that land on it) and ``moe_tp N`` (a rank holds 1 / N of
every expert's width and runs every slot). Each rank's share is built on the GPU (random weights, as
``glm-ep bench``'s, each rank's own) over ``LAYERS`` layers of distinct weights and captured as one graph per
rank. For each of ``INPUTS`` seeded one-row inputs, every rank's graph is timed (CUDA events, the median of a
few replays); a decode step costs what its busiest rank takes, since the one all-reduce waits for it (the
all-reduce itself is not timed: the same bf16 ``[1, hidden]`` in both layouts). Reported per layout: the
busiest rank's and the mean rank's time per site, and the routed bytes a rank reads, mean and busiest
(``glm_ep.balance.counting``). Writes ``SHARES_<CARD>_<N>.md`` and ``shares_<card>_<N>.json`` into ``--out``
(named after the card: ``card_tag``).

Shape suffixes: T rows, H hidden, E experts, M an expert's width (a rank's slice of it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from glm_ep.balance.counting import ExpertLayout, Imbalance, expert_slice_bytes, rank_bytes
from glm_ep.bench.common import (bench_meta, bench_workspace, card_tag, copy_bandwidth, glm_model, gpu_bf16, gpu_dense,
                                 gpu_nvfp4, results_header, time_median)
from glm_ep.checkpoint.weights import ExpertWeights, MoeWeights
from glm_ep.config.model import ModelConfig, RankLayout, SiteConfig
from glm_ep.config.topology import PathLevers
from glm_ep.dist.comm import SelfComm
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.mlp.site import MoeSite

log = logging.getLogger(__name__)
LAYERS = 4  # layers of distinct weights a rank's graph sweeps (past the L2)
INPUTS = 32  # seeded one-row inputs


def _rank_sites(cp: Any, be: Any, model: ModelConfig, cfg: SiteConfig, routers: list[tuple[Any, Any]]) -> list[Any]:
    """One rank's share of each layer's sparse site (its experts, at its width; its shared slice)."""
    h, m, n = model.hidden_size, cfg.moe_intermediate, cfg.local_experts
    sites = []
    for router, bias in routers:
        experts = tuple(ExpertWeights(gpu_nvfp4(cp, m, h), gpu_nvfp4(cp, m, h), gpu_nvfp4(cp, h, m)) for _ in range(n))
        w = MoeWeights(router, bias, cfg.expert_start, experts, gpu_dense(cp, cfg.local_shared_intermediate, h))
        sites.append(MoeSite(be, SelfComm(), cfg, be.upload_moe(w, model.swiglu_limit),
                             ExpertDispatch.routed(be, cfg, PathLevers())))
    return sites


def _layout(cp: Any, be: Any, model: ModelConfig, world: int, ep: int, moe_tp: int, routers: list[tuple[Any, Any]],
            xs: list[Any], x_1H: Any) -> dict[str, Any]:
    """Every rank's time per site for each input (its share's graph), and the routed bytes it reads."""
    cfgs = [SiteConfig.for_rank(model, RankLayout(world, r, world, ep, moe_tp)) for r in range(world)]
    with be.stream:
        shares = [_rank_sites(cp, be, model, c, routers) for c in cfgs]
    ws = bench_workspace(be, cfgs[0], 1)  # (binds the backend's kernels' scratch, as a stack's workspace does)
    out = cp.empty_like(x_1H)

    def graph(sites: list[Any]) -> Any:
        def body() -> None:
            for s in sites:
                s(x_1H, ws, out)
        body()
        return be.capture(body)

    graphs = [graph(s) for s in shares]
    layout = ExpertLayout.contiguous(model.n_routed_experts, ep, moe_tp)
    slice_bytes = expert_slice_bytes(model.hidden_size, model.moe_intermediate_size, moe_tp)
    us_RI = np.zeros((world, len(xs)))
    routed = Imbalance()
    for i, x in enumerate(xs):
        be.copy(x, x_1H)
        for r, g in enumerate(graphs):
            us_RI[r, i] = time_median(cp, be.stream, g, iters=10, warmup=2, repeats=3) / len(routers)
        for s in shares[0]:  # the router is every rank's: the ids of rank 0's sites are the step's
            routed.add(rank_bytes(be.to_host(s.route(x_1H, ws).ids_TK), layout, slice_bytes))
    del graphs, shares
    cp.get_default_memory_pool().free_all_blocks()
    return {"busiest_us": float(us_RI.max(axis=0).mean()), "mean_us": float(us_RI.mean()),
            "busiest_mb": routed.busiest / 1e6, "mean_mb": routed.mean / 1e6, "per_rank_us": us_RI.mean(axis=1).tolist()}


def run_shares_bench(args: Any) -> int:
    import cupy as cp

    from glm_ep.backend.cuda import CudaBackend

    model, world = glm_model(), args.moe_tp
    be = CudaBackend(0)
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    copy_gbs = copy_bandwidth(cp, be.stream)
    e, h = model.n_routed_experts, model.hidden_size
    routers = [(gpu_bf16(cp, (e, h), h ** -0.5), (7.0 + 0.02 * cp.random.standard_normal(e, dtype=cp.float32))
                .astype(cp.float32)) for _ in range(LAYERS)]
    cp.cuda.get_current_stream().synchronize()
    xs = [gpu_bf16(cp, (1, h), 1.0) for _ in range(INPUTS)]
    x_1H = cp.empty((1, h), dtype=xs[0].dtype)
    results = {}
    for name, ep, moe_tp in ((f"ep {world}", world, 1), (f"moe_tp {world}", 1, world)):
        log.info("timing the per-rank shares of %s", name)
        results[name] = _layout(cp, be, model, world, ep, moe_tp, routers, xs, x_1H)
    meta = bench_meta(device, copy_gbs)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"shares_{card_tag(device)}_{world}"
    (out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, "layouts": results}, indent=2) + "\n")
    lines = results_header(f"glm-ep bench --moe-tp {world}: one-row sparse site per rank share", meta) + [
        "", f"Each rank's share of the GLM-5.3-Flash sparse site at world {world} (shared expert over tp = {world}), "
        f"timed alone on one GPU as a graph over {LAYERS} layers' distinct weights, {INPUTS} seeded one-row inputs; "
        "a step costs its busiest rank's time (the all-reduce, the same in both layouts, not timed).", "",
        "| layout | busiest rank µs / site | mean rank µs / site | busiest / mean | routed MB, busiest rank | "
        "routed MB, mean rank | per-rank mean µs |", "|---|---:|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['busiest_us']:.1f} | {r['mean_us']:.1f} | {r['busiest_us'] / r['mean_us']:.3f} | "
                     f"{r['busiest_mb']:.1f} | {r['mean_mb']:.1f} | "
                     f"{' / '.join(f'{v:.1f}' for v in r['per_rank_us'])} |")
    (out_dir / f"{stem.upper()}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0

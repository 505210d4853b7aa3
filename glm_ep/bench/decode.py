"""``glm-ep bench``: decode and verify at the GLM-5.3-Flash shape on the GPU, timed sites against the
measured copy bandwidth; writes BENCH_<CARD>.md, bench_<card>.json and bench_<card>.png (``card_tag``).

Shape suffixes: T rows, H hidden, E experts, M moe width, I dense width.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np

from glm_ep.bench.common import (BF16, backend_pdl, bench_backend, bench_meta, card_tag, copy_bandwidth, dense_bytes,
                                 dense_nvfp4_bytes, glm_model, gpu_bf16, gpu_dense, gpu_moe, gpu_nvfp4_site, pyplot,
                                 results_header, sparse_bytes, time_median, torch_time_us, world1_cfg)
from glm_ep.bench.stages import OpRecorder, stage_lines, stage_row
from glm_ep.dist.comm import SelfComm
from glm_ep.config.model import ModelConfig
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.mlp.site import DenseSite, MoeSite
from glm_ep.mlp.stack import MlpStack
from glm_ep.config.topology import PathLevers

log = logging.getLogger(__name__)


@dataclass
class Row:
    name: str
    median_us: float
    bytes_read: int
    copy_gbs: float
    note: str = ""

    @property
    def gbs(self) -> float:
        return self.bytes_read / (self.median_us * 1e-6) / 1e9

    @property
    def pct(self) -> float:
        return 100.0 * self.gbs / self.copy_gbs

    @property
    def floor_us(self) -> float:
        return self.bytes_read / (self.copy_gbs * 1e9) * 1e6


@dataclass
class Peers:
    """The PyTorch peers' times (us): the HF-style eager sites (``decode_peer``) and, where
    transformers' glm5_next imports, HF's own modules: ``hf_sparse[rows]`` is
    ``prefill_peer.hf_moe_fastest`` at 1..8 rows (the fastest experts implementation and its time)."""

    style_sparse: float
    style_dense: float
    hf_sparse: dict[int, dict[str, Any]]
    hf_dense: float | None
    note: str = ""

    @property
    def fastest_sparse(self) -> float:
        """The fastest peer's sparse site at 1 row."""
        hf = self.hf_sparse.get(1)
        return min(self.style_sparse, hf["hf_moe_us"]) if hf else self.style_sparse

    @property
    def fastest_dense(self) -> float:
        return min(self.style_dense, self.hf_dense or self.style_dense)

    def hf_ratio(self, rows: int, us: float) -> str:
        r = self.hf_sparse.get(rows)
        if not r:
            return ""
        return f"HF Glm5NextTextMoE ({r['hf_moe_best']}) {r['hf_moe_us']:.0f} us: {r['hf_moe_us'] / us:.1f}x"


def _peers(model: ModelConfig, iters: int) -> Peers | None:
    """None without torch."""
    try:
        import torch
    except ImportError:
        return None
    from glm_ep.bench import prefill_peer as P
    from glm_ep.bench.decode_peer import HfStyleMlp, HfStyleMoe

    n = max(iters // 10, 5)
    x = torch.randn(8, model.hidden_size, device="cuda", dtype=torch.bfloat16)
    times = []
    for make in (lambda: HfStyleMoe(model), lambda: HfStyleMlp(model, model.intermediate_size)):
        peer = make()
        times.append(torch_time_us(partial(peer, x[:1]), iters=n, warmup=5))
        del peer
        torch.cuda.empty_cache()
    why = P.hf_available()
    if why:
        return Peers(times[0], times[1], {}, None, f"HF transformers' glm5_next is not importable here ({why})")
    moe = P.hf_moe(model)
    hf_sparse = {rows: P.hf_moe_fastest(moe, x[:rows], n) for rows in range(1, 9)}
    del moe
    mlp = P.hf_mlp(model, model.intermediate_size)
    hf_dense = torch_time_us(partial(mlp, x[:1]), iters=n, warmup=5)
    del mlp
    torch.cuda.empty_cache()
    return Peers(times[0], times[1], hf_sparse, hf_dense)


def run_bench(args: argparse.Namespace) -> int:
    import cupy as cp

    model, iters = glm_model(), args.iters
    peer = _peers(model, iters) if args.peer else None
    be = bench_backend(args.levers, 8)
    stream = be.stream
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    copy_gbs = copy_bandwidth(cp, stream)
    log.info("copy bandwidth %.0f GB/s", copy_gbs)
    cfg = world1_cfg(model)
    comm, levers = SelfComm(), args.levers
    dispatch = ExpertDispatch.routed(be, cfg, levers)

    per_sparse = sparse_bytes(model, model.n_routed_experts)
    free, _ = cp.cuda.runtime.memGetInfo()
    n_dense = len(model.dense_layers)
    budget = free * 0.9 - 2 * n_dense * dense_bytes(model) - (2 << 30)  # bf16 dense sites, then NVFP4 ones
    n_sparse = max(1, min(len(model.sparse_layers), int(budget // per_sparse)))
    if args.layers:
        n_sparse = max(1, min(n_sparse, args.layers - n_dense))
    log.info("building %d dense + %d sparse layers on the GPU", n_dense, n_sparse)
    with stream:
        dense_sites = [DenseSite(be, comm, cfg, be.upload_dense(gpu_dense(cp, model.intermediate_size,
                                                                             model.hidden_size)))
                       for _ in range(n_dense)]
        sparse_sites = [MoeSite(be, comm, cfg, be.upload_moe(gpu_moe(cp, model), model.swiglu_limit), dispatch)
                        for _ in range(n_sparse)]
    stack = MlpStack(be, comm, cfg, dense_sites + sparse_sites, levers, max_rows=8)
    ws = stack.workspaces[0]  # the sites' graphs below use the stack's workspace (and its backend scratch)
    out = cp.empty((8, model.hidden_size), dtype=BF16)
    rows: list[Row] = []

    def graph_of_sites(sites: list[Any], x_TH: Any) -> Any:
        def body() -> None:
            for s in sites:
                s(x_TH, ws, out[: x_TH.shape[0]])
        body()  # warm-up outside the capture
        return be.capture(body)

    def union_sizes(x_TH: Any) -> list[int]:
        sizes = []
        for s in sparse_sites:
            ids_TK = s.route(x_TH, ws).ids_TK
            sizes.append(len(np.unique(be.to_host(ids_TK))))
        return sizes

    g = min(len(sparse_sites), 16)
    stages_of = _stage_timer(be, model, cfg, levers, sparse_sites[:g], ws, out, iters)
    x1 = gpu_bf16(cp, (1, model.hidden_size), 1.0)
    replay = graph_of_sites(sparse_sites[:g], x1)
    us = time_median(cp, stream, replay, iters=max(iters // g, 5)) / g
    stages = [stages_of(x1, us)]
    rows.append(Row("sparse site, 1 row (graph)", us, sparse_bytes(model, model.num_experts_per_tok), copy_gbs,
                    f"mean over {g} layers' distinct weights"))
    if peer is not None:
        rows.append(Row("PyTorch HF-style sparse site, 1 row", peer.style_sparse, sparse_bytes(model, 8), copy_gbs,
                        f"peer (bf16 experts, eager loop); glm_ep is {peer.style_sparse / us:.1f}x faster"))
        if 1 in peer.hf_sparse:
            best = peer.hf_sparse[1]
            rows.append(Row(f"HF Glm5NextTextMoE ({best['hf_moe_best']}), 1 row", best["hf_moe_us"],
                            sparse_bytes(model, 8), copy_gbs,
                            f"peer (bf16 experts; the fastest experts implementation); glm_ep is "
                            f"{best['hf_moe_us'] / us:.1f}x faster"))
        elif peer.note:
            log.warning("%s", peer.note)
    replay = graph_of_sites(dense_sites, x1)
    us = time_median(cp, stream, replay, iters=max(iters // n_dense, 5)) / n_dense
    rows.append(Row("dense site, 1 row (graph)", us, dense_bytes(model), copy_gbs))
    if peer is not None:
        rows.append(Row("PyTorch HF-style dense site, 1 row", peer.style_dense, dense_bytes(model), copy_gbs,
                        f"peer (eager); glm_ep is {peer.style_dense / us:.1f}x faster"))
        if peer.hf_dense is not None:
            rows.append(Row("HF Glm5NextTextMLP, 1 row", peer.hf_dense, dense_bytes(model), copy_gbs,
                            f"peer (eager); glm_ep is {peer.hf_dense / us:.1f}x faster"))
    rows += _nvfp4_dense_rows(be, cfg, model, levers, n_dense, graph_of_sites, x1, iters, copy_gbs)
    for k in range(2, 9):
        xk = gpu_bf16(cp, (k, model.hidden_size), 1.0)
        sizes = union_sizes(xk)[:g]
        replay = graph_of_sites(sparse_sites[:g], xk)
        us = time_median(cp, stream, replay, iters=max(iters // g, 5)) / g
        union = float(np.mean(sizes))
        nbytes = int(np.mean([sparse_bytes(model, u) for u in sizes]))
        note = f"union of chosen experts {union:.1f}"
        if peer is not None and k in peer.hf_sparse:
            note += f"; {peer.hf_ratio(k, us)} faster"
        rows.append(Row(f"verify {k} rows, sparse site (graph)", us, nbytes, copy_gbs, note))
        stages.append(stages_of(xk, us))
    launch = _launch_cost(be, iters)
    step_bytes = n_dense * dense_bytes(model) + n_sparse * sparse_bytes(model, model.num_experts_per_tok)
    stack.step(x1)  # captures the decode graph
    us = time_median(cp, stream, lambda: stack.step(x1), iters=max(iters // 10, 5))
    note = f"{n_dense} dense + {n_sparse} sparse sites, residual adds"
    if peer is not None:
        peer_step = n_dense * peer.fastest_dense + n_sparse * peer.fastest_sparse
        note += f"; the fastest peer sites add up to {peer_step / 1e3:.1f} ms: {peer_step / us:.1f}x slower"
    rows.append(Row(f"decode step, {n_dense + n_sparse}-layer stack", us, step_bytes, copy_gbs, note))
    if be.pdl:  # the same sites captured with plain launches: what programmatic dependent launch saves
        with backend_pdl(be, False):
            plain = MlpStack(be, comm, cfg, dense_sites + sparse_sites, levers, max_rows=8)
            plain.step(x1)
            us_plain = time_median(cp, stream, lambda: plain.step(x1), iters=max(iters // 10, 5))
        rows.append(Row(f"decode step, {n_dense + n_sparse}-layer stack, plain launches", us_plain, step_bytes,
                        copy_gbs, f"the same step captured without programmatic dependent launch (levers.pdl = "
                        f"false): {us_plain / us:.3f}x the time"))
    out_dir = Path(args.out)
    stem = write_results(out_dir, rows, bench_meta(device, copy_gbs, args.levers_note), stages, launch)
    plot_results(out_dir / f"{stem}.json")
    print((out_dir / f"{stem.upper()}.md").read_text())
    return 0


def _stage_timer(be: Any, model: ModelConfig, cfg: Any, levers: PathLevers, sites: list[Any], ws: Any, out: Any,
                 iters: int) -> Callable[[Any, float], dict[str, Any]]:
    """``stages_of(x, site_us)``: the stages of ``sites`` called on ``x`` (``stages.OpRecorder``), each (and each of
    its parts) replayed alone over the same sites as a graph, µs a layer, with its bytes, beside ``site_us``, the
    sites' graph time on ``x``."""
    import cupy as cp

    rec = OpRecorder(be)
    recorded = [replace(s, be=rec, experts=ExpertDispatch.routed(rec, cfg, levers)) for s in sites]

    def stages_of(x: Any, site_us: float) -> dict[str, Any]:
        o = out[:x.shape[0]]
        records = [rec.record(lambda s=s: s(x, ws, o)) for s in recorded]

        def timed(calls: list[Callable[[], Any]]) -> float:  # one call of every site, replayed as one graph
            def body() -> None:
                for call in calls:
                    call()
            body()  # warm-up outside the capture
            return time_median(cp, be.stream, be.capture(body), iters=max(iters // len(sites), 5)) / len(sites)

        return stage_row(model, be, x.shape[0], records, site_us, timed)

    return stages_of


def _launch_cost(be: Any, iters: int, launches: int = 64) -> dict[str, Any]:
    """µs a launch of the smallest kernel (a 1 x 8 bf16 add), ``launches`` of them in one graph, with and without
    programmatic dependent launch (as the backend launches every kernel)."""
    import cupy as cp

    a, b = cp.ones((1, 8), dtype=BF16), cp.empty((1, 8), dtype=BF16)
    res: dict[str, Any] = {"launches": launches, "dependent_us": None}
    for key, on in (("dependent_us", True), ("plain_us", False)) if be.pdl else (("plain_us", False),):
        with backend_pdl(be, on):

            def body() -> None:
                for _ in range(launches):
                    be.add(a, a, b)
            body()
            res[key] = time_median(cp, be.stream, be.capture(body), iters=max(iters // 10, 5)) / launches
    return res


def _nvfp4_dense_rows(be: Any, cfg: Any, model: ModelConfig, levers: PathLevers, n_dense: int, graph_of_sites: Any,
                      x1: Any, iters: int, copy_gbs: float) -> list[Row]:
    """The dense site with its FFN stored NVFP4 (as nvidia/GLM-5.3-Flash-NVFP4 ships layers 0-2): one expert that
    every row chooses, on the routed kernels: the decode ring (no K split: 768 items for gate + up and 256 of full
    K = 12288 for down at tp = 1), and the block kernels (K split over a block's warps) on a second backend
    sharing the stream."""
    import cupy as cp

    from glm_ep.backend.cuda import CudaBackend

    nbytes = dense_nvfp4_bytes(model)
    blocks = CudaBackend(0, replace(be.ring, enabled=False), stream=be.stream, dependent_launch=be.pdl)
    out: list[Row] = []
    for label, b in (("", be), (", block kernels", blocks)):
        with be.stream:
            sites = [gpu_nvfp4_site(b, SelfComm(), cfg, model, levers) for _ in range(n_dense)]
        replay = graph_of_sites(sites, x1)
        us = time_median(cp, be.stream, replay, iters=max(iters // n_dense, 5)) / n_dense
        out.append(Row(f"dense site, NVFP4 weights{label}, 1 row (graph)", us, nbytes, copy_gbs,
                       "the dense FFN stored NVFP4, run as one routed expert"))
        del sites
    return out


def write_results(out_dir: Path, rows: list[Row], meta: dict[str, Any], stages: list[dict[str, Any]] | None = None,
                  launch: dict[str, Any] | None = None) -> str:
    """Writes ``bench_<card>.json`` and ``BENCH_<CARD>.md`` into ``out_dir``; returns the stem (``bench_<card>``).
    ``stages`` / ``launch``: where the sparse site's time goes (``_stage_timer``, ``_launch_cost``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{card_tag(meta['device'])}"
    data = {"meta": meta, "rows": [dict(r.__dict__, gbs=r.gbs, pct=r.pct, floor_us=r.floor_us) for r in rows],
            "stages": stages or [], "launch": launch}
    (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = results_header("glm-ep bench", meta) + [
        "", "At 1..8 rows a site's byte floor is its roofline: its FLOPs at the bf16 GEMM rate take about 2% of it "
        "or less, so % of copy bandwidth is % of roofline. Bytes: the union of the experts the rows chose, each read "
        "once.",
        "", "| what | median µs | bytes read (MB) | byte floor µs | GB/s | % of copy bw (of roofline) | note |",
        "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.median_us:.1f} | {r.bytes_read / 1e6:.1f} | {r.floor_us:.1f} | "
                     f"{r.gbs:.0f} | {r.pct:.1f} | {r.note} |")
    lines += stage_lines(stages or [], launch, meta["copy_gbs"])
    (out_dir / f"{stem.upper()}.md").write_text("\n".join(lines) + "\n")
    return stem


def plot_results(results: Path) -> Path | None:
    """PNG of % of copy bandwidth per path beside ``results`` (a ``bench_<card>.json``; matplotlib, if installed)."""
    plt = pyplot()
    if plt is None:
        return None
    data = json.loads(results.read_text())
    rows = [r for r in data["rows"] if r["bytes_read"] > 0]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    ax.barh([r["name"] for r in rows][::-1], [r["pct"] for r in rows][::-1], color="#4477aa")
    ax.axvline(100, color="k", lw=0.8)
    ax.set_xlabel(f"% of measured copy bandwidth ({data['meta']['copy_gbs']:.0f} GB/s)")
    ax.set_title(f"glm-ep bench, {data['meta']['device']}")
    fig.tight_layout()
    path = results.with_suffix(".png")
    fig.savefig(path, dpi=120)
    return path

"""``glm-ep bench``: GPU figures at the GLM-5.3-Flash shape, against the measured copy bandwidth.

Synthetic weights are generated directly on the GPU (no disk). Every figure is the median over
repeated timed runs after warm-up, with CUDA events on the backend's stream; each timed region
walks several layers' DISTINCT weights so a site's bytes cannot be served from L2 (60 MB).
Bytes are the fewest the site must read: the chosen (union of) experts' NVFP4 bytes, the
bf16 shared expert, the router; a dense site its three bf16 matrices.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from glm_ep.config import ModelConfig, RankLayout, SiteConfig
from glm_ep.errors import ConfigError
from glm_ep.footprint import nvfp4_bytes
from glm_ep.presets import preset

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


def time_median(cp: Any, stream: Any, fn: Callable[[], None], iters: int, warmup: int = 10,
                repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls, in microseconds."""
    for _ in range(warmup):
        fn()
    stream.synchronize()
    per_call = []
    for _ in range(repeats):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(iters):
            fn()
        end.record(stream)
        end.synchronize()
        per_call.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / iters)
    return statistics.median(per_call)


def copy_bandwidth(cp: Any, stream: Any, nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, counting bytes read plus bytes written, in GB/s."""
    with stream:
        src = cp.empty(nbytes // 4, dtype=cp.float32)
        src.fill(1.0)
        dst = cp.empty_like(src)
    us = time_median(cp, stream, lambda: cp.cuda.runtime.memcpyAsync(
        dst.data.ptr, src.data.ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr), iters=10)
    return 2 * nbytes / (us * 1e-6) / 1e9


def expert_bytes(model: ModelConfig) -> int:
    h, m = model.hidden_size, model.moe_intermediate_size
    return 2 * nvfp4_bytes(m, h) + nvfp4_bytes(h, m)


def sparse_bytes(model: ModelConfig, n_experts: int) -> int:
    h, e = model.hidden_size, model.n_routed_experts
    shared = 3 * model.shared_intermediate * h * 2
    return n_experts * expert_bytes(model) + shared + e * h * 2 + e * 4


def dense_bytes(model: ModelConfig) -> int:
    return 3 * model.intermediate_size * model.hidden_size * 2


def require_gpu() -> None:
    """Refuse, with what is missing, unless CuPy imports and sees a CUDA GPU."""
    try:
        import cupy
    except ImportError as e:
        raise ConfigError(f"glm-ep bench needs CuPy and a CUDA GPU, but CuPy does not import ({e}); install "
                          "it: pip install 'glm_ep[cuda12]' (or [cuda13])") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError without a driver or device
        raise ConfigError(f"glm-ep bench needs a CUDA GPU, but CUDA reports none ({e})") from None
    if count < 1:
        raise ConfigError("glm-ep bench needs a CUDA GPU, but CUDA reports 0 devices "
                          "(check CUDA_VISIBLE_DEVICES and the driver)")


def bench_job(args: argparse.Namespace, mpi_comm: Any) -> int:
    if mpi_comm.Get_size() != 1:
        raise ConfigError(f"glm-ep bench runs on one rank (world 1), got {mpi_comm.Get_size()}")
    require_gpu()
    if args.prefill:
        from glm_ep.bench.prefill import run_prefill_bench  # needs CuPy

        return run_prefill_bench(args)
    from glm_ep.bench.decode import run_bench  # needs CuPy

    return run_bench(args)


def write_results(out_dir: Path, rows: list[Row], meta: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "rows": [dict(r.__dict__, gbs=r.gbs, pct=r.pct, floor_us=r.floor_us) for r in rows]}
    (out_dir / "bench.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = [f"# glm-ep bench: {meta['device']}", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['date']}  ",
             f"Measured copy bandwidth (read + write): **{meta['copy_gbs']:.0f} GB/s**", "",
             "| what | median µs | bytes read (MB) | byte floor µs | GB/s | % of copy bw | note |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.median_us:.1f} | {r.bytes_read / 1e6:.1f} | {r.floor_us:.1f} | "
                     f"{r.gbs:.0f} | {r.pct:.1f} | {r.note} |")
    (out_dir / "BENCH.md").write_text("\n".join(lines) + "\n")


def plot_results(out_dir: Path) -> Path | None:
    """PNG of % of copy bandwidth per path, from ``bench.json`` (matplotlib, if installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed: no plot (pip install glm_ep[bench])")
        return None
    data = json.loads((out_dir / "bench.json").read_text())
    rows = [r for r in data["rows"] if r["bytes_read"] > 0]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    ax.barh([r["name"] for r in rows][::-1], [r["pct"] for r in rows][::-1], color="#4477aa")
    ax.axvline(100, color="k", lw=0.8)
    ax.set_xlabel(f"% of measured copy bandwidth ({data['meta']['copy_gbs']:.0f} GB/s)")
    ax.set_title(f"glm-ep bench, {data['meta']['device']}")
    fig.tight_layout()
    path = out_dir / "bench.png"
    fig.savefig(path, dpi=120)
    return path


def bench_meta(device: str, copy_gbs: float) -> dict[str, Any]:
    import datetime

    return {"device": device, "copy_gbs": copy_gbs, "command": "glm-ep " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version()}


def glm_model() -> ModelConfig:
    return ModelConfig.from_dict(preset("glm-5.3-flash"), source="preset glm-5.3-flash")


def world1_cfg(model: ModelConfig) -> SiteConfig:
    return SiteConfig.for_rank(model, RankLayout(1, 0, 1, 1))


if __name__ == "__main__":  # re-plot an existing results folder
    print(plot_results(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/perf")))

"""What ``glm-ep bench`` (decode, verify) and ``glm-ep bench --prefill`` share: CUDA-event timing (CuPy,
and PyTorch for the peers), the measured copy bandwidth, the bytes a site must read, the run's
metadata and the results files' header, the plot module, the GLM-5.3-Flash shape at world 1 and
synthetic weights made on the GPU. Imports neither CuPy, PyTorch nor matplotlib at import: the
callers pass their ``cupy`` module in.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import ml_dtypes
import numpy as np

from glm_ep.config.model import ModelConfig, RankLayout, SiteConfig
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.app.footprint import nvfp4_bytes
from glm_ep.checkpoint.nvfp4 import Nvfp4Weight
from glm_ep.config.presets import preset
from glm_ep.mlp.site import Nvfp4DenseSite, site_buffers
from glm_ep.mlp.workspace import Workspace, workspace_pool
from glm_ep.config.topology import PathLevers
from glm_ep.checkpoint.weights import DenseWeights, ExpertWeights, MoeWeights

log = logging.getLogger(__name__)
BF16 = ml_dtypes.bfloat16


_SPIN = r'''
extern "C" __global__ void bench_spin(unsigned long long ns) {  // holds the stream for ns nanoseconds
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}'''
_FLUSH = r'''
extern "C" __global__ void bench_flush(const uint4* __restrict__ p, unsigned long long n, unsigned* sink) {
    // reads p[0 .. n) through the L2 and writes nothing (unless the words' XOR is one value: the reads stay live)
    unsigned acc = 0u;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const uint4 v = __ldcg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) *sink = acc;
}'''
FLUSH_BYTES = 256 << 20  # read before each timed call: past the L2 of every lent card (50-60 MB)
SETTLE_S = 1.0  # settle()'s idle before a width's single-call timings
HOLD_MAX_US = 1e6  # time_gpu_us doubles its hold up to this (a call the host queues in over a second: timed as is)


def hold_stream(cp: Any, ns: float, stream: Any = None) -> None:
    """Queue a one-thread kernel that keeps ``stream`` (default: CuPy's current one) busy for ``ns`` nanoseconds of
    the global timer: what is queued behind it waits, whatever the host does meanwhile."""
    cp.RawKernel(_SPIN, "bench_spin")((1,), (1,), (np.uint64(ns),), stream=stream)


def flush_l2(cp: Any, buf: Any, stream: Any = None) -> None:
    """Queue a kernel that reads all of ``buf`` (a device array of a multiple of 16 bytes; FLUSH_BYTES passes every
    lent card's L2) on ``stream`` (default: CuPy's current one) and writes none of it: the L2 ends up holding
    ``buf``'s clean lines, so the next kernel reads its own bytes from HBM with nothing dirty to write back first.
    Filling the buffer instead leaves the L2 full of dirty lines, whose write-back the next kernel would pay (about
    50 MB, 17 µs of an H100's copy bandwidth)."""
    n = buf.nbytes // 16
    cp.RawKernel(_FLUSH, "bench_flush")((1024,), (256,), (buf, np.uint64(n), buf), stream=stream)


def time_gpu_us(cp: Any, stream: Any, fn: Callable[[], None], repeats: int = 5, warmup: int = 2,
                hold_us: float = 3000.0) -> float:
    """Median over ``repeats`` of ONE call's GPU time, in µs, as a full site would run it: the host's launch cost
    held out (a spin kernel keeps ``stream`` busy for ``hold_us`` while the call is queued, so the start event fires
    when the call's first kernel can start) and the L2 flushed before it (``flush_l2``: FLUSH_BYTES read outside the
    timed window, so the call's weights come from HBM, as after the routed experts' GEMMs, with no dirty line of the
    flush's to write back). ``fn`` must queue its work on
    ``stream`` (a backend's ops do: the backend's stream). Where the host took longer to queue the call than the
    hold, the hold is doubled and the call timed again (up to ``HOLD_MAX_US``, past which it is timed as it is and
    a warning says so)."""
    flush = cp.empty(FLUSH_BYTES, dtype=cp.uint8)
    with stream:
        for _ in range(warmup):
            fn()
        per_call: list[float] = []
        while len(per_call) < repeats:
            start, end = cp.cuda.Event(), cp.cuda.Event()
            hold_stream(cp, hold_us * 1e3, stream)
            flush_l2(cp, flush, stream)
            start.record(stream)
            fn()
            held = not start.done  # the stream was still busy when the whole call had been queued
            end.record(stream)
            end.synchronize()
            if not held and hold_us < HOLD_MAX_US:
                hold_us *= 2
                log.info("time_gpu_us: the call took the host past the hold; holding %.0f us", hold_us)
                continue
            if not held:
                log.warning("time_gpu_us: the host took over %.0f us to queue one call; its time includes the host's",
                            hold_us)
            per_call.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return statistics.median(per_call)


@contextlib.contextmanager
def backend_pdl(be: Any, on: bool) -> Iterator[None]:
    """Inside the block the backend launches its kernels as programmatic dependents only if ``on`` (its ``pdl`` set
    to ``on``, then back to what it was, also where the block raises)."""
    was = be.pdl
    be.pdl = on
    try:
        yield
    finally:
        be.pdl = was


def with_plain_launches(be: Any, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` with the backend's kernels launched plain, not as programmatic dependents (``backend_pdl`` off for
    each call)."""

    def call() -> None:
        with backend_pdl(be, False):
            fn()

    return call


def settle(stream: Any, seconds: float = SETTLE_S) -> None:
    """Let the card idle ``seconds`` once ``stream`` has drained. A sustained run of back-to-back calls leaves the
    SM clock lowered for a while (one H100, 2026-12-07: 1815-1890 MHz right after the prefill site's, 1980 after
    3 s idle), and single calls timed right after it came out 1-5% slower than the same calls after the idle
    (docs/perf/runs/2026-12-07-pdl-order/)."""
    stream.synchronize()
    time.sleep(seconds)


def alternating_gpu_us(cp: Any, stream: Any, fns: Sequence[Callable[[], None]], rounds: int = 6,
                       warmup: int = 1) -> list[float]:
    """The median ONE-call GPU time (``time_gpu_us``) of each of ``fns``, timed in ``rounds`` rounds of one call
    each whose order turns every round (round r starts with ``fns[r % len(fns)]``): whatever drifts over the run,
    the card's clock settling after a sustained load among it, weighs on each of them alike."""
    with stream:
        for fn in fns:
            for _ in range(warmup):
                fn()
    per_fn: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for j in range(len(fns)):
            i = (r + j) % len(fns)
            per_fn[i].append(time_gpu_us(cp, stream, fns[i], repeats=1, warmup=0))
    return [statistics.median(t) for t in per_fn]


def site_and_plain_us(cp: Any, stream: Any, be: Any, call: Callable[[], None]) -> tuple[float, float | None]:
    """One call's GPU time of ``call`` and, where the backend launches its kernels as programmatic dependents, of
    the same call with them launched plain, the two timed alternately (``alternating_gpu_us``); None for the second
    where the backend launches plain anyway."""
    if not getattr(be, "pdl", False):
        return alternating_gpu_us(cp, stream, [call])[0], None
    site_us, plain_us = alternating_gpu_us(cp, stream, [call, with_plain_launches(be, call)])
    return site_us, plain_us


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


def graph_median_us(cp: Any, stream: Any, capture: Callable[[Callable[[], None]], Callable[[], None]],
                    fn: Callable[[], None], iters: int, per: int = 1) -> float:
    """``fn`` captured as one CUDA graph (``capture``: a backend's) and replayed ``iters`` times after a
    warm-up call and a warm-up replay: the median replay time divided by ``per`` (e.g. the layers it
    sweeps), in microseconds."""
    fn()
    graph = capture(fn)
    return time_median(cp, stream, graph, 1, warmup=1, repeats=iters) / per  # each replay timed alone


def torch_time_us(fn: Callable[[], Any], iters: int, warmup: int = 3, repeats: int = 7) -> float:
    """``time_median`` for the PyTorch peers: the median over ``repeats`` of the mean of ``iters``
    calls, with torch's CUDA events on its current stream, under ``no_grad``; microseconds."""
    import torch

    with torch.no_grad():
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(times)


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


def sparse_flops(model: ModelConfig, rows: int) -> int:
    """Multiply-add FLOPs (2 a product) of one sparse site over ``rows`` rows: the router, top_k routed experts a
    row (gate, up, down) and the shared expert."""
    h, m, k, e = model.hidden_size, model.moe_intermediate_size, model.num_experts_per_tok, model.n_routed_experts
    return 2 * rows * h * (e + 3 * k * m + 3 * model.shared_intermediate)


@dataclass(frozen=True)
class Roofline:
    """The floor of one call: the larger of its bytes over the copy bandwidth and its FLOPs over the bf16 GEMM rate
    (None where no rate was measured: the byte floor alone)."""

    experts: int  # the routed experts whose weights the call reads (the union of its choices)
    bytes_read: int
    flops: int
    byte_floor_us: float
    flop_floor_us: float | None

    @property
    def floor_us(self) -> float:
        return max(self.byte_floor_us, self.flop_floor_us or 0.0)

    @property
    def bound(self) -> str:
        return "FLOPs" if (self.flop_floor_us or 0.0) > self.byte_floor_us else "bytes"

    def pct(self, us: float | None) -> float | None:
        """% of the roofline a call of ``us`` reaches (100: at its floor)."""
        return None if not us else 100.0 * self.floor_us / us


def sparse_roofline(model: ModelConfig, ids_TK: np.ndarray, copy_gbs: float, bf16_tflops: float | None) -> Roofline:
    """The sparse site's roofline on one call's routing ``ids_TK`` (host int array ``[T, K]``): the weights of the
    UNION of experts the call chose (each read once), the shared expert and the router, plus the activations read and
    written (``x`` in, the output out, bf16)."""
    rows, union = ids_TK.shape[0], len(np.unique(ids_TK))
    nbytes = sparse_bytes(model, union) + 2 * rows * model.hidden_size * 2
    flops = sparse_flops(model, rows)
    return Roofline(union, nbytes, flops, nbytes / (copy_gbs * 1e9) * 1e6,
                    flops / (bf16_tflops * 1e12) * 1e6 if bf16_tflops else None)


def cupy_gemm_tflops(cp: Any, stream: Any, n: int = 8192) -> float:
    """The bf16 GEMM rate of this device through CuPy (cuBLAS, fp32 accumulation), an ``n``-cube product, queued on
    ``stream``, the stream ``time_median`` records its events on (on CuPy's current stream instead, the events would
    time an empty stretch of ``stream``)."""
    with stream:
        a = cp.ones((n, n), dtype=BF16)
        b = cp.ones((n, n), dtype=BF16)
        c = cp.empty((n, n), dtype=BF16)

    def product() -> None:
        with stream:
            cp.matmul(a, b, out=c)

    us = time_median(cp, stream, product, iters=5, warmup=2, repeats=5)
    return 2 * n ** 3 / (us * 1e-6) / 1e12


def dense_bytes(model: ModelConfig) -> int:
    return 3 * model.intermediate_size * model.hidden_size * 2


def dense_nvfp4_bytes(model: ModelConfig) -> int:
    """The dense FFN stored NVFP4 (nvidia/GLM-5.3-Flash-NVFP4's layers 0-2)."""
    h, width = model.hidden_size, model.intermediate_size
    return 2 * nvfp4_bytes(width, h) + nvfp4_bytes(h, width)


def card_tag(device: str) -> str:
    """The card a device name stands for, as results files name it: ``NVIDIA H100 80GB HBM3`` -> ``h100``,
    ``NVIDIA H200`` -> ``h200``, ``NVIDIA GB10`` -> ``gb10`` (the first word after the vendor's)."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", device) if w and w.upper() != "NVIDIA"]
    return words[0].lower() if words else "gpu"


def bench_meta(device: str, copy_gbs: float, levers: str = "") -> dict[str, Any]:
    """``levers``: how the timed sites' levers are named (``bench_levers``); empty where a run sets its own."""
    import datetime

    meta = {"device": device, "copy_gbs": copy_gbs, "command": "glm-ep " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version()}
    return {**meta, "levers": levers} if levers else meta


def results_header(title: str, meta: dict[str, Any], rates: str = "") -> list[str]:
    """The first lines of a results file: what and where, the command, the date, the levers where the run
    names them, the measured copy bandwidth (``rates`` continues that line)."""
    levers = [f"Levers: {meta['levers']}  "] if meta.get("levers") else []
    return [f"# {title}: {meta['device']}", "", f"Command: `{meta['command']}`  ", f"Date: {meta['date']}  ",
            *levers, f"Measured copy bandwidth (read + write): **{meta['copy_gbs']:.0f} GB/s**{rates}"]


def bench_backend(levers: PathLevers, rows: int) -> Any:
    """The CUDA backend a one-rank job with ``levers`` and a workspace of ``rows`` rows builds on device 0, with the
    checks that job's ``glm_ep.backend.make_backend`` makes."""
    from glm_ep.backend import check_cuda_device, cuda_ring
    from glm_ep.backend.cuda import CudaBackend

    cfg = world1_cfg(glm_model())
    ring = cuda_ring(levers, cfg)
    be = CudaBackend(0, ring, dependent_launch=levers.pdl)
    check_cuda_device(ring, levers, cfg, rows)
    return be


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files, or None (with a warning) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed: no plot (the bench extra: pip install '.[bench]')")
        return None
    return plt


def glm_model() -> ModelConfig:
    return ModelConfig.from_dict(preset("glm-5.3-flash"), source="preset glm-5.3-flash")


def world1_cfg(model: ModelConfig) -> SiteConfig:
    return SiteConfig.for_rank(model, RankLayout(1, 0, 1, 1))


def _ready(cp: Any, a: Any) -> Any:
    """``a``, made on CuPy's current stream, complete: the backend's ops run on its own stream,
    which nothing orders after the current one."""
    cp.cuda.get_current_stream().synchronize()
    return a


def gpu_bf16(cp: Any, shape: tuple[int, ...], std: float) -> Any:
    return _ready(cp, (cp.random.standard_normal(shape, dtype=cp.float32) * std).astype(BF16))


def gpu_nvfp4(cp: Any, n: int, k: int) -> Nvfp4Weight:
    packed = cp.random.randint(0, 256, size=(n, k // 2), dtype=cp.int32).astype(cp.uint8)
    # E4M3 bytes 0x30..0x3b: block scales in [0.5, 1.375], never NaN
    scale = cp.random.randint(0x30, 0x3C, size=(n, k // 16), dtype=cp.int32).astype(cp.uint8)
    return Nvfp4Weight(packed, _ready(cp, scale), 1.0 / (6.0 * 64.0))


def gpu_dense(cp: Any, width: int, h: int) -> DenseWeights:
    return DenseWeights(gpu_bf16(cp, (width, h), h ** -0.5), gpu_bf16(cp, (width, h), h ** -0.5),
                        gpu_bf16(cp, (h, width), width ** -0.5))


def bench_workspace(be: Any, cfg: SiteConfig, rows: int) -> Workspace:
    """One workspace of ``rows`` rows for the benches' sites on ``be`` (its kernels' scratch bound to it), with
    every buffer the benches' lever sets may use: a dense FFN stored NVFP4 included, its dequant path and the
    grouped GEMM's sort from the first prefill width."""
    levers = PathLevers(prefill_gemm_min_rows=9, nvfp4_dense_dequant_min_rows=9)
    return workspace_pool(be, (*site_buffers(cfg, levers, nvfp4_dense=True), *be.buffers(cfg, levers)), rows, 1,
                          True)[0]


def gpu_nvfp4_site(be: Any, comm: Any, cfg: SiteConfig, model: ModelConfig, levers: PathLevers) -> Nvfp4DenseSite:
    """A dense site whose FFN is stored NVFP4 (nvidia/GLM-5.3-Flash-NVFP4's layers 0-2), random weights made on the
    GPU: one expert that every row chooses."""
    import cupy as cp

    h, width = model.hidden_size, model.intermediate_size
    w = ExpertWeights(gpu_nvfp4(cp, width, h), gpu_nvfp4(cp, width, h), gpu_nvfp4(cp, h, width))
    return Nvfp4DenseSite(be, comm, cfg, be.upload_experts((w,), 0, model.swiglu_limit, what="dense mlp"),
                          ExpertDispatch.nvfp4_dense(be, cfg, levers))


def gpu_moe(cp: Any, model: ModelConfig) -> MoeWeights:
    h, m, e = model.hidden_size, model.moe_intermediate_size, model.n_routed_experts
    experts = tuple(ExpertWeights(gpu_nvfp4(cp, m, h), gpu_nvfp4(cp, m, h), gpu_nvfp4(cp, h, m)) for _ in range(e))
    bias = _ready(cp, (7.0 + 0.02 * cp.random.standard_normal(e, dtype=cp.float32)).astype(cp.float32))
    return MoeWeights(gpu_bf16(cp, (e, h), h ** -0.5), bias, 0, experts, gpu_dense(cp, model.shared_intermediate, h))

"""``glm-ep bench``: GPU figures at the GLM-5.3-Flash shape, against the measured copy bandwidth.

Synthetic weights are generated directly on the GPU (no disk). Every figure is the median over
repeated timed runs after warm-up, with CUDA events on the backend's stream; each timed region
walks several layers' DISTINCT weights so a site's bytes cannot be served from L2 (60 MB).
Bytes are the fewest the site must read: the chosen (union of) experts' NVFP4 bytes, the
bf16 shared expert, the router; a dense site its three bf16 matrices.

This module is the command: its flags and the job. The measuring modules need CuPy and are
imported only once the job runs: ``decode`` (decode and verify, where the sparse site's time goes by
``stages``; PyTorch peer in ``decode_peer``),
``prefill`` (``--prefill``; HF transformers' peers in ``prefill_peer``), the sweeps the kernel
defaults are set from (``--sweep ring|union`` in ``sweep_ring``, ``--sweep dense`` in ``sweep_dense``) and
``shares`` (``--moe-tp N``: the one-row sparse site per rank share of ep N and moe_tp N), all on ``common``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

from glm_ep.config.topology import PathLevers, Topology
from glm_ep.errors import ConfigError

SWEEPS = ("ring", "union", "dense")


def add_arguments(p: argparse.ArgumentParser, count: Callable[[int], Callable[[str], int]]) -> None:
    """The ``bench`` subcommand's flags (no layout flags: world 1, CUDA; a one-rank topology for its levers);
    ``count(least)``: the CLI's integer type of at least ``least``."""
    p.add_argument("--out", default="docs/perf", help="folder for the results table and plot")
    p.add_argument("--topology", help="a one-rank topology TOML file or shipped name (h100-1, h200-1) whose [levers] "
                   "the timed sites run with, as a job on that card would (default: the built-in levers); decode and "
                   "verify, --prefill")
    p.add_argument("--layers", type=count(0), default=0, help="stack layers to time (0: as many as fit)")
    p.add_argument("--iters", type=count(1), default=200)
    p.add_argument("--no-peer", dest="peer", action="store_false", help="skip the PyTorch peer")
    p.add_argument("--stages", action="store_true", help="--prefill: also where the sparse site's time goes at each "
                   "width (one call's GPU time, the site's and each of its ops alone, the L2 flushed before each; the "
                   "site again with plain launches)")
    p.add_argument("--gemm-stages", action="store_true", help="--prefill: the grouped-GEMM variant table also times the "
                   "default tiles at other stage counts (a second build of gemm_nvfp4.cu; entries ..._s{stages})")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--prefill", action="store_true", help="wide calls (prefill) against HF's modules instead")
    what.add_argument("--sweep", choices=SWEEPS, help="instead, the lever sets a default was chosen from, side by "
                      "side: the one-row routed ring (ring), the verify union kernels (union), the bf16 row tiers "
                      "(dense); writes SWEEP_<NAME>.md and sweep_<name>.json")
    what.add_argument("--moe-tp", type=int, metavar="N", help="instead: the one-row sparse site as each rank of a "
                      "world of N runs its share, ep N against moe_tp N (SHARES_<CARD>_<N>.md)")
    p.add_argument("--rows", type=count(1), nargs="+", help="--prefill widths (default 16 64 128 256 1024 4096); "
                   "--sweep dense widths (default 1 2 4 5 8 9 16 24 32 48 64)")
    p.add_argument("-v", "--verbose", action="store_true")


def require_gpu() -> None:
    """Refuse, with what is missing, unless CuPy imports and sees a CUDA GPU."""
    try:
        import cupy
    except ImportError as e:
        raise ConfigError(f"glm-ep bench needs CuPy and a CUDA GPU, but CuPy does not import ({e}); install "
                          "it: pip install '.[cuda12]' (or [cuda13]) from the glm_ep checkout") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError without a driver or device
        raise ConfigError(f"glm-ep bench needs a CUDA GPU, but CUDA reports none ({e})") from None
    if count < 1:
        raise ConfigError("glm-ep bench needs a CUDA GPU, but CUDA reports 0 devices "
                          "(check CUDA_VISIBLE_DEVICES and the driver)")


def bench_levers(topology: str | None) -> tuple[PathLevers, str]:
    """The levers the timed sites run with, and how a results file names them: a one-rank topology's
    ``[levers]``, else the built-in ones. A ConfigError for a topology of more than one rank, or levers the CUDA
    backend refuses."""
    if topology is None:
        return PathLevers(), "built-in"
    topo = Topology.load(topology)
    if topo.world != 1:
        raise ConfigError(f"glm-ep bench --topology {topology}: topology {topo.name!r} is for {topo.world} ranks "
                          f"({topo.layout_text}); the bench times one rank on one GPU and takes a topology only for "
                          "its [levers]: expected a one-rank topology (world = 1), e.g. h100-1 or h200-1")
    if topo.levers.host_dispatch:
        raise ConfigError(f"glm-ep bench --topology {topology}: levers.host_dispatch = true reads each call's ids to "
                          "the host, which a CUDA graph (what the bench times) cannot; expected host_dispatch = false")
    from glm_ep.backend import cuda_ring
    from glm_ep.bench.common import glm_model, world1_cfg

    try:  # what a job's backend refuses on the host
        cuda_ring(topo.levers, world1_cfg(glm_model()))
    except ConfigError as e:
        raise ConfigError(f"glm-ep bench --topology {topology}: {e}") from None
    builtin = PathLevers()
    changed = [f"{f.name} = {getattr(topo.levers, f.name)!r}".replace("True", "true").replace("False", "false")
               for f in dataclasses.fields(PathLevers) if getattr(topo.levers, f.name) != getattr(builtin, f.name)]
    return topo.levers, f"topology {topo.name!r}: " + (", ".join(changed) + ", the rest built-in" if changed
                                                         else "the built-in levers")


def bench_job(args: argparse.Namespace, mpi_comm: Any) -> int:
    if mpi_comm.Get_size() != 1:
        raise ConfigError(f"glm-ep bench runs on one rank (world 1), got {mpi_comm.Get_size()}")
    if args.rows and args.sweep in ("ring", "union"):
        raise ConfigError(f"glm-ep bench --sweep {args.sweep} --rows {' '.join(map(str, args.rows))}: --rows sets "
                          "the widths of --prefill and --sweep dense; the ring sweep times one row, the union sweep "
                          "2..8 rows")
    if args.stages and not args.prefill:
        raise ConfigError("glm-ep bench --stages: the stage table of wide calls is --prefill's (the decode bench always "
                          "prints its own); expected --prefill --stages")
    if args.gemm_stages and not args.prefill:
        raise ConfigError("glm-ep bench --gemm-stages: the grouped-GEMM variant table is --prefill's; expected "
                          "--prefill --gemm-stages")
    if args.moe_tp is not None and args.moe_tp < 2:
        raise ConfigError(f"--moe-tp {args.moe_tp}: expected a world of >= 2 ranks to split the experts over")
    if args.topology and (args.sweep or args.moe_tp is not None):
        what = f"--sweep {args.sweep}" if args.sweep else f"--moe-tp {args.moe_tp}"
        raise ConfigError(f"glm-ep bench {what} --topology {args.topology}: {what} times its own lever sets or "
                          "layouts on the built-in levers; --topology sets the levers of decode and verify (no flag) "
                          "and of --prefill")
    args.levers, args.levers_note = bench_levers(args.topology)
    require_gpu()
    if args.sweep in ("ring", "union"):
        from glm_ep.bench import sweep_ring  # needs CuPy

        return sweep_ring.run_sweep_ring(args) if args.sweep == "ring" else sweep_ring.run_sweep_union(args)
    if args.sweep == "dense":
        from glm_ep.bench.sweep_dense import run_sweep_dense  # needs CuPy

        return run_sweep_dense(args)
    if args.moe_tp is not None:
        from glm_ep.bench.shares import run_shares_bench  # needs CuPy

        return run_shares_bench(args)
    if args.prefill:
        from glm_ep.bench.prefill import run_prefill_bench  # needs CuPy

        return run_prefill_bench(args)
    from glm_ep.bench.decode import run_bench  # needs CuPy

    return run_bench(args)

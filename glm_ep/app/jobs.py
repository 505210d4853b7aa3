"""The MPI jobs: ``forward`` (each site applied to one input) and ``run`` (the main workload).

Both check what the user gave them (topology, checkpoint headers, input and output files) before
any weight is read, agree across ranks at every step, and wait on the other ranks only under the
collective deadline.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import statistics
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from glm_ep.check.verdict import check_run
from glm_ep.check.plan import memory_budget, plan_check
from glm_ep.errors import EXIT_FAIL, EXIT_OK, ConfigError, InputError
from glm_ep.app import load_record
from glm_ep.app.files import check_output_path, job_inputs, read_hidden_states, write_outputs
from glm_ep.checkpoint.finite import nonfinite_mask
from glm_ep.mlp.runtime import Runtime, load_runtime, open_checkpoint
from glm_ep.dist.ranks import AgreedError, Ranks
from glm_ep.config.topology import Topology

log = logging.getLogger(__name__)
BF16 = ml_dtypes.bfloat16


def resolve_topology(args: argparse.Namespace, world: int) -> Topology:
    """The topology file if given (else world = tp = ep = MPI size; ep = world / moe_tp with --moe-tp), then the
    CLI overrides."""
    if args.topology is not None and not args.topology.strip():  # an unset shell variable, say: not the default
        raise ConfigError(f"--topology {args.topology!r}: expected a shipped topology name or a TOML path")
    moe_tp = getattr(args, "moe_tp", None)
    ep = world // moe_tp if moe_tp and moe_tp > 0 and world % moe_tp == 0 else world
    topo = (Topology.load(args.topology) if args.topology is not None
            else Topology(name="cli", world=world, tp=world, ep=ep))
    return topo.with_overrides(tp=args.tp, ep=args.ep, backend=args.backend, moe_tp=moe_tp)


def agreed_topology(args: argparse.Namespace, ranks: Ranks) -> Topology:
    """The job's topology on every rank; from here on, waits are bounded by its ``collective_timeout_s``."""
    topo = ranks.agree("topology", lambda: resolve_topology(args, ranks.size))
    ranks.deadline.timeout_s = topo.collective_timeout_s
    return topo


def forward_job(args: argparse.Namespace, ranks: Ranks) -> int:
    topo = agreed_topology(args, ranks)
    # rank 0 writes the output: never over its own input or model files
    ranks.agree("output check", lambda: check_output_path(args.output, job_inputs(args.input, args.model))
                if ranks.rank == 0 else None)
    load_record.check_paths(args, ranks, job_inputs(args.input, args.model) + [("the --output file", Path(args.output))])
    ckpt = open_checkpoint(args.model, topo, ranks)  # config and headers: the hidden size
    hidden = ckpt.config.hidden_size
    x = ranks.agree("input read", lambda: read_hidden_states(args.input, hidden, topo.allow_nonfinite_input))
    ranks.check_same("input fingerprint", "inputs", {"input rows": str(x.shape[0]),
                                                     "input": hashlib.sha256(x.tobytes()).hexdigest()})
    rt = load_runtime(ckpt, topo, ranks)
    recorder = load_record.start(rt, ranks) if args.expert_load else None
    outputs = {}
    chunk = rt.stack.max_rows  # wider inputs run in workspace-sized chunks (rows are independent)
    for i in range(rt.model.num_hidden_layers):
        parts = [_site_on_host(rt, ranks, i, x[r:r + chunk]) for r in range(0, x.shape[0], chunk)]
        outputs[f"layers.{i}"] = np.ascontiguousarray(np.concatenate(parts))
    ranks.agree("output write", lambda: write_outputs(outputs, args.output, job_inputs(args.input, args.model))
                if ranks.rank == 0 else None)
    if ranks.rank == 0:
        log.info("wrote %d site outputs of %s rows to %s", len(outputs), x.shape[0], args.output)
        _warn_overflow(x, outputs)
    if recorder is not None:
        load_record.finish(recorder, ranks, args)
    return EXIT_OK


def _warn_overflow(x: np.ndarray, outputs: dict[str, np.ndarray]) -> None:
    """A warning per layer whose outputs hold NaN/Inf in rows whose input was finite (the site overflowed: the
    file holds what was computed, as HF's modules would compute it, but not silently)."""
    finite_in = ~nonfinite_mask(x).any(axis=1)
    for name, y in outputs.items():
        rows = np.flatnonzero(nonfinite_mask(y).any(axis=1) & finite_in)
        if rows.size:
            log.warning("%s: %d of %d rows with finite inputs hold NaN or Inf (rows %s%s): the site overflowed "
                        "(largest |input| %.3g)", name, rows.size, y.shape[0], rows[:8].tolist(),
                        " ..." if rows.size > 8 else "", float(np.abs(x[finite_in].astype(np.float32)).max()))


def _site_on_host(rt: Runtime, ranks: Ranks, i: int, x_TH: np.ndarray) -> np.ndarray:
    """Site ``i`` applied to ``x``, copied to the host (for a device backend, the sync that waits
    for the site's all-reduce, under the deadline)."""
    y = rt.stack.site_output(i, rt.be.asarray(x_TH))
    with ranks.guard(f"layer {i} device sync"):
        return rt.be.to_host(y)


def _timed(rt: Runtime, ranks: Ranks, x_TH: np.ndarray) -> tuple[np.ndarray, float]:
    dev = rt.be.asarray(x_TH)
    rt.be.synchronize()
    t0 = time.perf_counter()
    y = rt.stack.step(dev)
    with ranks.guard(f"{x_TH.shape[0]}-row step device sync"):
        rt.be.synchronize()
    dt = time.perf_counter() - t0
    return rt.be.to_host(y), dt


def _check_workload(args: argparse.Namespace, workspace_rows: int) -> None:
    for name in ("prefill", "verify"):  # the counts' own bounds are the parser's (cli._count)
        n = getattr(args, name)
        if n > workspace_rows:
            raise InputError(f"--{name} {n} rows do not fit the workspace built for {workspace_rows} rows "
                             "(raise workspace_rows in the topology)")


def run_job(args: argparse.Namespace, ranks: Ranks) -> int:
    default = ranks.allgather("default checkpoint check", args.model is None)
    if any(default) and not all(default):  # a path is per rank (each node its copy), but given by all or none
        given = ", ".join(str(r) for r, d in enumerate(default) if not d)
        raise AgreedError(f"--model is given on rank(s) {given} but not on the others; expected it on every rank "
                          "(a checkpoint each) or on none (rank 0 writes the tiny one into --cache-dir)")
    if args.model is None:
        from glm_ep.checkpoint.synth import ensure_default_checkpoint

        cache = Path(args.cache_dir)
        ranks.agree("default checkpoint", lambda: ensure_default_checkpoint(cache) if ranks.rank == 0 else None)
        args.model = str(cache / "tiny")
    topo = agreed_topology(args, ranks)
    ranks.agree("workload check", lambda: _check_workload(args, topo.workspace_rows))
    load_record.check_paths(args, ranks, job_inputs("", args.model)[1:])
    rt = load_runtime(open_checkpoint(args.model, topo, ranks), topo, ranks)
    h = rt.model.hidden_size
    rng = np.random.default_rng(args.seed)  # the same inputs on every rank
    calls = [("prefill", rng.standard_normal((args.prefill, h)))]
    calls += [("decode", rng.standard_normal((1, h))) for _ in range(args.decode)]
    calls += [("verify", rng.standard_normal((args.verify, h)))]
    calls = [(phase, x.astype(BF16)) for phase, x in calls]
    firsts = {x.shape[0]: x for _, x in reversed(calls)}  # the first call of each row count
    for x in firsts.values():  # untimed: kernel compiles, graph captures
        for _ in range(args.warmup):
            _timed(rt, ranks, x)
    results = [(phase, x, *_timed(rt, ranks, x)) for phase, x in calls]
    if ranks.rank == 0:
        _print_timing(results, rt, args.warmup)
    if args.expert_load:  # the calls once more, recorded (untimed: the recording reads each site's ids to the host)
        recorder = load_record.start(rt, ranks)
        for _, x in calls:
            _timed(rt, ranks, x)
        recorder.detach(rt.stack)
        load_record.finish(recorder, ranks, args)
    if args.check == "none":
        return EXIT_OK
    budget = memory_budget(ranks)
    plan = ranks.agree("check plan", lambda: plan_check(rt.model, args.check, [x.shape[0] for _, x, _, _ in results],
                                                        args.seed, ranks.size, budget))
    if ranks.rank == 0:
        print(plan.estimate_line(), flush=True)
        if plan.estimate_bytes > plan.budget_bytes:
            log.warning("the %s check's float64 memory estimate is over the budget", plan.mode)
    traces = [_eager_chain(rt, ranks, x) for _, x, _, _ in results]
    verdict = check_run(args.model, plan, [y for _, _, y, _ in results], traces, ranks, topo.check_weights)
    if ranks.rank == 0:
        print("\n".join(verdict.lines()), flush=True)
    return EXIT_OK if verdict.ok else EXIT_FAIL


def _eager_chain(rt: Runtime, ranks: Ranks, x_TH: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """The chain again, one site at a time: each site's input and output, on the host."""
    trace, h = [], x_TH
    for i in range(rt.model.num_hidden_layers):
        y = _site_on_host(rt, ranks, i, h)
        trace.append((h, y))
        h = (h.astype(np.float32) + y.astype(np.float32)).astype(BF16)
    return trace


def _print_timing(results: list[tuple[str, np.ndarray, np.ndarray, float]], rt: Runtime, warmup: int) -> None:
    print(f"{'phase':<8} {'calls':>5} {'rows/call':>9} {'median ms':>10} {'total ms':>10} {'rows/s':>10}")
    for phase in ("prefill", "decode", "verify"):
        sel = [(x.shape[0], dt) for p, x, _, dt in results if p == phase]
        if not sel:
            continue
        rows = sum(r for r, _ in sel)
        total = sum(dt for _, dt in sel)
        med = statistics.median(dt for _, dt in sel)
        print(f"{phase:<8} {len(sel):>5} {sel[0][0]:>9} {med * 1e3:>10.3f} {total * 1e3:>10.3f} "
              f"{rows / total if total else float('inf'):>10.1f}")
    print(f"(backend {rt.be.name}, world {rt.topo.world}, {rt.topo.layout_text}; "
          f"{rt.model.num_hidden_layers} sites per step; timed after {warmup} warm-up step(s) per row count; "
          f"steps of 1..{rt.be.capabilities.max_gemv_rows} rows replay a captured graph where the backend captures)",
          flush=True)

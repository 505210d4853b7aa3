"""The MPI jobs: ``forward`` (each site applied to one input) and ``run`` (the main workload).

Both check what the user gave them (topology, checkpoint headers, input and output files; for
``run``, that its check's float64 memory fits what each rank will have left) before any weight is
read, agree across ranks at every step, and wait on the other ranks only under the collective
deadline. Calls wider than the workspace run in workspace-sized chunks. An output that holds NaN or
Inf for finite inputs is never passed silently: ``forward`` and ``run`` name the layer.
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

from glm_ep.check.verdict import check_run, first_overflow
from glm_ep.check.plan import Available, CheckPlan, memory_available, memory_budget, plan_check
from glm_ep.checkpoint.layers import dense_is_nvfp4, layer_read_bytes
from glm_ep.errors import EXIT_FAIL, EXIT_OK, ConfigError, InputError, NumericError
from glm_ep.app import load_record
from glm_ep.app.files import check_output_path, job_inputs, read_hidden_states, write_outputs
from glm_ep.checkpoint.finite import nonfinite_mask
from glm_ep.checkpoint.reader import Checkpoint
from glm_ep.mlp.runtime import Runtime, load_runtime, open_checkpoint, site_config
from glm_ep.mlp.site import site_buffers
from glm_ep.mlp.workspace import fmt_bytes, workspaces_bytes
from glm_ep.dist.progress import progress
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
            else Topology(name="default, no --topology", world=world, tp=world, ep=ep))
    return topo.with_overrides(tp=args.tp, ep=args.ep, backend=args.backend, moe_tp=moe_tp)


def agreed_topology(args: argparse.Namespace, ranks: Ranks) -> Topology:
    """The job's topology on every rank; from here on, waits are bounded by its ``collective_timeout_s``."""
    topo = ranks.agree("topology", lambda: resolve_topology(args, ranks.size))
    ranks.deadline.timeout_s = topo.collective_timeout_s
    return topo


def opened(model_dir: str, topo: Topology, ranks: Ranks) -> Checkpoint:
    """``open_checkpoint``, and rank 0 says which weight files it reads where the folder holds both layouts."""
    ckpt = open_checkpoint(model_dir, topo, ranks)
    if ranks.rank == 0 and ckpt.note:
        log.warning("%s", ckpt.note)
    return ckpt


def forward_job(args: argparse.Namespace, ranks: Ranks) -> int:
    topo = agreed_topology(args, ranks)
    # rank 0 writes the output: never over its own input or model files
    ranks.agree("output check", lambda: check_output_path(args.output, job_inputs(args.input, args.model))
                if ranks.rank == 0 else None)
    load_record.check_paths(args, ranks, job_inputs(args.input, args.model) + [("the --output file", Path(args.output))])
    ckpt = opened(args.model, topo, ranks)  # config and headers: the hidden size
    hidden = ckpt.config.hidden_size
    x = ranks.agree("input read", lambda: read_hidden_states(args.input, hidden, topo.allow_nonfinite_input))
    ranks.check_same("input fingerprint", "inputs", {"input rows": str(x.shape[0]),
                                                     "input": hashlib.sha256(x.tobytes()).hexdigest()})
    rt = load_runtime(ckpt, topo, ranks)
    recorder = load_record.start(rt, ranks) if args.expert_load else None
    layers, spans = rt.model.num_hidden_layers, _spans(x.shape[0], rt.stack.max_rows)
    outputs = {f"layers.{i}": np.empty(x.shape, dtype=BF16) for i in range(layers)}
    with progress(layers * len(spans), "forward", unit="chunks", enabled=ranks.rank == 0, log=log) as bar:
        for i in range(layers):
            for span in spans:  # wider inputs run in workspace-sized chunks (rows are independent)
                outputs[f"layers.{i}"][span] = _site_on_host(rt, ranks, i, x[span])
                bar.update()
    overflowed = ranks.agree("output check", lambda: _overflowed(x, outputs, topo.check_weights))
    if overflowed and ranks.rank == 0:  # weights not checked (check_weights = false): written as computed
        log.warning("%s", overflowed)
    ranks.agree("output write", lambda: write_outputs(outputs, args.output, job_inputs(args.input, args.model))
                if ranks.rank == 0 else None)
    if ranks.rank == 0:
        log.info("wrote %d site outputs of %s rows to %s", len(outputs), x.shape[0], args.output)
    if recorder is not None:
        load_record.finish(recorder, ranks, args)
    return EXIT_OK


def _overflowed(x: np.ndarray, outputs: dict[str, np.ndarray], weights_checked: bool) -> str | None:
    """What overflowed: each layer whose outputs hold NaN or Inf in rows whose input was finite. With
    ``weights_checked`` (the load refused non-finite weights and scales that pass bf16's range) that is a
    NumericError, nothing written; without, the lines of a warning (the weights may hold the NaN). None if nothing."""
    finite_in = ~nonfinite_mask(x).any(axis=1)
    found = []
    for name, y in outputs.items():
        rows = np.flatnonzero(nonfinite_mask(y).any(axis=1) & finite_in)
        if rows.size:
            found.append(f"{name.replace('layers.', 'layer ')}: {rows.size} of {y.shape[0]} rows "
                         f"(rows {rows[:8].tolist()}{' ...' if rows.size > 8 else ''})")
    if not found:
        return None
    biggest = float(np.abs(x[finite_in].astype(np.float32)).max()) if finite_in.any() else float("nan")
    what = (f"NaN or Inf outputs from finite inputs (largest |input| {biggest:.3g}) at " + "; ".join(found))
    if not weights_checked:
        return what + " (check_weights = false: the weights may hold them)"
    raise NumericError(f"{what}: the site overflowed; expected finite outputs from finite inputs and checked "
                       "weights (inputs of ordinary magnitude; weights whose products stay within bf16's range); "
                       "nothing was written")


def _spans(rows: int, chunk: int) -> list[slice]:
    """``rows`` rows in workspace-sized chunks (rows are independent: a wide call is its chunks' calls)."""
    return [slice(r, min(r + chunk, rows)) for r in range(0, rows, chunk)]


def _site_on_host(rt: Runtime, ranks: Ranks, i: int, x_TH: np.ndarray) -> np.ndarray:
    """Site ``i`` applied to ``x``, chunk by chunk, copied to the host (for a device backend, the sync that waits
    for the site's all-reduce, under the deadline)."""
    parts = []
    for span in _spans(x_TH.shape[0], rt.stack.max_rows):
        y = rt.stack.site_output(i, rt.be.asarray(x_TH[span]))
        with ranks.guard(f"layer {i} device sync"):
            parts.append(rt.be.to_host(y))
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def _timed(rt: Runtime, ranks: Ranks, x_TH: np.ndarray) -> tuple[np.ndarray, float]:
    """The step on ``x`` and its time. A call wider than the workspace steps each chunk in turn, each chunk's output
    copied out of the stack's buffer (which the next chunk reuses) within the timing, as the library does."""
    spans = _spans(x_TH.shape[0], rt.stack.max_rows)
    dev = rt.be.asarray(x_TH)
    out = rt.be.xp.empty(x_TH.shape, dtype=BF16) if len(spans) > 1 else None
    rt.be.synchronize()
    t0 = time.perf_counter()
    for span in spans:
        y = rt.stack.step(dev[span])
        if out is not None:
            rt.be.copy(y, out[span])
    with ranks.guard(f"{x_TH.shape[0]}-row step device sync"):
        rt.be.synchronize()
    dt = time.perf_counter() - t0
    return rt.be.to_host(out if out is not None else y), dt


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
    load_record.check_paths(args, ranks, job_inputs("", args.model)[1:])
    ckpt = opened(args.model, topo, ranks)
    loaded = ckpt.stamps  # the check refuses a checkpoint rewritten after this
    h = ckpt.config.hidden_size
    held = ranks.agree("load size", lambda: _host_bytes_of_load(ckpt, topo, ranks.rank))
    available = memory_available(ranks, held)
    ranks.agree("run inputs size", lambda: _check_input_room(args, h, held, available))
    call_rows = [args.prefill] + [1] * args.decode + [args.verify]
    plan = None if args.check == "none" else _agreed_plan(args, ckpt, topo, ranks, call_rows, held, available)

    def inputs() -> list[tuple[str, np.ndarray]]:
        rng = np.random.default_rng(args.seed)  # the same inputs on every rank
        try:
            return [(phase, rng.standard_normal((n, h)).astype(BF16))
                    for phase, n in zip(["prefill"] + ["decode"] * args.decode + ["verify"], call_rows)]
        except MemoryError as e:
            raise InputError(f"--prefill {args.prefill}, --verify {args.verify}: the calls' inputs ({max(call_rows)} "
                             f"rows of hidden {h}, drawn in float64) do not fit in this rank's memory ({e}); expected "
                             "fewer rows") from None

    calls = ranks.agree("run inputs", inputs)  # before the load: refused on every rank alike, printed once
    rt = load_runtime(ckpt, topo, ranks)
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
    if plan is None:
        _refuse_overflow(rt, ranks, results, topo.check_weights)
        return EXIT_OK
    if ranks.rank == 0:
        print(plan.estimate_line(), flush=True)
        if plan.estimate_bytes > plan.budget_bytes:
            log.warning("the %s check's float64 memory estimate is over the budget", plan.mode)
    traces = [_eager_chain(rt, ranks, x) for _, x, _, _ in results]
    verdict = check_run(args.model, plan, [y for _, _, y, _ in results], traces, ranks, topo.check_weights, loaded)
    if ranks.rank == 0:
        print("\n".join(verdict.lines()), flush=True)
    return EXIT_OK if verdict.ok else EXIT_FAIL


def _refuse_overflow(rt: Runtime, ranks: Ranks, results: list[tuple[str, np.ndarray, np.ndarray, float]],
                     weights_checked: bool) -> None:
    """Without the check, still never a silent NaN: a timed output holding NaN or Inf (its inputs are finite) is a
    NumericError on every rank naming the layer where that call's chain overflowed (found by running it again site
    by site: collective, and only then); a warning where the weights were not checked."""
    bad = [k for k, (_, _, y, _) in enumerate(results) if nonfinite_mask(y).any()]
    every = ranks.allgather("output check", bad[:1])  # the outputs are the all-reduce's: alike, but agreed anyway
    if not any(every):
        return
    k = min(k for b in every for k in b)
    phase, x, _, _ = results[k]
    layer = first_overflow([_eager_chain(rt, ranks, x)])
    what = (f"the {phase} call's outputs ({x.shape[0]} rows) hold NaN or Inf from finite inputs, "
            + (f"the first at layer {layer}" if layer is not None else "at no layer of the chain run again"))
    if not weights_checked:
        if ranks.rank == 0:
            log.warning("%s (check_weights = false: the weights may hold them)", what)
        return

    def refuse() -> None:
        raise NumericError(f"{what}: the site overflowed; expected finite outputs from finite inputs and checked "
                           "weights (weights whose products stay within bf16's range)")

    ranks.agree("output check", refuse)


def _check_input_room(args: argparse.Namespace, hidden: int, held: int, available: Available) -> None:
    """InputError where the run's calls would not fit the memory each rank has left once its load holds its share:
    the widest call's rows drawn in float64 and rounded to bf16, every call's rows kept as bf16 and the widest
    call's outputs (checked before the row counts are even listed: --decode 10**11 is refused, not attempted).
    Where the load alone leaves nothing, the rows are not to blame: the check's plan, or the load, names that."""
    if available.bytes == 0 and held > 0:
        return
    widest, total = max(args.prefill, args.verify, 1 if args.decode else 0), args.prefill + args.decode + args.verify
    need = (widest * (8 + 4 + 2) + total * 2) * hidden
    if need > available.bytes:
        raise InputError(f"--prefill {args.prefill}, --decode {args.decode}, --verify {args.verify}: the calls take "
                         f"about {fmt_bytes(need)} a rank ({total} rows of hidden {hidden} kept as bf16, the widest "
                         f"call of {widest} drawn in float64), but {fmt_bytes(available.bytes)} is available "
                         f"({available.bound}); expected fewer rows")


def _agreed_plan(args: argparse.Namespace, ckpt: Checkpoint, topo: Topology, ranks: Ranks,
                 call_rows: list[int], held: int, available: Available) -> CheckPlan:
    """The check's plan, made before the load: refused on every rank where its float64 memory would not fit what
    each rank has ``available`` once its load holds its share (``held`` bytes)."""
    budget = memory_budget(ranks)

    def plan() -> CheckPlan:
        if available.bytes == 0 and held > 0:  # the same on every rank: the least over the ranks
            raise ConfigError(f"the load alone leaves no memory: {available.bound} (its weights and its workspaces of "
                              f"workspace_rows = {topo.workspace_rows}); expected fewer workspace_rows or more memory "
                              "per rank (--check none skips the check, not the load)")
        return plan_check(ckpt.config, args.check, call_rows, args.seed, ranks.size, budget, available)

    return ranks.agree("check plan", plan)


def _host_bytes_of_load(ckpt: Checkpoint, topo: Topology, rank: int) -> int:
    """The host memory rank ``rank``'s load will hold while the check runs: its weights and workspaces on the NumPy
    backend, nothing lasting on a device backend (its weights go to the device)."""
    if topo.backend != "cpu":
        return 0
    model = ckpt.config
    cfg = site_config(model, topo, rank)
    # the scratch the load declares, as load_runtime sizes it (the NumPy backend declares none of its own)
    nvfp4_dense = cfg.tp_active(False) and any(dense_is_nvfp4(ckpt, i) for i in model.dense_layers)
    buffers = site_buffers(cfg.physical(), topo.levers, nvfp4_dense)
    return (sum(layer_read_bytes(ckpt, cfg, i) for i in range(model.num_hidden_layers))
            + workspaces_bytes(buffers, topo.workspace_rows, model.num_hidden_layers, topo.shared_workspace))


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

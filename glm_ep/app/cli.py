"""``glm-ep``: synth, make-input, footprint, forward, run, generate, balance and bench.

    mpiexec -n 2 python -m glm_ep run                       # the main job on the tiny checkpoint
    mpiexec -n 2 python -m glm_ep forward --model DIR --input IN.safetensors --output OUT.safetensors
    mpiexec -n 2 python -m glm_ep generate --model DIR --hf-model HF --prompt-ids 1,2,3 --compare
    python -m glm_ep synth --preset tiny --out DIR [--hf-model HF]
    python -m glm_ep make-input --model DIR --rows 64 --out IN.safetensors
    python -m glm_ep footprint --preset glm-5.3-flash --tp 2 --ep 2
    python -m glm_ep balance --load LOAD.safetensors --ep 8 --out PLACEMENT.json

Exit codes: 0 done (run: PASS), 1 internal error, 2 user error (config, topology, checkpoint,
input, output, memory), 3 run's check FAILed, 4 a rank waited past collective_timeout_s (a rank
stopped or hung; MPICH's mpiexec ends a job whose rank died itself, with that rank's signal: 9 for
kill -9), 130 interrupted (Ctrl-C), 141 stdout closed by its reader (| head), 143 terminated
(SIGTERM).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import typing
from typing import Any, Callable

from glm_ep import bench
from glm_ep.app import load_record
from glm_ep.app.launcher import launch_rank, launch_size
from glm_ep.errors import EXIT_USER, InputError
from glm_ep.dist.deadline import sigterm_raises
from glm_ep.dist.mpi_lib import MpiUnavailable
from glm_ep.dist.ranks import Ranks, mpi_world, run_guarded, setup_logging
from glm_ep.config.shipped import shipped_names
from glm_ep.hf import generate as hf_generate


_ALONE = ("synth", "make-input", "footprint", "balance", "bench")  # commands whose ranks never meet (bench: one rank)


class _ArgumentsRefused(Exception):
    """An argument error under a launch of several ranks (or of a count the launcher does not give), of a command
    whose ranks meet in collectives, or of no command known: ``main`` has the ranks agree on it, since a rank whose
    arguments parsed would otherwise wait for this one in MPI's start-up or its first collective."""

    def __init__(self, parser: argparse.ArgumentParser, message: str):
        super().__init__(message)
        self.parser, self.message = parser, message


class _Parser(argparse.ArgumentParser):
    """An argument error is printed once under mpiexec (by rank 0, whose rank the environment gives before MPI
    is up): argparse's usage and one line ``glm-ep: error: <what argparse found>``; every rank exits 2. For
    ``run`` and ``forward`` under several ranks the ranks agree first (``main``): one rank's bad argument then
    ends every rank, named, instead of leaving the others waiting at their first collective."""

    argv: tuple[str, ...] = ()  # main's argv, on the top-level parser: the command of an error it reports

    def error(self, message: str) -> typing.NoReturn:
        cmd = self.prog.split()[1:2] or [a for a in self.argv if not a.startswith("-")][:1]
        size = launch_size()
        if (size is None or size > 1) and not (cmd and cmd[0] in _ALONE):
            raise _ArgumentsRefused(self, message)
        if launch_rank() == 0:
            self.print_usage(sys.stderr)
            print(f"glm-ep: error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER)


def _count(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``least`` (argparse names the flag and exits 2 otherwise)."""
    def integer(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < least:
            raise argparse.ArgumentTypeError(f"{v}, expected an integer >= {least}")
        return v
    return integer


def _path(text: str) -> str:
    """An argparse type: a path that is not empty (an empty one would name the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}, an empty path; expected a file or folder name")
    return text


#: the flags that name a file or folder, in every subcommand: none may be empty (--topology, a name or a path,
#: refuses an empty one itself)
_PATH_DESTS = frozenset({"out", "model", "input", "output", "cache_dir", "hf_model", "load", "expert_load"})


def _skew(text: str) -> float:
    """An argparse type: a finite number >= 0 (the router skew)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"{v}, expected a finite number >= 0 (0: no skew)")
    return v


def _layout_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", help=f"a topology TOML file or a shipped name ({', '.join(shipped_names())}); "
                   "default: world = tp = ep = MPI size, backend cpu")
    p.add_argument("--tp", type=_count(1), help="tensor-parallel degree (overrides the topology)")
    p.add_argument("--ep", type=_count(1), help="expert-parallel degree (overrides the topology)")
    p.add_argument("--moe-tp", type=_count(1), help="each routed expert's width split over this many ranks: ep groups of "
                   "moe-tp ranks (overrides the topology; without a topology, ep defaults to world / moe-tp)")
    p.add_argument("--backend", choices=("cpu", "cuda"), help="overrides the topology's backend")
    p.add_argument("-v", "--verbose", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    plain = __doc__.replace("``", "")  # the help is read as it prints, not as reStructuredText
    ap = _Parser(prog="glm-ep", description=plain.split("\n\n")[0], epilog=plain.split("\n\n")[-1])
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("synth", help="write a synthetic checkpoint in the real GLM-5.3 NVFP4 format")
    p.add_argument("--preset", default="tiny", help="tiny | glm-5.3-flash")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=_count(0), default=0)
    p.add_argument("--layers", type=_count(1), help="override num_hidden_layers (the real shape is ~170 GB)")
    p.add_argument("--intermediate-size", type=_count(16), metavar="I", help="override the dense FFN's width")
    p.add_argument("--moe-intermediate-size", type=_count(16), metavar="M", help="override each routed expert's width "
                   "(a model of the preset's routing, hidden size and layers on narrow experts: for counting balance)")
    p.add_argument("--router-dtype", choices=("bf16", "f32"), default="bf16")
    p.add_argument("--composite", action="store_true", help="text_config + model.language_model prefix")
    p.add_argument("--dense", choices=("bf16", "nvfp4"), default="bf16",
                   help="how the dense FFNs are stored (nvfp4: quantized like the experts)")
    p.add_argument("--router-skew", type=_skew, default=0.0, metavar="S",
                   help="skew each router's expert load (Zipf-like, seeded; 0: none, 1: the hottest expert takes "
                   "several times its share)")
    p.add_argument("--shard-mb", type=_count(1), default=256)
    p.add_argument("--force", action="store_true", help="write over a checkpoint already in the folder")
    p.add_argument("--hf-model", help="also write here a transformers glm5_next model whose MLPs are this checkpoint's "
                   "(glm-ep generate runs the pair; needs the hf extra)")

    p = sub.add_parser("make-input", help="write a forward input: seeded hidden_states, bf16 [rows, hidden]")
    p.add_argument("--out", required=True, help="the safetensors file to write")
    p.add_argument("--rows", type=_count(1), required=True)
    width = p.add_mutually_exclusive_group(required=True)
    width.add_argument("--model", help="a checkpoint folder: its config.json's hidden_size")
    width.add_argument("--hidden", type=_count(1), help="the hidden size")
    p.add_argument("--seed", type=_count(0), default=0)

    p = sub.add_parser("footprint", help="print weight and workspace footprints from a config alone")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset")
    src.add_argument("--model", help="a checkpoint folder (reads its config.json)")
    p.add_argument("--topology", help="a topology TOML file or a shipped name: its layout, workspace_rows and levers "
                   "(default: world = lcm(tp, ep), 512 rows)")
    p.add_argument("--tp", type=_count(1), help="tensor-parallel degree (default: the topology's, else 1)")
    p.add_argument("--ep", type=_count(1), help="expert-parallel degree (default: the topology's, else 1)")
    p.add_argument("--rows", type=_count(1), help="workspace rows (default: the topology's workspace_rows, as the "
                   "runtime builds it)")
    p.add_argument("--moe-tp", type=_count(1), help="each routed expert's width split over this many ranks (default: "
                   "the topology's, else 1)")
    p.add_argument("--per-layer", action="store_true", help="one workspace per layer instead of one shared")
    p.add_argument("--dense", choices=("bf16", "nvfp4"),
                   help="with --preset: how the dense FFNs are stored (default bf16; a --model checkpoint says so "
                   "itself)")
    p.add_argument("--expert-load", metavar="FILE", help="a recorded expert load (run / forward --expert-load): the "
                   "decode row's routed bytes on the busiest rank from it (default: uniform routing)")

    p = sub.add_parser("forward", help="apply every MLP site to one input (mpiexec -n W)")
    p.add_argument("--model", required=True)
    p.add_argument("--input", required=True, help="safetensors with hidden_states bf16 [rows, hidden]")
    p.add_argument("--output", required=True, help="rank 0 writes layers.{i} [rows, hidden] here")
    load_record.add_arguments(p)
    _layout_flags(p)

    p = sub.add_parser("run", help="the main job: load, prefill/decode/verify through the stack, check")
    p.add_argument("--model", help="checkpoint folder; default: the tiny checkpoint in --cache-dir")
    p.add_argument("--cache-dir", default=".cache")
    p.add_argument("--prefill", type=_count(1), default=64, help="rows of the prefill call")
    p.add_argument("--decode", type=_count(0), default=16, help="number of 1-row decode steps")
    p.add_argument("--verify", type=_count(1), default=4, help="rows of the verify call")
    p.add_argument("--seed", type=_count(0), default=0)
    p.add_argument("--warmup", type=_count(0), default=1, help="untimed steps per row count before timing")
    check = p.add_mutually_exclusive_group()  # both given, the last one won without a word
    check.add_argument("--check", choices=("auto", "full", "sampled", "none"), default="auto",
                       help="the float64 check: full (every site of every call), sampled (chosen layers and rows, "
                       "only the experts they route to), auto (full where its memory estimate fits, else sampled), "
                       "none")
    check.add_argument("--no-check", dest="check", action="store_const", const="none",
                       help="the same as --check none")
    load_record.add_arguments(p)
    _layout_flags(p)

    # glm_ep inside HF transformers' glm5_next (glm_ep/hf): the flags are hf.generate's, the layout flags ours
    p = sub.add_parser("generate", help="greedy generation through a transformers glm5_next model whose MLPs glm_ep "
                       "serves (mpiexec -n W)")
    hf_generate.add_arguments(p, _count)
    _layout_flags(p)

    from glm_ep.app import balance_job

    balance_job.add_arguments(sub.add_parser("balance", help="place the experts on the ep ranks from a recorded "
                                             "expert load (EPLB)"), _count)
    bench.add_arguments(sub.add_parser("bench", help="GPU benchmark at the GLM-5.3-Flash shape (CUDA)"), _count)
    for parser in sub.choices.values():  # every flag that names a file or folder refuses an empty one
        for action in parser._actions:
            if action.dest in _PATH_DESTS and action.type is None and action.nargs is None:
                action.type = _path
    return ap


def _refused_with_the_others(refused: _ArgumentsRefused) -> int:
    """Every rank meets the others at the argument check ``agreed_job`` opens with, this one holding its argument
    error: every rank exits 2, and rank 0 prints the error once, naming the ranks it was on where not all."""
    try:
        comm: Any = mpi_world()
    except MpiUnavailable as e:
        print(f"glm-ep: error: {refused.message}\nglm-ep: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER
    setup_logging(comm.Get_rank())
    if comm.Get_rank() == 0:
        refused.parser.print_usage(sys.stderr)

    def check() -> None:
        raise InputError(refused.message)

    return run_guarded(lambda: Ranks(comm).agree("argument check", check), comm)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.argv = tuple(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except _ArgumentsRefused as refused:
        return _refused_with_the_others(refused)
    if args.cmd in ("synth", "make-input", "footprint", "balance"):
        if launch_rank() != 0 and (args.cmd == "footprint" or (launch_size() or 1) > 1):
            _quiet()  # under mpiexec every rank computes the same report, or refuses to write from several ranks
            # (synth, make-input, balance) in the same words: rank 0 alone prints it
        setup_logging(0)
        from glm_ep.app import local_jobs
        from glm_ep.app.balance_job import balance_job

        alone = {"synth": local_jobs.synth_job, "make-input": local_jobs.make_input_job,
                 "footprint": local_jobs.footprint_job, "balance": balance_job}[args.cmd]
        with sigterm_raises():  # a scheduler's cancel: "terminated (SIGTERM)", and synth removes what it wrote
            return run_guarded(lambda: alone(args), None)
    try:
        comm: Any = mpi_world()
    except MpiUnavailable as e:  # no MPI library: one clear line, not an import traceback
        print(f"glm-ep: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER
    setup_logging(comm.Get_rank(), getattr(args, "verbose", False))
    if args.cmd == "bench":
        return run_guarded(lambda: bench.bench_job(args, comm), comm)
    from glm_ep.app.jobs import forward_job, run_job

    job = {"forward": forward_job, "run": run_job, "generate": hf_generate.generate_job}[args.cmd]

    def agreed_job() -> int:
        ranks = Ranks(comm)
        ranks.deadline.watch_signals()  # Ctrl-C / SIGTERM while this rank waits on the others: still ends the job
        ranks.agree("argument check", lambda: None)  # where a rank's arguments did not parse, it meets us here
        _same_command(args, ranks)
        return job(args, ranks)

    return run_guarded(agreed_job, comm)


def _quiet() -> None:
    """This process's stdout and stderr to the null device (a rank whose output rank 0 prints the same)."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (sys.stdout.fileno(), sys.stderr.fileno()):
        os.dup2(null, fd)
    os.close(null)


#: arguments that may differ by rank: paths (each node may hold its own copy: what they name is compared where it
#: is read) and -v
_PER_RANK_ARGS = frozenset({"model", "cache_dir", "input", "output", "topology", "verbose", "hf_model", "out"})


def _same_command(args: argparse.Namespace, ranks: Ranks) -> None:
    """Every rank runs the same command with the same settings (a rank with another --prefill, --check or
    subcommand would pair its collectives with the wrong ones: a crash, a hang or a false FAIL)."""
    ranks.check_same("command line", "command lines",
                     {k: repr(v) for k, v in sorted(vars(args).items()) if k not in _PER_RANK_ARGS})


if __name__ == "__main__":
    sys.exit(main())

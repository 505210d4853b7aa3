"""``--expert-load FILE [--plot]`` of ``run`` and ``forward``: record the routers' choices, write the load, report.

The paths are checked on rank 0 before any weight is read (agreed: a bad one stops every rank). ``forward``
records the calls it makes; ``run`` replays its calls once more through the stack after timing them (the
recording reads each sparse site's ids to the host, which the timing must not pay). Rank 0 then writes the
load (``glm_ep.balance.expert_load``), prints what it implies per rank under this run's layout and the other
splits of its world (``glm_ep.balance.report``), and with ``--plot`` writes the heat map beside it (FILE's name,
``.png``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Iterable

from glm_ep.app.files import check_output_path
from glm_ep.balance.expert_load import ExpertLoadRecorder
from glm_ep.balance.report import heat_map, load_lines, pyplot
from glm_ep.errors import ConfigError, InputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expert-load", metavar="FILE", help="record per sparse layer and expert how many slots chose it "
                   "into FILE (safetensors), and print the per-rank load it implies per layout")
    p.add_argument("--plot", action="store_true", help="with --expert-load: a heat map of the load (layers x experts) "
                   "beside FILE, as FILE.png")


def plot_path(load_path: str) -> Path:
    return Path(load_path).with_suffix(".png")


def check_paths(args: argparse.Namespace, ranks: Any, reads: Iterable[tuple[str, Path]] = ()) -> None:
    """Rank 0 may write the load (and its plot) where asked: agreed on every rank."""
    reads = list(reads)

    def check() -> None:
        if args.plot and not args.expert_load:
            raise ConfigError("--plot draws the load --expert-load records; expected --expert-load FILE with it")
        if ranks.rank != 0 or not args.expert_load:
            return
        if args.plot:
            pyplot()
        for flag, path in (("--expert-load", args.expert_load),) + ((("--plot", str(plot_path(args.expert_load))),)
                                                                    if args.plot else ()):
            for what, q in reads:
                if Path(path).resolve() == q.resolve():  # an output not yet written clashes all the same
                    raise InputError(f"{flag} {path}: is {what}; expected another path (writing there would destroy "
                                     "what the job reads or writes)")
            check_output_path(path)

    ranks.agree("expert load path check", check)


def start(rt: Any, ranks: Any) -> ExpertLoadRecorder:
    """A recorder attached to ``rt``'s stack (agreed: a model without sparse layers records nothing)."""
    def make() -> ExpertLoadRecorder:
        if not rt.model.sparse_layers:
            raise ConfigError("--expert-load: the model has no sparse layers; expected a model with routed experts")
        t = rt.topo
        placed = rt.expert_placement
        layout = {"world": t.world, "tp": t.tp, "ep": t.ep, "moe_tp": t.moe_tp,
                  "expert_placement": placed.digest if placed is not None else ""}
        return ExpertLoadRecorder(rt.model, layout, placed.phys_expert if placed is not None else None)

    recorder = ranks.agree("expert load recorder", make)
    recorder.attach(rt.stack)
    return recorder


def finish(recorder: ExpertLoadRecorder, ranks: Any, args: argparse.Namespace) -> None:
    """Gather the load, write it (rank 0, agreed) and print the report."""
    load = recorder.gather(ranks)

    def write() -> None:
        if ranks.rank == 0:
            load.save(args.expert_load)
            if args.plot:
                heat_map(load, plot_path(args.expert_load))

    ranks.agree("expert load write", write)
    if ranks.rank == 0:
        print("\n".join(load_lines(load)), flush=True)
        print(f"expert load: wrote {args.expert_load}" + (f" and {plot_path(args.expert_load)}" if args.plot else ""),
              flush=True)

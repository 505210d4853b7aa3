"""``glm-ep balance``: a load-aware placement of the experts from a recorded expert load (one process).

    glm-ep balance --load LOAD.safetensors --ep 8 [--redundant 8] --out PLACEMENT.json

It prints, for the recorded calls at each width, the busiest rank's slots against the mean under the
contiguous ranges (before) and under the placement (after): summed over the calls, and per call. Both are
counted on the calls the placement was made from; record again with the placement loaded (the topology's
``expert_placement``) to count it on fresh calls.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from glm_ep.app.files import check_output_path
from glm_ep.app.launcher import one_process
from glm_ep.balance import expert_load
from glm_ep.balance.eplb import balanced_placement
from glm_ep.balance.report import heat_map, layout_load, pyplot
from glm_ep.errors import InputError


def add_arguments(p: argparse.ArgumentParser, count) -> None:
    p.add_argument("--load", required=True, metavar="FILE", help="an expert load (run / forward --expert-load)")
    p.add_argument("--ep", type=count(1), required=True, help="the expert-parallel degree to place for")
    p.add_argument("--redundant", type=count(0), default=0, metavar="R",
                   help="replicas of the hottest experts (experts + R must divide over ep)")
    p.add_argument("--out", required=True, metavar="PLACEMENT.json", help="where the placement is written")
    p.add_argument("--plot", action="store_true", help="the load's heat map beside the placement, as .png")


def balance_job(args: argparse.Namespace) -> int:
    one_process("balance writes one placement")
    load = expert_load.read(args.load)
    out = Path(args.out)
    if out.resolve() == Path(args.load).resolve():
        raise InputError(f"--out {out}: is the --load file; expected another path")
    check_output_path(str(out))
    if args.plot:
        pyplot()
        check_output_path(str(out.with_suffix(".png")))
    placed = balanced_placement(load.logical_count, load.layers, args.ep, args.redundant)
    try:
        placed.save(out)
    except OSError as e:
        raise InputError(f"{out}: cannot write the placement ({e.strerror or e})") from None
    print(f"balance: {len(load.layers)} sparse layers of {load.num_experts} experts from {args.load} "
          f"({load.rows_seen[0]} rows a layer): {placed.slots} slots over ep = {args.ep} ({args.redundant} redundant); "
          f"wrote {out}")
    before, after = (layout_load(load, args.ep, 1, p) for p in (None, list(placed.phys_expert)))
    worse = []
    for b, a in zip(before, after):
        s0, s1 = b.slots, a.slots
        print(f"balance: ep {args.ep}, {b.rows}-row calls ({s0.calls} site calls): the busiest rank's slots / the "
              f"mean, summed over the calls {s0.aggregate:.3f}x contiguous -> {s1.aggregate:.3f}x placed; per call "
              f"{s0.per_call:.3f}x -> {s1.per_call:.3f}x")
        shown = [round(v, 3) for v in (s0.per_call, s1.per_call, s0.aggregate, s1.aggregate)]  # as printed above
        if shown[1] > shown[0] or shown[3] > shown[2]:
            worse.append(f"{b.rows}-row calls")
    if worse:  # the placement is still written: it may serve other calls better (the counts are of these calls)
        print(f"balance: warning: on the recorded {', '.join(worse)} the placement is less even than the contiguous "
              "ranges (its busiest rank's slots over the mean are higher); the placement balances each expert's load "
              "summed over the calls, not each call's: record more calls, or keep the contiguous ranges (no "
              "expert_placement) for these widths", file=sys.stderr)
    if args.plot:
        print(f"balance: wrote {heat_map(load, out.with_suffix('.png'))}")
    return 0

"""What the load-time NaN/Inf check costs: each rank's share of a checkpoint read with and without it.

    python -m glm_ep synth --preset glm-5.3-flash --layers 4 --out /tmp/glm4
    python tools/finite_cost.py /tmp/glm4 --tp 2 --ep 2

For each rank of the layout (one process, one rank after the other), the weights are read once to
warm the page cache, then read with ``check_finite`` on and off (interleaved, best of
``--repeats``), and the scan alone is timed on the arrays read. Prints the bytes scanned, the scan
rate, and the check's share of the load time. From the page cache the load is at its fastest, so
the share is an upper bound of what a cold read from disk sees.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from glm_ep.checkpoint.reader import Checkpoint
from glm_ep.checkpoint.layers import load_layer
from glm_ep.config.model import RankLayout, SiteConfig
from glm_ep.checkpoint.finite import can_be_nonfinite, first_nonfinite
from glm_ep.checkpoint.weights import DenseWeights, MoeWeights


def _arrays(w: DenseWeights | MoeWeights | None) -> list[np.ndarray]:
    if isinstance(w, DenseWeights):
        return [w.gate, w.up, w.down]
    if isinstance(w, MoeWeights):
        out = [w.router, w.bias] + (_arrays(w.shared) if w.shared is not None else [])
        return out + [p.scale for e in w.experts for p in (e.gate, e.up, e.down)]
    return []


def _load(model: str, cfg: SiteConfig, check: bool) -> tuple[float, list]:
    with Checkpoint(model, check_finite=check) as ckpt:
        t0 = time.perf_counter()
        layers = [load_layer(ckpt, cfg, i) for i in range(ckpt.config.num_hidden_layers)]
        return time.perf_counter() - t0, layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    world = max(args.tp, args.ep)
    with Checkpoint(args.model) as ckpt:
        model = ckpt.config
    for rank in range(world):
        cfg = SiteConfig.for_rank(model, RankLayout(world, rank, args.tp, args.ep))
        _load(args.model, cfg, False)  # page cache warm-up
        on, off = [], []
        for _ in range(args.repeats):
            on.append(_load(args.model, cfg, True)[0])
            dt, layers = _load(args.model, cfg, False)
            off.append(dt)
        scanned = [a for w in layers for a in _arrays(w) if can_be_nonfinite(a.dtype)]
        t0 = time.perf_counter()
        assert all(first_nonfinite(a) is None for a in scanned)
        scan = time.perf_counter() - t0
        nbytes = sum(a.nbytes for a in scanned)
        held = sum(w.nbytes for w in layers if w is not None)
        print(f"rank {rank}: holds {held / 1e9:.3f} GB, scans {nbytes / 1e9:.3f} GB (bf16/fp32 weights, E4M3 "
              f"scales) in {scan:.3f} s = {nbytes / scan / 1e9:.1f} GB/s; load from page cache "
              f"{min(off):.2f} s without the check, {min(on):.2f} s with it "
              f"(+{100 * (min(on) - min(off)) / min(off):.1f}%)", flush=True)


if __name__ == "__main__":
    main()

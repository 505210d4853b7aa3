"""What a recorded expert load implies per rank, under a layout: the lines rank 0 prints, and the heat map.

For each layout (``ep`` groups of ``moe_tp`` ranks, a placement's slots or the contiguous ranges) and each call
width the load recorded (rows per call), the calls' kept choices are counted (``glm_ep.balance.counting``): the
slots and routed bytes (an expert's NVFP4 bytes at the recorded widths, 1 / moe_tp of them a rank) each rank runs
and reads per call, their mean, the busiest rank's on average, and that over the mean (E[max] / E[mean]: what a
step pays, since the all-reduce waits for the busiest rank); and the max / mean of the slots summed over the
calls (what a placement evens out).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from glm_ep.balance.counting import ExpertLayout, Imbalance, expert_slice_bytes, rank_bytes, rank_slots
from glm_ep.balance.expert_load import ExpertLoad
from glm_ep.config.model import NVFP4_GROUP, ModelConfig
from glm_ep.errors import InputError


@dataclass(frozen=True)
class LayoutLoad:
    """One layout's per-rank load at one call width, over the recorded calls of every sparse layer."""

    name: str
    rows: int
    slots: Imbalance
    bytes: Imbalance


def layout_name(ep: int, moe_tp: int, placed: bool = False) -> str:
    parts = ([f"ep {ep}"] if ep > 1 or moe_tp == 1 else []) + ([f"moe_tp {moe_tp}"] if moe_tp > 1 else [])
    return " x ".join(parts) + (" (placement)" if placed else "")


def candidate_layouts(load: ExpertLoad, world: int | None = None) -> list[tuple[int, int]]:
    """Every ``(ep, moe_tp)`` with ``ep * moe_tp = world`` (the recorded one's by default) that the model splits."""
    world = world or load.layout["world"]
    m, e = load.model["moe_intermediate_size"], load.num_experts
    return [(world // t, t) for t in range(1, world + 1)
            if world % t == 0 and e % (world // t) == 0 and m % (t * NVFP4_GROUP) == 0]


def layout_load(load: ExpertLoad, ep: int, moe_tp: int, placement: list[np.ndarray] | None = None) -> list[LayoutLoad]:
    """Per call width, the per-rank load of ``load``'s kept calls under this layout (contiguous ranges, or
    ``placement``'s physical slots per layer)."""
    slice_bytes = expert_slice_bytes(load.model["hidden_size"], load.model["moe_intermediate_size"], moe_tp)
    found: dict[int, tuple[Imbalance, Imbalance]] = {}
    for j in range(len(load.layers)):
        phys = placement[j] if placement is not None else np.arange(load.num_experts, dtype=np.int32)
        layout, ids = ExpertLayout(ep, moe_tp, phys), load.choices[j]
        start = 0
        for rows in load.call_rows[j].tolist():
            if start + rows > ids.shape[0]:
                break  # past the kept choices
            slots_R = layout.physical(ids[start:start + rows])
            slots, byts = found.setdefault(rows, (Imbalance(), Imbalance()))
            slots.add(rank_slots(slots_R, layout))
            byts.add(rank_bytes(slots_R, layout, slice_bytes))
            start += rows
    name = layout_name(ep, moe_tp, placement is not None)
    return [LayoutLoad(name, rows, *found[rows]) for rows in sorted(found)]


def _spread(values: list[int]) -> str:
    return str(values[0]) if min(values) == max(values) else f"{min(values)}..{max(values)}"


def _per_rank(total_R: np.ndarray, calls: int, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return " / ".join(fmt.format(v / calls / scale) for v in total_R)


def load_lines(load: ExpertLoad, layouts: list[tuple[int, int]] | None = None) -> list[str]:
    """The report: what was recorded, then per layout (the recorded one first, with its placement where it had
    one) and call width, slots and routed MB per rank per call, mean, busiest and busiest / mean."""
    rows, calls = load.rows_seen, [len(c) for c in load.call_rows]
    kept = [c.shape[0] for c in load.choices]
    lines = [f"expert load: {_spread(rows)} rows in {_spread(calls)} calls through each of {len(load.layers)} sparse "
             f"layers, top-{load.top_k} of {load.num_experts} experts; recorded at world {load.layout['world']}, "
             f"{layout_name(load.layout['ep'], load.layout['moe_tp'], bool(load.layout.get('expert_placement')))}"
             + ("" if kept == rows else f"; the choices of the first {_spread(kept)} rows a layer kept")]
    ran = load.rank_slots.sum(axis=0)
    lines.append(f"expert load: slots the ranks ran (each counted its own): {' / '.join(str(v) for v in ran)}"
                 + (f", busiest / mean {ran.max() / ran.mean():.3f}" if ran.mean() else ""))
    recorded = (load.layout["ep"], load.layout["moe_tp"])
    wanted = [(*recorded, load.placement)] + [(ep, t, None) for ep, t in (layouts or candidate_layouts(load))
                                               if load.placement is not None or (ep, t) != recorded]
    for ep, moe_tp, placement in wanted:
        for ll in layout_load(load, ep, moe_tp, placement):
            s, b, n = ll.slots, ll.bytes, ll.slots.calls
            lines.append(
                f"expert load: {ll.name}, {ll.rows}-row calls ({n} site calls): slots per rank "
                f"{_per_rank(s.total_R, n)} (mean {s.mean:.2f}, busiest {s.busiest:.2f}: {s.per_call:.3f}x; summed "
                f"over the calls {s.aggregate:.3f}x); routed MB per rank {_per_rank(b.total_R, n, 1e6, '{:.4g}')} (mean "
                f"{b.mean / 1e6:.4g}, busiest {b.busiest / 1e6:.4g}: {b.per_call:.3f}x)")
    return lines


UNIFORM_DRAWS = 20_000  # seeded uniform top-k draws the footprint's decode figure takes without a recorded load


def decode_row_line(model: ModelConfig, ep: int, moe_tp: int, load: ExpertLoad | None = None) -> str:
    """The footprint's line: the routed bytes of one decode row on the busiest rank against the mean under ``ep``
    groups of ``moe_tp`` ranks (contiguous ranges), over the rows of ``load`` (each row a one-row call, every
    sparse layer), else over seeded uniform draws of top-k distinct experts."""
    e, k = model.n_routed_experts, model.num_experts_per_tok
    if load is not None:
        rows_TK = [ids for ids in load.choices if ids.size]
        source = f"the recorded load's {_spread([len(r) for r in rows_TK])} rows x {len(rows_TK)} layers"
    else:
        rng = np.random.default_rng(0)
        rows_TK = [np.argsort(rng.random((UNIFORM_DRAWS, e)), axis=1)[:, :k]]
        source = f"uniform routing, {UNIFORM_DRAWS} seeded draws"
    layout = ExpertLayout.contiguous(e, ep, moe_tp)
    slice_bytes = expert_slice_bytes(model.hidden_size, model.moe_intermediate_size, moe_tp)
    im = Imbalance()
    for ids in rows_TK:
        for row in ids:
            im.add(rank_bytes(row[None], layout, slice_bytes))
    return (f"routed experts per decode row and sparse layer ({layout_name(ep, moe_tp)}; {source}): the busiest rank "
            f"reads {im.busiest / 1e6:.2f} MB, the mean {im.mean / 1e6:.2f} MB: {im.per_call:.3f}x")


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files; an InputError saying how to install it where it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib (the bench extra): pip install '.[bench]'") from None
    return plt


def heat_map(load: ExpertLoad, path: str | Path) -> Path:
    """A PNG of the load, sparse layers x experts, each layer's counts over its mean."""
    plt = pyplot()
    counts = load.logical_count.astype(np.float64)
    mean = np.maximum(counts.mean(axis=1, keepdims=True), 1e-12)
    fig, ax = plt.subplots(figsize=(min(24, 4 + load.num_experts / 16), 2 + 0.25 * len(load.layers)))
    im = ax.imshow(counts / mean, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_yticks(range(len(load.layers)), [str(i) for i in load.layers])
    ax.set_title(f"expert load, {_spread(load.rows_seen)} rows a layer: slots per expert / the layer's mean")
    fig.colorbar(im, ax=ax)
    from glm_ep.app.files import replacing

    p = Path(path)
    try:
        with replacing(p) as tmp:  # a write cut short leaves no partial image
            fig.savefig(tmp, dpi=100, bbox_inches="tight", format="png")
    except OSError as e:
        raise InputError(f"{p}: cannot write the heat map ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return p

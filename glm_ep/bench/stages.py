"""Where a sparse site's time goes: the backend ops one call queues, each timed alone.

``OpRecorder`` stands in for a backend while a site runs once and keeps every op the site and its dispatch call on
it (``route``, ``union_table``, ``moe_gate_up_act_union``, ..., ``combine_site``), with its arguments: a record is
the site's stages as the levers chose them. The backend methods an op calls on the backend itself are kept as its
``parts`` (the router's logits and top-k, the shared gate + up, ... where the op runs them apart). ``glm-ep bench``
records one call of each of several sites (distinct weights, one width), times each stage (and each of its parts)
replayed alone over those sites as a CUDA graph (``bench --prefill --stages``: one call's GPU time), and sets the
stages' sum beside the whole site's time: the difference is what the launches
overlap (programmatic dependent launch) or what the stages cost only together. Each stage's bytes (``stage_bytes``)
put it beside the copy bandwidth. The fixed cost of one launch is timed the same way, as a graph of many launches
of the smallest kernel. The tables are ``stage_lines`` (no GPU needed).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from glm_ep.app.footprint import nvfp4_bytes
from glm_ep.config.model import ModelConfig

log = logging.getLogger(__name__)

# What each recorded op is, as the table names it (a 1-row combine_site also runs the routed down projection)
LABELS = {
    "route": "router + top-k",  # label(): "+ shared gate + up" where they ran beside it
    "map_expert_ids": "placement's id map",
    "union_table": "union table",
    "moe_gate_up_act_union": "routed gate + up + SwiGLU (union)",
    "moe_gemv_union": "routed down (union)",
    "moe_gate_up_act": "routed gate + up + SwiGLU",
    "moe_gemv": "routed down",
    "gate_up_act": "shared gate + up + SwiGLU",
    "combine_site": "shared down + combine",
    "sort_by_expert": "sort by expert",
    "moe_experts_sorted": "routed experts (grouped GEMM: gate + up + SwiGLU, down)",
}
# ... and what a stage's parts (the backend methods an op runs on itself) are called, where it differs
PART_LABELS = {
    "router_logits": "router logits",
    "router_topk": "top-k",
    "route_and_gate_up_act": "router + top-k + shared gate + up",
    "linear": "projection",
    "swiglu": "SwiGLU",
    "combine": "combine",
    "shared_down_combine": "shared down + combine",
    "moe_down_shared_combine": "routed down + shared down + combine",
    "moe_gemv": "routed projection",
    "moe_gemv_union": "routed projection (union)",
    "moe_gemm_sorted": "routed projection (grouped GEMM)",
    "moe_gate_up_act_sorted": "routed gate + up + SwiGLU (grouped GEMM)",
}


@dataclass(frozen=True)
class Op:
    """One recorded backend call: ``op()`` queues it again with the same arguments. ``parts``: the backend methods
    it called on itself, in order, each an ``Op`` with its own parts (empty: it queued its kernels directly)."""

    name: str
    fn: Callable[..., Any] = field(repr=False)
    args: tuple[Any, ...] = field(repr=False)
    kwargs: dict[str, Any] = field(repr=False)
    parts: list["Op"] = field(default_factory=list, repr=False, compare=False)

    def __call__(self) -> Any:
        return self.fn(*self.args, **self.kwargs)

    def leaves(self) -> list["Op"]:
        """The calls under this one that call no other backend method: what it queues, in order (itself if none)."""
        return [leaf for p in self.parts for leaf in p.leaves()] or [self]


class OpRecorder:
    """A backend's stand-in: every attribute is the backend's; while ``record`` runs, each public method called on
    the recorder is also kept as an ``Op``, and each public method the backend calls on itself inside it as one of
    that op's ``parts``."""

    def __init__(self, be: Any):
        self._be = be
        self._ops: list[Op] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._be, name)  # while recording, a public method is the backend's recording twin

    def record(self, fn: Callable[[], Any]) -> list[Op]:
        """The ops ``fn`` (one site call on this recorder) queues, in order, each with its parts. The backend's
        instance is as it was after, whatever ``fn`` raised."""
        be, ops, running = self._be, [], []
        if self._ops is not None:
            raise RuntimeError("OpRecorder.record: already recording (a record does not nest)")
        # the backend's own methods: not its static or class methods, properties or attributes
        methods = [n for n in dir(type(be)) if not n.startswith("_")
                   and inspect.isfunction(inspect.getattr_static(type(be), n))]
        saved = {n: vars(be)[n] for n in methods if n in vars(be)}  # an instance's own attribute of a method's name

        def twin(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
            def op(*args: Any, **kwargs: Any) -> Any:
                node = Op(name, method, args, kwargs)
                (running[-1].parts if running else ops).append(node)
                running.append(node)
                try:
                    return method(*args, **kwargs)
                finally:
                    running.pop()
            return op

        self._ops = ops
        try:
            for name in methods:  # the instance's twins shadow the class's methods, for the site and the backend alike
                setattr(be, name, twin(name, getattr(be, name)))
            fn()
            return ops
        finally:
            self._ops = None
            for name in methods:
                if name in saved:
                    setattr(be, name, saved[name])
                elif name in vars(be):
                    delattr(be, name)


def stage_names(records: list[list[Op]]) -> list[str]:
    """The ops of one call, the same in every record (sites of one width take one path); a ValueError otherwise."""
    names = [[o.name for o in ops] for ops in records]
    if not names or any(n != names[0] for n in names):
        raise ValueError(f"sites of one width queued different ops: {names}")
    return names[0]


def splittable(names: list[str]) -> bool:
    """Whether each op replayed alone times what it did in the call: not where the call queues an op more than once
    (several row groups, or one row at a time), whose later tables overwrite the earlier ones' in the workspace."""
    return len(set(names)) == len(names)


def stage_row(model: ModelConfig, be: Any, rows: int, records: list[list[Op]], site_us: float,
              time_ops: Callable[[list[Op]], float]) -> dict[str, Any]:
    """The stage table's row of a call of ``rows`` rows (``stage_lines``): the ops of ``records`` (one call of each
    site, the same ops in each: ``stage_names``), stage j timed by ``time_ops`` (given stage j's op of every record,
    it replays them alone) with its bytes over the union of the last call's experts (``be`` reads its ids), beside
    ``site_us``. A stage whose op ran more than one backend method of its own (``Op.leaves``: the router's logits,
    its top-k and the shared gate + up where they run apart) also gets those parts (``parts_of``), each timed the
    same way. A call that queues an op more than once is left whole, with a note saying so."""
    names, last = stage_names(records), records[-1]
    ids = next((op.args[5] for op in last if op.name == "route"), None)  # the routing the replays read
    union = len(np.unique(be.to_host(ids))) if ids is not None else 0
    st = [{"op": name, "label": label(last[j]), "us": time_ops([ops[j] for ops in records]),
           "bytes": stage_bytes(model, last[j], union)} for j, name in enumerate(names if splittable(names) else [])]
    for j, stage in enumerate(st):
        parts = parts_of(records, j)
        if len(parts) > 1:
            stage["parts"] = [{"op": p.name, "label": PART_LABELS.get(p.name) or label(p),
                               "us": time_ops([ops[j].leaves()[i] for ops in records]),
                               "bytes": stage_bytes(model, p, union)} for i, p in enumerate(parts)]
    note = "" if st else (f"the call queues {', '.join(names)} (an op more than once: several row groups, or a "
                          "row at a time)")
    log.info("stages %d rows: site %.1f us, %s", rows, site_us, ", ".join(f"{t['op']} {t['us']:.1f}" for t in st))
    return {"rows": rows, "union": union, "site_us": site_us, "stages": st, "note": note}


def parts_of(records: list[list[Op]], j: int) -> list[Op]:
    """Stage j's parts in the last record (``Op.leaves``), where every record's stage j has the same ones (else
    none: the stage is shown whole)."""
    names = [[p.name for p in ops[j].leaves()] for ops in records]
    return records[-1][j].leaves() if all(n == names[0] for n in names) else []


def label(op: Op) -> str:
    """What the table calls ``op``: a combine that also runs a pending one-row routed down projection says so."""
    if op.name == "combine_site" and op.args[0].down is not None:
        return "routed down + shared down + combine"
    if op.name == "route":
        return "router + top-k + shared gate + up" if _beside(op) is not None else "router + top-k"
    return LABELS.get(op.name, op.name)


def _beside(op: Op) -> Any:
    """A ``route`` op's shared-expert weights run beside the router (None: the router alone)."""
    return op.args[7] if len(op.args) > 7 else op.kwargs.get("beside")


def stage_bytes(model: ModelConfig, op: Op, union: int) -> int:
    """The weight bytes ``op`` reads at least, with ``union`` distinct experts chosen: the router and its bias, the
    shared expert's gate and up (beside the router, or on their own), the union's routed projections, the shared
    expert's down projection (and at one row the routed down projection left to the combine). 0 for an op that
    reads no weights. Over one sparse site's ops: ``common.sparse_bytes(model, union)`` at world 1."""
    h, m = model.hidden_size, model.moe_intermediate_size
    a = op.args
    if op.name == "route":
        beside = _beside(op)
        return a[1].nbytes + a[2].nbytes + (beside.w.gate.nbytes + beside.w.up.nbytes if beside is not None else 0)
    if op.name == "gate_up_act":  # the shared expert's first half where it did not run beside the router
        return a[1].gate.nbytes + a[1].up.nbytes
    # parts: the router's weights (logits), its bias (top-k), one bf16 projection (the shared gate, up or down)
    if op.name in ("router_logits", "router_topk", "linear"):
        return a[1].nbytes
    if op.name in ("moe_gate_up_act_union", "moe_gate_up_act"):
        return union * 2 * nvfp4_bytes(m, h)
    if op.name in ("moe_gemv_union", "moe_gemv", "moe_gemm_sorted"):  # one routed projection of the union
        return union * nvfp4_bytes(h, m)
    if op.name == "moe_experts_sorted":
        return union * (2 * nvfp4_bytes(m, h) + nvfp4_bytes(h, m))
    if op.name == "combine_site":
        routed, shared = a[0], a[2]
        return ((shared.down_HI.nbytes if shared is not None else 0)
                + (union * nvfp4_bytes(h, m) if routed.down is not None else 0))
    return 0


#: how ``stage_lines`` says its stages and site were timed: the decode bench's graphs, the prefill bench's single calls
GRAPHED = ("timed alone over the same layers' distinct weights, a CUDA graph each; µs a layer, % of the copy "
           "bandwidth over the stage's bytes (the union of the call's experts)")
ONE_CALL = ("timed alone, as the whole site beside it, one call at a time on its GPU time only (the host's launches "
            "held out by a spin kernel queued ahead) with the L2 flushed before it, after the card idled a second "
            "(a sustained run leaves its clock lowered for a while); µs, % of the copy bandwidth over "
            "the stage's weight bytes (the union of the call's experts). Activations are not counted: from about 256 "
            "rows the router's x and the combine's routed rows weigh as much as their weights, and from 1024 rows "
            "the routed experts' FLOPs bound them. A stage alone starts from a flushed L2, so a negative remainder "
            "below also holds what one stage leaves in L2 for the next")


#: what the last column says, where a table has it (``site_plain_us`` in a row)
PLAIN = (" The last column: the whole site again, its kernels launched plain instead of each as a programmatic "
         "dependent of the one before it (the backend's ``pdl`` off for that call only), timed alternately with the "
         "site, one call of each a round and the order turned every round: what programmatic dependent launch buys "
         "the site, or costs it.")


def stage_lines(stages: list[dict[str, Any]], launch: dict[str, float] | None, copy_gbs: float,
                timing: str = GRAPHED) -> list[str]:
    """The results file's section: per width, the site's time, each stage alone (µs, % of the copy bandwidth
    over its bytes) with its parts in brackets where it has them, their sum; then the fixed cost of a launch.
    ``timing``: how the stages and the site were timed (``GRAPHED``: the decode bench's CUDA graphs; ``ONE_CALL``:
    the prefill bench's single calls)."""
    if not stages:
        return []
    plain = any(s.get("site_plain_us") is not None for s in stages)

    def plain_cell(s: dict[str, Any]) -> str:  # the last column's cell, where the table has it
        if not plain:
            return ""
        us = s.get("site_plain_us")
        return f" {us:.1f} |" if us is not None else " — |"

    lines = ["", "## Where the sparse site's time goes", "",
             f"Each stage of the site (the backend ops one call queues, as the levers chose them) {timing}. The "
             "stages' sum beside the whole site: what is left over is what the stages cost only together, a "
             "negative one what their launches overlap. In brackets, a stage's parts where it runs them apart (the "
             "backend methods it calls, e.g. the router's logits, its top-k and the shared expert's gate + up), each "
             "timed alone the same way." + (PLAIN if plain else ""), "",
             "| rows | site µs | stages: µs (% of copy bw) | sum of stages µs | site − sum µs |"
             + (" site, plain launches µs |" if plain else ""),
             "|---:|---:|---|---:|---:|" + ("---:|" if plain else "")]
    def said(st: dict[str, Any]) -> str:  # label, µs and % of copy over its bytes (none without bytes)
        pct = (f" ({100.0 * st['bytes'] / (st['us'] * 1e-6) / 1e9 / copy_gbs:.0f}%)"
               if st["bytes"] and st["us"] > 0 else "")
        return f"{st['label']} {st['us']:.1f}{pct}"

    for s in stages:
        if not s["stages"]:
            lines.append(f"| {s['rows']} | {s['site_us']:.1f} | not split: {s.get('note', '')} | — | — |"
                         + plain_cell(s))
            continue
        parts = [said(st) + (f" [{', '.join(said(p) for p in st['parts'])}]" if st.get("parts") else "")
                 for st in s["stages"]]
        total = sum(st["us"] for st in s["stages"])
        lines.append(f"| {s['rows']} | {s['site_us']:.1f} | {'; '.join(parts)} | {total:.1f} | "
                     f"{s['site_us'] - total:+.1f} |" + plain_cell(s))
    if launch:
        dependent = (f"{launch['dependent_us']:.2f} µs as programmatic dependents, " if launch.get("dependent_us")
                     is not None else "programmatic dependent launch off here (levers.pdl = false, or before "
                     "sm_90), ")
        lines += ["", "The fixed cost of one launch, the smallest kernel (a 1 x 8 bf16 add) launched "
                  f"{launch['launches']} times in one CUDA graph: {dependent}{launch['plain_us']:.2f} µs plain."]
    return lines

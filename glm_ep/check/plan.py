"""What ``glm-ep run``'s float64 check evaluates, and the memory that takes.

``full`` evaluates every site of every call, on every row, keeping each float64 matrix once made
(each layer read and decoded once): its memory is the float64 size of a rank's layers, far past
any machine at the real shape (a sparse GLM-5.3-Flash layer is ~58 GB in float64). ``sampled``
evaluates the first dense layer, the first and last sparse layers and a few seeded others, on
every decode row and a few seeded rows of each wider call, streaming weights a block at a time
and reading only the experts those rows chose: its memory is one block and the activations.
``auto`` is full where its estimate fits ``MEMORY_FRACTION`` of the physical memory each rank of a
node can count on, else sampled. Checked layers are shared out over the ranks in turn.

The plan is made before the load, against the memory each rank will have left for it
(``memory_available``: the host's available memory and its cgroup's limit shared by the host's ranks,
the process's own ``ulimit -v`` / ``-d``, less what the load will hold): a mode whose estimate does not
fit is refused there, naming both and the mode that fits, never run into a MemoryError.
"""

from __future__ import annotations

import os
import resource
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from glm_ep.config.model import ModelConfig
from glm_ep.errors import ConfigError
from glm_ep.dist.ranks import Ranks
from glm_ep.check.reference import float64_layer_bytes, working_bytes
from glm_ep.mlp.workspace import fmt_bytes, free_memory_bytes

MODES = ("auto", "full", "sampled", "none")
MEMORY_FRACTION = 0.25  # of a node's physical memory, shared by the ranks on that node
SAMPLED_EXTRA_LAYERS = 2  # seeded layers besides the first dense, first sparse and last sparse
SAMPLED_ROWS = 4  # seeded rows of each call wider than one row (decode rows are all checked)
# Python memory of one parsed tensor header entry (the check opens the checkpoint): at the parse's peak, 1034518
# bytes for the tiny preset's 882 entries (648 each once parsed): 500 left a sampled check of it over its estimate
HEADER_ENTRY_BYTES = 1200


@dataclass(frozen=True)
class CheckPlan:
    mode: str  # "full" or "sampled"
    layers: tuple[int, ...]  # the checked layers, ascending
    rows: tuple[tuple[int, ...], ...]  # per call, the checked rows
    call_rows: tuple[int, ...]  # per call, its rows
    n_layers: int  # the model's
    world: int
    estimate_bytes: int  # float64 memory of the check on the rank that needs most
    budget_bytes: int
    available_bytes: int | None = None  # what the rank with least left will have for it (None: not known)

    def layers_of(self, rank: int) -> tuple[int, ...]:
        """The checked layers rank ``rank`` evaluates."""
        return self.layers[rank::self.world]

    @property
    def site_calls(self) -> int:
        return len(self.layers) * len(self.rows)

    def checked(self) -> str:
        """What is checked, in words."""
        return (f"{self.mode}: layers {list(self.layers)} of {self.n_layers}, {sum(map(len, self.rows))} of "
                f"{sum(self.call_rows)} rows over {len(self.rows)} calls ({self.site_calls} site calls)")

    def estimate_line(self) -> str:
        available = "" if self.available_bytes is None else f"; available {fmt_bytes(self.available_bytes)}"
        return (f"check: float64 {self.checked()}; memory estimate {fmt_bytes(self.estimate_bytes)} per rank "
                f"(budget {fmt_bytes(self.budget_bytes)}: {MEMORY_FRACTION:g} of physical memory per rank"
                f"{available})")


def memory_budget(ranks: Ranks) -> int:
    """``MEMORY_FRACTION`` of the physical memory per rank on the node, the least over the ranks
    (the same on every rank)."""
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    every = ranks.allgather("check memory budget", (socket.gethostname(), phys))
    hosts = [host for host, _ in every]
    return int(min(MEMORY_FRACTION * mem / hosts.count(host) for host, mem in every))


@dataclass(frozen=True)
class Available:
    """The memory the rank with least left can allocate for the check, and what bounds it, in words."""

    bytes: int
    bound: str  # e.g. "the address-space limit (ulimit -v) of rank 1, less its load's 340.00 MB"


def _proc_status_bytes(key: str) -> int:
    """``VmSize`` / ``VmData`` of this process in bytes (0 where the system does not say)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cgroup_headroom() -> int | None:
    """What this process's cgroup (v2) may still allocate under its ``memory.max``; None without a limit."""
    try:
        path = Path("/proc/self/cgroup").read_text().strip().splitlines()[0].partition("::")[2]
        folder = Path("/sys/fs/cgroup") / path.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        return None if limit == "max" else int(limit) - int((folder / "memory.current").read_text())
    except (OSError, ValueError, IndexError):
        return None


def _limit_headroom() -> tuple[int, str] | None:
    """What this process's own limits (``ulimit -v``: address space; ``ulimit -d``: data) still allow, the tighter
    of them, and its name; None without a limit."""
    found = []
    for limit, used, name in ((resource.RLIMIT_AS, "VmSize", "the address-space limit (ulimit -v)"),
                              (resource.RLIMIT_DATA, "VmData", "the data limit (ulimit -d)")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY:
            found.append((max(0, soft - _proc_status_bytes(used)), name))
    return min(found) if found else None


def memory_available(ranks: Ranks, held_bytes: int) -> Available:
    """The memory each rank can count on for the check, the least over the ranks (collective: the same on every
    rank): its host's available memory, or its cgroup's headroom where tighter, shared by the ranks on that host;
    its process's own limit where tighter still; less ``held_bytes``, what this rank's load will still take."""
    host = socket.gethostname()
    shared = [(v, what) for v, what in ((free_memory_bytes(np), "the host's available memory"),
                                        (_cgroup_headroom(), "the cgroup's memory.max")) if v is not None]
    every = ranks.allgather("check memory available", (host, shared, _limit_headroom(), held_bytes))
    hosts = [h for h, _, _, _ in every]
    options = []
    for r, (h, host_bounds, own, held) in enumerate(every):
        per_rank = [(v // hosts.count(h), f"{what} over the {hosts.count(h)} rank(s) on {h}")
                    for v, what in host_bounds]
        bounds = per_rank + ([(own[0], f"{own[1]} of rank {r}")] if own is not None else [])
        if bounds:
            v, what = min(bounds)
            options.append((max(0, v - held), f"{what}, less its load's {fmt_bytes(held)}" if held else what))
    v, bound = min(options) if options else (2**63 - 1, "not known")
    return Available(v, bound)


def sampled_layers(model: ModelConfig, seed: int) -> tuple[int, ...]:
    dense, sparse = model.dense_layers, model.sparse_layers
    fixed = {*dense[:1], *sparse[:1], *sparse[-1:]}
    others = [i for i in range(model.num_hidden_layers) if i not in fixed]
    rng = np.random.default_rng(seed)
    extra = rng.choice(others, size=min(SAMPLED_EXTRA_LAYERS, len(others)), replace=False) if others else []
    return tuple(sorted(fixed | {int(i) for i in extra}))


def sampled_rows(call_rows: Sequence[int], seed: int) -> tuple[tuple[int, ...], ...]:
    rng = np.random.default_rng(seed + 1)
    return tuple(tuple(range(n)) if n <= SAMPLED_ROWS
                 else tuple(int(r) for r in np.sort(rng.choice(n, size=SAMPLED_ROWS, replace=False)))
                 for n in call_rows)


def estimate_bytes(model: ModelConfig, mode: str, layers: Sequence[int], rows: Sequence[Sequence[int]],
                   world: int) -> int:
    """The float64 memory of the check on the rank that needs most: the checkpoint's parsed headers,
    the working set of its widest call, plus, when full, the float64 size of its layers kept resident."""
    tensors = (3 * len(model.dense_layers)
               + len(model.sparse_layers) * (2 + 3 * model.n_shared_experts + 4 * 3 * model.n_routed_experts))
    working = tensors * HEADER_ENTRY_BYTES + working_bytes(model, max((len(r) for r in rows), default=0))
    if mode != "full":
        return working
    return working + max(sum(float64_layer_bytes(model, i) for i in layers[r::world]) for r in range(world))


def plan_check(model: ModelConfig, mode: str, call_rows: Sequence[int], seed: int, world: int,
               budget_bytes: int, available: Available | None = None) -> CheckPlan:
    """The check for ``mode`` (auto, full or sampled) of calls of ``call_rows`` rows each. ``auto`` takes ``full``
    where its estimate fits the budget and the memory ``available``; a mode whose estimate does not fit what is
    available is refused (ConfigError naming both and what to run instead)."""
    if mode not in MODES[:3]:
        raise ConfigError(f"check mode {mode!r}, expected one of {', '.join(MODES[:3])}")
    room = available.bytes if available is not None else None
    full = (tuple(range(model.num_hidden_layers)), tuple(tuple(range(n)) for n in call_rows))
    sampled = (sampled_layers(model, seed), sampled_rows(call_rows, seed))
    estimates = {"full": estimate_bytes(model, "full", *full, world),
                 "sampled": estimate_bytes(model, "sampled", *sampled, world)}
    chosen = mode
    if mode == "auto":
        fits = estimates["full"] <= min(budget_bytes, room if room is not None else budget_bytes)
        chosen = "full" if fits else "sampled"
    if available is not None and estimates[chosen] > available.bytes:
        instead = ("--check sampled (its estimate: " + fmt_bytes(estimates["sampled"]) + "), or auto, which picks it"
                   if chosen == "full" and estimates["sampled"] <= available.bytes
                   else "--check none, or more memory per rank (more nodes, fewer ranks per node)")
        raise ConfigError(f"--check {mode}: the {chosen} check's float64 memory estimate is "
                          f"{fmt_bytes(estimates[chosen])} per rank, but {fmt_bytes(available.bytes)} is available "
                          f"({available.bound}); expected {instead}")
    layers, rows = full if chosen == "full" else sampled
    return CheckPlan(chosen, layers, rows, tuple(call_rows), model.num_hidden_layers, world, estimates[chosen],
                     budget_bytes, room)

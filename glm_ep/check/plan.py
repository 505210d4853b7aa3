"""What ``glm-ep run``'s float64 check evaluates, and the memory that takes.

``full`` evaluates every site of every call, on every row, keeping each float64 matrix once made
(each layer read and decoded once): its memory is the float64 size of a rank's layers, far past
any machine at the real shape (a sparse GLM-5.3-Flash layer is ~58 GB in float64). ``sampled``
evaluates the first dense layer, the first and last sparse layers and a few seeded others, on
every decode row and a few seeded rows of each wider call, streaming weights a block at a time
and reading only the experts those rows chose: its memory is one block and the activations.
``auto`` is full where its estimate fits ``MEMORY_FRACTION`` of the physical memory each rank of a
node can count on, else sampled. Checked layers are shared out over the ranks in turn.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from glm_ep.config.model import ModelConfig
from glm_ep.errors import ConfigError
from glm_ep.dist.ranks import Ranks
from glm_ep.check.reference import float64_layer_bytes, working_bytes
from glm_ep.mlp.workspace import fmt_bytes

MODES = ("auto", "full", "sampled", "none")
MEMORY_FRACTION = 0.25  # of a node's physical memory, shared by the ranks on that node
SAMPLED_EXTRA_LAYERS = 2  # seeded layers besides the first dense, first sparse and last sparse
SAMPLED_ROWS = 4  # seeded rows of each call wider than one row (decode rows are all checked)
HEADER_ENTRY_BYTES = 500  # Python memory of one parsed tensor header entry (the check opens the checkpoint)


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
        return (f"check: float64 {self.checked()}; memory estimate {fmt_bytes(self.estimate_bytes)} per rank "
                f"(budget {fmt_bytes(self.budget_bytes)}: {MEMORY_FRACTION:g} of physical memory per rank)")


def memory_budget(ranks: Ranks) -> int:
    """``MEMORY_FRACTION`` of the physical memory per rank on the node, the least over the ranks
    (the same on every rank)."""
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    every = ranks.allgather("check memory budget", (socket.gethostname(), phys))
    hosts = [host for host, _ in every]
    return int(min(MEMORY_FRACTION * mem / hosts.count(host) for host, mem in every))


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
               budget_bytes: int) -> CheckPlan:
    """The check for ``mode`` (auto, full or sampled) of calls of ``call_rows`` rows each."""
    if mode not in MODES[:3]:
        raise ConfigError(f"check mode {mode!r}, expected one of {', '.join(MODES[:3])}")
    full = (tuple(range(model.num_hidden_layers)), tuple(tuple(range(n)) for n in call_rows))
    if mode == "auto":
        fits = estimate_bytes(model, "full", *full, world) <= budget_bytes
        mode = "full" if fits else "sampled"
    layers, rows = full if mode == "full" else (sampled_layers(model, seed), sampled_rows(call_rows, seed))
    return CheckPlan(mode, layers, rows, tuple(call_rows), model.num_hidden_layers, world,
                     estimate_bytes(model, mode, layers, rows, world), budget_bytes)

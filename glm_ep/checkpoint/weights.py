"""One rank's host-side weights for each MLP site, as read from the checkpoint.

Shapes are ``[out, in]`` as in the checkpoint. TP slices are already cut: a dense/shared
``gate``/``up`` holds this rank's output rows (column-parallel), ``down`` its input columns
(row-parallel). Routed experts are whole, and only this rank's contiguous EP range is held.
Backends turn these into their own resident form (``Backend.upload_*``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from glm_ep.checkpoint.nvfp4 import Nvfp4Weight


@dataclass(frozen=True)
class DenseWeights:
    """A bf16 clamped-SwiGLU MLP (dense FFN or shared expert): this rank's TP shard."""

    gate: np.ndarray  # bf16 [I_local, H]
    up: np.ndarray  # bf16 [I_local, H]
    down: np.ndarray  # bf16 [H, I_local]

    @property
    def width(self) -> int:
        return self.gate.shape[0]

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert, NVFP4: gate/up ``[I, H]``, down ``[H, I]``."""

    gate: Nvfp4Weight
    up: Nvfp4Weight
    down: Nvfp4Weight

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


@dataclass(frozen=True)
class MoeWeights:
    """A routed-MoE site on one rank.

    ``experts[i]`` is global expert ``expert_start + i``. ``experts`` is empty and ``shared`` is
    None on a rank that does not contribute them (a replica when ep or tp < world).
    """

    router: np.ndarray  # [E, H], bf16 or fp32 as stored
    bias: np.ndarray  # fp32 [E], selection only
    expert_start: int
    experts: tuple[ExpertWeights, ...]
    shared: DenseWeights | None

    @property
    def nbytes(self) -> int:
        shared = self.shared.nbytes if self.shared is not None else 0
        return self.router.nbytes + self.bias.nbytes + shared + sum(e.nbytes for e in self.experts)


SiteWeights = DenseWeights | MoeWeights

"""A single-process float64 evaluation of the MLP stack, straight from the checkpoint.

It shares no arithmetic with the backends: whole (unsharded) weights, NVFP4 dequantized to
float64, the router in float64, no bf16 rounding anywhere after the bf16 input. A faithful bf16
pipeline lands about 3e-3 relative (L2) from it; 1e-2 is the bound the run checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

from glm_ep.checkpoint import Checkpoint, load_layer
from glm_ep.config import ModelConfig, RankLayout, SiteConfig
from glm_ep.nvfp4 import dequantize
from glm_ep.weights import DenseWeights, MoeWeights


def _f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def mlp64(w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, limit: float, x: np.ndarray) -> np.ndarray:
    g = np.minimum(x @ w_gate.T, limit)
    u = np.clip(x @ w_up.T, -limit, limit)
    with np.errstate(over="ignore"):  # exp(-g) -> inf for a very negative gate: silu -> -0
        return (g / (1.0 + np.exp(-g)) * u) @ w_down.T


class Reference:
    """float64 sites of a checkpoint: ``layers`` resident (default all, whole, not sharded),
    experts dequantized lazily. ``check_finite`` as in ``Checkpoint``."""

    def __init__(self, model_dir: str | Path, layers: Iterable[int] | None = None, check_finite: bool = True):
        with Checkpoint(model_dir, check_finite=check_finite) as ckpt:
            self.model: ModelConfig = ckpt.config
            cfg = SiteConfig.for_rank(self.model, RankLayout(1, 0, 1, 1))
            wanted = range(self.model.num_hidden_layers) if layers is None else layers
            self.layers = {i: load_layer(ckpt, cfg, i) for i in wanted}
        self._experts: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}

    def _dense(self, w: DenseWeights) -> tuple[np.ndarray, ...]:
        return _f64(w.gate), _f64(w.up), _f64(w.down)

    def _expert(self, layer: int, e: int) -> tuple[np.ndarray, ...]:
        key = (layer, e)
        if key not in self._experts:
            ex = self.layers[layer].experts[e]
            self._experts[key] = tuple(dequantize(p).astype(np.float64) for p in (ex.gate, ex.up, ex.down))
        return self._experts[key]

    def route(self, layer: int, x_TH: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        m, w = self.model, self.layers[layer]
        scores = 1.0 / (1.0 + np.exp(-(x_TH @ _f64(w.router).T)))
        choice = scores + _f64(w.bias)[None, :]
        ids = np.argsort(-choice, axis=1, kind="stable")[:, : m.num_experts_per_tok]
        wts = np.take_along_axis(scores, ids, axis=1)
        if m.norm_topk_prob:
            wts = wts / (wts.sum(axis=1, keepdims=True) + 1e-20)
        return ids, wts * m.routed_scaling_factor

    def site(self, layer: int, x_TH: np.ndarray) -> np.ndarray:
        x = _f64(x_TH)
        w, lim = self.layers[layer], self.model.swiglu_limit
        if isinstance(w, DenseWeights):
            return mlp64(*self._dense(w), lim, x)
        assert isinstance(w, MoeWeights)
        ids, wts = self.route(layer, x)
        out = mlp64(*self._dense(w.shared), lim, x) if w.shared is not None else np.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(ids.shape[1]):
                out[t] += wts[t, k] * mlp64(*self._expert(layer, int(ids[t, k])), lim, x[t:t + 1])[0]
        return out

    def step(self, x_TH: np.ndarray) -> np.ndarray:
        """The chained stack ``h = h + site(h)`` in float64."""
        h = _f64(x_TH)
        for i in range(self.model.num_hidden_layers):
            h = h + self.site(i, h)
        return h


def rel_l2(y: np.ndarray, ref: np.ndarray) -> float:
    """``|y - ref| / |ref|``; NaN when either holds a NaN or Inf (never hidden by the zero guard)."""
    y, ref = _f64(y), _f64(ref)
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.linalg.norm(y - ref) / np.maximum(np.linalg.norm(ref), 1e-300))

"""A single-process float64 evaluation of the MLP sites, read straight from the checkpoint.

It shares no arithmetic with the backends: whole (unsharded) weights, NVFP4 decoded to float64
(``e2m1 * e4m3 * scale_2``, exact), the router in float64, no bf16 rounding anywhere after the
bf16 input but where the model defines it: a ``moe_router_dtype: bfloat16`` model routes on bf16 logits and
scores, so its choices are made so here too (its weights stay float64). A faithful bf16 pipeline lands about 3e-3 relative (L2) from it; 1e-2 is the bound
the run checks.

Memory is bounded by ``block_bytes``: each product ``x @ W.T`` runs over blocks of W's rows, each
block read from the checkpoint and made float64 on its own, and a routed expert is read only
when a row chose it, one projection at a time. With ``resident`` (the full check) every float64
matrix is kept once made, so each is read and decoded once; its memory is then the float64 size
of the layers evaluated (``float64_layer_bytes``).

Shape suffixes: T rows, H hidden, W a projection width, E routed experts, K top-k.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Callable

import ml_dtypes
import numpy as np

from glm_ep.checkpoint.reader import Checkpoint
from glm_ep.checkpoint.layers import dense_is_nvfp4, expert_prefix, read_nvfp4
from glm_ep.config.model import ModelConfig
from glm_ep.errors import CheckpointError
from glm_ep.checkpoint.nvfp4 import NIBBLE_TO_F32, NVFP4_GROUP, Nvfp4Weight, unpack_nibbles

BLOCK_BYTES = 16_000_000  # float64 bytes of one block of weight rows
#: the working set of one block, in blocks: the float64 block, its raw bytes as read (and copied),
#: the nibble unpack, the product being written
BLOCK_OVERHEAD = 3
NIBBLE_TO_F64 = NIBBLE_TO_F32.astype(np.float64)

#: rows of a weight -> those rows as a float64 ``[rows, in]`` block
RowReader = Callable[[slice], np.ndarray]


def _f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def nvfp4_f64(q: Nvfp4Weight) -> np.ndarray:
    """The float64 ``[N, K]`` weight ``e2m1 * weight_scale * weight_scale_2`` (exact)."""
    w_NK = NIBBLE_TO_F64[unpack_nibbles(q.packed)]
    n, k = w_NK.shape
    w_NK.reshape(n, k // NVFP4_GROUP, NVFP4_GROUP)[...] *= q.scale.astype(np.float64)[:, :, None]
    w_NK *= q.scale_2
    return w_NK


def float64_layer_bytes(model: ModelConfig, layer: int) -> int:
    """The float64 bytes of layer ``layer``'s weights, whole: what ``resident`` keeps of it."""
    h = model.hidden_size
    if model.mlp_layer_types[layer] == "dense":
        return 3 * model.intermediate_size * h * 8
    e = model.n_routed_experts
    return (e * h + e + 3 * model.shared_intermediate * h + e * 3 * model.moe_intermediate_size * h) * 8


def working_bytes(model: ModelConfig, rows: int, block_bytes: int = BLOCK_BYTES) -> int:
    """The float64 working set of one site call of ``rows`` rows: a block being made (with its
    temporaries; no larger than the largest matrix) and the activations (input, output, gate, up,
    act, router scores)."""
    width = max(model.intermediate_size, model.shared_intermediate, model.moe_intermediate_size)
    block = min(block_bytes, 8 * model.hidden_size * max(width, model.n_routed_experts))
    return BLOCK_OVERHEAD * block + rows * (3 * model.hidden_size + 3 * width + 3 * model.n_routed_experts) * 8


class Reference:
    """float64 sites of the checkpoint in ``model_dir`` (open until ``close()``; a context manager).
    ``check_finite`` as in ``Checkpoint``."""

    def __init__(self, model_dir: str | Path, check_finite: bool = True, resident: bool = False,
                 block_bytes: int = BLOCK_BYTES, loaded: dict[str, tuple[int, int, int]] | None = None):
        self.ckpt = Checkpoint(model_dir, check_finite=check_finite)
        self.model: ModelConfig = self.ckpt.config
        self.resident = resident
        self.block_bytes = int(block_bytes)
        self._kept: dict[str, np.ndarray] = {}
        self._loaded = loaded
        self.check_unchanged()

    def check_unchanged(self) -> None:
        """With ``loaded`` (the ``Checkpoint.stamps`` of the load being checked): CheckpointError where a file
        changed since, so a rewrite is never reported as a numeric failure of the run."""
        changed = self.ckpt.changed_since(self._loaded) if self._loaded is not None else []
        if changed:
            names = ", ".join(Path(p).name for p in changed[:4]) + (f" and {len(changed) - 4} more"
                                                                  if len(changed) > 4 else "")
            raise CheckpointError(f"{self.ckpt.dir}: the checkpoint changed since load ({names}: another file, "
                                  "size or modification time); expected the files the run loaded, unchanged until "
                                  "its check has read them (run again on a checkpoint no one writes to)")

    def close(self) -> None:
        self._kept.clear()
        self.ckpt.close()

    def __enter__(self) -> "Reference":
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ---- weights, a block of rows at a time ------------------------------------------------------
    def _bf16(self, name: str, n: int, k: int, dtypes: tuple[str, ...] = ("BF16",)) -> RowReader:
        return lambda rows: _f64(self.ckpt.read(name, (n, k), dtypes, rows=rows))

    def _nvfp4(self, prefix: str, n: int, k: int) -> RowReader:
        return lambda rows: nvfp4_f64(read_nvfp4(self.ckpt, prefix, n, k, rows))

    def _matmul_t(self, x_TK: np.ndarray, key: str, n: int, read: RowReader) -> np.ndarray:
        """``x @ W.T`` -> ``[T, n]`` for the ``[n, K]`` weight ``key``: kept whole when resident,
        else in blocks of at most ``block_bytes`` of float64."""
        if self.resident:
            if key not in self._kept:
                self._kept[key] = read(slice(0, n))
            return x_TK @ self._kept[key].T
        out_TN = np.empty((x_TK.shape[0], n))
        step = max(1, self.block_bytes // (8 * x_TK.shape[1]))
        for a in range(0, n, step):
            b = min(n, a + step)
            out_TN[:, a:b] = x_TK @ read(slice(a, b)).T
        return out_TN

    def _mlp(self, prefix: str, width: int, x_TH: np.ndarray, nvfp4: bool = False) -> np.ndarray:
        """The clamped SwiGLU MLP whose projections are ``{prefix}.{gate,up,down}_proj``."""
        h, lim = self.model.hidden_size, self.model.swiglu_limit

        def proj(name: str, n: int, k: int) -> tuple[str, int, RowReader]:
            q = f"{prefix}.{name}"
            return q, n, self._nvfp4(q, n, k) if nvfp4 else self._bf16(f"{q}.weight", n, k)

        g_TW = np.minimum(self._matmul_t(x_TH, *proj("gate_proj", width, h)), lim)
        u_TW = np.clip(self._matmul_t(x_TH, *proj("up_proj", width, h)), -lim, lim)
        with np.errstate(over="ignore"):  # exp(-g) -> inf for a very negative gate: silu -> -0
            act_TW = g_TW / (1.0 + np.exp(-g_TW)) * u_TW
        del g_TW, u_TW
        return self._matmul_t(act_TW, *proj("down_proj", h, width))

    # ---- the site ------------------------------------------------------------------------------
    def route(self, layer: int, x_TH: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Chosen expert ids ``[T, K]`` and their weights (unbiased scores, renormalized, scaled)."""
        m, p = self.model, self.ckpt.layer_prefix(layer)
        e, h = m.n_routed_experts, m.hidden_size
        router = f"{p}.mlp.gate.weight"
        logits_TE = self._matmul_t(_f64(x_TH), router, e, self._bf16(router, e, h, ("BF16", "F32")))
        if m.router_bf16:  # moe_router_dtype bfloat16: the model routes on bf16 logits and scores
            logits_TE = _f64(logits_TE.astype(ml_dtypes.bfloat16))
        with np.errstate(over="ignore"):
            scores_TE = 1.0 / (1.0 + np.exp(-logits_TE))
        bias = self.ckpt.read(f"{p}.mlp.gate.e_score_correction_bias", (e,), ("F32",))
        if m.router_bf16:  # ... and chooses by bf16 score + fp32 bias, summed in fp32 (as HF's module does)
            scores_TE = _f64(scores_TE.astype(ml_dtypes.bfloat16))
            choice_TE = scores_TE.astype(np.float32) + np.asarray(bias, np.float32)[None, :]
        else:
            choice_TE = scores_TE + _f64(bias)[None, :]
        ids_TK = np.argsort(-choice_TE, axis=1, kind="stable")[:, : m.num_experts_per_tok]
        w_TK = np.take_along_axis(scores_TE, ids_TK, axis=1)
        if m.norm_topk_prob:
            w_TK = w_TK / (w_TK.sum(axis=1, keepdims=True) + 1e-20)
        return ids_TK, w_TK * m.routed_scaling_factor

    def site(self, layer: int, x_TH: np.ndarray) -> np.ndarray:
        """Layer ``layer``'s MLP on ``x`` in float64: ``[T, H]``."""
        m, p = self.model, self.ckpt.layer_prefix(layer)
        x = _f64(x_TH)
        if m.mlp_layer_types[layer] == "dense":
            return self._mlp(f"{p}.mlp", m.intermediate_size, x, nvfp4=dense_is_nvfp4(self.ckpt, layer))
        ids_TK, w_TK = self.route(layer, x)
        out_TH = (self._mlp(f"{p}.mlp.shared_experts", m.shared_intermediate, x) if m.n_shared_experts
                  else np.zeros_like(x))
        for e in np.unique(ids_TK):  # each chosen expert once, on the rows that chose it
            rows, slots = np.nonzero(ids_TK == e)  # a row chooses an expert at most once
            y_TH = self._mlp(expert_prefix(self.ckpt, layer, int(e)), m.moe_intermediate_size, x[rows], nvfp4=True)
            out_TH[rows] += w_TK[rows, slots][:, None] * y_TH
        return out_TH


def rel_l2(y: np.ndarray, ref: np.ndarray) -> float:
    """``|y - ref| / |ref|``; NaN when either holds a NaN or Inf (never hidden by the zero guard)."""
    y, ref = _f64(y), _f64(ref)
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.linalg.norm(y - ref) / np.maximum(np.linalg.norm(ref), 1e-300))

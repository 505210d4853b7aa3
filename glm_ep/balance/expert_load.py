"""The expert load a workload records: per sparse layer and expert, how many slots chose it.

``ExpertLoadRecorder.attach`` wraps the sparse sites of a loaded stack: after each one it reads the ids the site
dispatched to the host (a sync per sparse site, so the stack's graphs are off while it records: a diagnostic
mode, not one to time), maps them back to global expert ids through the layer's placement, and counts them. The
router's choices are the same on every rank, so every rank records the same choices; each also counts the slots
it ran itself (the ids its dispatch held local), which ``gather`` collects from every rank.

``ExpertLoad`` is the record, saved as safetensors: ``logical_count`` ``[L, E]`` int64 (L: the model's sparse
layers, in order: ``layers``), ``rank_slots`` ``[L, world]`` int64 (the slots each rank ran), per sparse layer
``call_rows.{i}`` (the rows of each call, in order) and ``choices.{i}`` ``[rows, K]`` (each row's chosen
experts, the first ``CHOICES_MAX_ROWS`` rows of the layer), with a placement ``placement.{i}`` (the expert of
each physical slot); metadata: the format, the model geometry, top-k and the layout. ``read`` checks a file
against the model it is used with, by name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from glm_ep.config.model import ModelConfig
from glm_ep.errors import InputError

FORMAT = "glm_ep expert load 1"
CHOICES_MAX_ROWS = 1 << 16  # rows of chosen experts a layer keeps (44 MB at the GLM shape); counts go on past it
GEOMETRY = ("num_hidden_layers", "n_routed_experts", "num_experts_per_tok", "hidden_size", "moe_intermediate_size")


@dataclass
class ExpertLoad:
    """What a workload's routers chose, per sparse layer (``layers[l]`` is the model's layer index)."""

    model: dict[str, int]  # GEOMETRY's values of the model that recorded it
    layers: tuple[int, ...]
    layout: dict[str, Any]  # world, tp, ep, moe_tp, expert_placement (its digest; "" for the contiguous ranges)
    logical_count: np.ndarray  # int64 [L, E]
    rank_slots: np.ndarray  # int64 [L, world]
    call_rows: list[np.ndarray]  # per layer: int64 [calls]
    choices: list[np.ndarray]  # per layer: int32 [rows kept, K]
    placement: list[np.ndarray] | None = None  # per layer: int32 [P], the expert in each physical slot

    @property
    def num_experts(self) -> int:
        return self.model["n_routed_experts"]

    @property
    def top_k(self) -> int:
        return self.model["num_experts_per_tok"]

    @property
    def rows_seen(self) -> list[int]:
        return [int(c.sum()) for c in self.call_rows]

    def check_model(self, model: ModelConfig, source: str) -> None:
        """InputError naming ``source`` and each value where this load was recorded on another model."""
        theirs = {k: getattr(model, k) for k in GEOMETRY}
        theirs_layers = tuple(model.sparse_layers)
        wrong = [f"{k} {self.model[k]} in the file, {v} in the model" for k, v in theirs.items() if self.model[k] != v]
        if self.layers != theirs_layers and self.model["num_hidden_layers"] == model.num_hidden_layers:
            wrong.append(f"sparse layers {list(self.layers)} in the file, {list(theirs_layers)} in the model")
        if wrong:
            raise InputError(f"{source}: an expert load of another model ({'; '.join(wrong)}); expected a load "
                             "recorded on this model (glm-ep run / forward --expert-load)")

    def save(self, path: str | Path) -> Path:
        from glm_ep.app.files import save_readable

        tensors = {"logical_count": self.logical_count, "rank_slots": self.rank_slots, "layers": self.layers}
        for i, rows, ids in zip(self.layers, self.call_rows, self.choices):
            tensors[f"call_rows.{i}"], tensors[f"choices.{i}"] = rows, ids.astype(np.int32)
        for i, phys in zip(self.layers, self.placement or ()):
            tensors[f"placement.{i}"] = phys.astype(np.int32)
        # C order, whatever the arrays' own: safetensors writes an array's memory as it lies
        tensors = {k: np.ascontiguousarray(v, dtype=np.int32 if k.startswith(("choices", "placement")) else np.int64)
                   for k, v in tensors.items()}
        meta = {"format": FORMAT, "model": json.dumps(self.model), "layout": json.dumps(self.layout),
                "rows_seen": json.dumps(self.rows_seen), "top_k": str(self.top_k)}
        p = Path(path)
        try:
            save_readable(tensors, p, metadata=meta)
        except OSError as e:
            raise InputError(f"{p}: cannot write the expert load ({e.strerror or e})") from None
        return p


def read(path: str | Path, model: ModelConfig | None = None) -> ExpertLoad:
    """The expert load in ``path``; InputError naming the file and what is wrong (not a load file, a tensor
    missing or of the wrong shape, recorded on another model than ``model``)."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: expert load file not found; expected a file written by --expert-load")
    try:
        with safe_open(str(p), framework="numpy") as f:
            meta, tensors = f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(f"{p}: not a safetensors file ({e}); expected an expert load written by --expert-load") from None
    if meta.get("format") != FORMAT:
        raise InputError(f"{p}: format {meta.get('format')!r}, expected {FORMAT!r} (a file written by --expert-load)")
    try:
        geometry, layout = json.loads(meta["model"]), json.loads(meta["layout"])
        layers = tuple(int(i) for i in tensors["layers"])
        load = ExpertLoad(geometry, layers, layout, tensors["logical_count"], tensors["rank_slots"],
                          [tensors[f"call_rows.{i}"] for i in layers], [tensors[f"choices.{i}"] for i in layers],
                          [tensors[f"placement.{i}"] for i in layers] if f"placement.{layers[0]}" in tensors else None)
        _check_shapes(load)
    except (KeyError, ValueError, TypeError, IndexError) as e:
        raise InputError(f"{p}: an incomplete or inconsistent expert load ({type(e).__name__}: {e}); expected a "
                         "file written by --expert-load") from None
    if model is not None:
        load.check_model(model, str(p))
    return load


def _check_shapes(load: ExpertLoad) -> None:
    n, e, k = len(load.layers), load.num_experts, load.top_k
    if tuple(load.logical_count.shape) != (n, e) or load.rank_slots.shape[0] != n:
        raise ValueError(f"logical_count {load.logical_count.shape} / rank_slots {load.rank_slots.shape} for {n} "
                         f"layers of {e} experts")
    for i, rows, ids in zip(load.layers, load.call_rows, load.choices):
        if ids.ndim != 2 or ids.shape[1] != k or ids.shape[0] > rows.sum() or ids.size and not 0 <= ids.min() <= \
                ids.max() < e:
            raise ValueError(f"choices.{i} {ids.shape} for {int(rows.sum())} rows of top-{k} over {e} experts")


class _RecordingSite:
    """A sparse site that hands the ids it dispatched to the recorder after each call."""

    def __init__(self, site: Any, index: int, recorder: "ExpertLoadRecorder"):
        self.site, self.index, self.recorder = site, index, recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(self.site, name)

    def __call__(self, x_TH: Any, ws: Any, out_TH: Any) -> Any:
        out = self.site(x_TH, ws, out_TH)
        ids_TK = ws.view("ids", x_TH.shape[0], self.site.cfg.top_k)  # the site's own, until the next site routes
        experts = self.site.moe.experts
        self.recorder.record(self.index, self.site.be.to_host(ids_TK), experts.start, experts.count)
        return out


class ExpertLoadRecorder:
    """Counts one rank's sparse sites' choices (``attach``), then ``gather``s every rank's into an ExpertLoad."""

    def __init__(self, model: ModelConfig, layout: dict[str, Any], placement: Sequence[np.ndarray] | None = None):
        self.model, self.layout = model, dict(layout)
        self.layers = tuple(model.sparse_layers)
        self.placement = [np.asarray(p, dtype=np.int32) for p in placement] if placement is not None else None
        n, e = len(self.layers), model.n_routed_experts
        self.logical_count = np.zeros((n, e), dtype=np.int64)
        self.local_slots = np.zeros(n, dtype=np.int64)
        self.call_rows: list[list[int]] = [[] for _ in range(n)]
        self.choices: list[list[np.ndarray]] = [[] for _ in range(n)]
        self.kept = [0] * n

    def attach(self, stack: Any) -> None:
        """Wrap ``stack``'s sparse sites (the stack records no graphs from here on: the host reads each site's
        ids)."""
        for j, i in enumerate(self.layers):
            stack.sites[i] = _RecordingSite(stack.sites[i], j, self)
        self._levers, stack.levers = stack.levers, dataclasses.replace(stack.levers, graph_decode=False,
                                                                       graph_verify=False, graph_sites=False)

    def detach(self, stack: Any) -> None:
        """Undo ``attach``: ``stack``'s own sites and levers again (what was recorded stays)."""
        for i in self.layers:
            if isinstance(stack.sites[i], _RecordingSite):
                stack.sites[i] = stack.sites[i].site
        stack.levers = self._levers

    def record(self, j: int, phys_TK: np.ndarray, start: int, count: int) -> None:
        """One call of sparse layer ``layers[j]``: the physical slots it dispatched; ``[start, start + count)`` the
        ones this rank holds."""
        phys = np.asarray(phys_TK, dtype=np.int64)
        logical = self.placement[j][phys] if self.placement is not None else phys
        self.logical_count[j] += np.bincount(logical.reshape(-1), minlength=self.model.n_routed_experts)
        self.local_slots[j] += int(((phys >= start) & (phys < start + count)).sum())
        self.call_rows[j].append(phys.shape[0])
        keep = min(phys.shape[0], CHOICES_MAX_ROWS - self.kept[j])
        if keep > 0:
            self.choices[j].append(logical[:keep].astype(np.int32))
            self.kept[j] += keep

    def gather(self, ranks: Any) -> ExpertLoad:
        """The load on every rank (collective: every rank calls it at the same point)."""
        every = ranks.allgather("expert load", self.local_slots.tolist())
        k = self.model.num_experts_per_tok
        return ExpertLoad({g: getattr(self.model, g) for g in GEOMETRY}, self.layers, self.layout,
                          self.logical_count.copy(), np.array(every, dtype=np.int64).T.reshape(len(self.layers), -1),
                          [np.array(r, dtype=np.int64) for r in self.call_rows],
                          [np.concatenate(c) if c else np.zeros((0, k), np.int32) for c in self.choices],
                          self.placement)

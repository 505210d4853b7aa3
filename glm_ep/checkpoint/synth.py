"""Synthetic checkpoints in exactly the format of a real GLM-5.3-Flash NVFP4 checkpoint.

``write_synthetic`` writes ``config.json``, shards ``model-0000i-of-0000N.safetensors`` and
``model.safetensors.index.json`` from an HF-style config dict (``glm_ep.config.presets.preset``). The
tensors are seeded and deterministic: each group of tensors that belong together (a dense MLP, a
router, a shared expert, one routed expert) draws from its own generator keyed by
``(seed, layer, group)``, so the values do not depend on how the groups are cut into shards.
Shards are generated and written one at a time; the whole model is never in memory.

Values: bf16 / fp32 weights ~ N(0, 1) / sqrt(in_features); one gate/up output row in
``1 / HEAVY_ROW_ODDS`` is ``HEAVY_ROW_GAIN`` times larger, so on unit-variance inputs the
SwiGLU clamp (``swiglu_limit`` = 10) fires on the tails. Routed experts are quantized with
``glm_ep.checkpoint.nvfp4.quantize``. The routing bias is fp32 ``7 + 0.02 * N(0, 1)``: GLM biases sit close
together near 7. With a router skew ``S > 0`` each layer ranks its experts in a seeded order and lowers the bias
of the expert ranked ``j`` by ``SKEW_STEP * S * ln(1 + j)``, so its load falls off with ``j`` (Zipf-like: the
hottest expert takes several times its share at ``S = 1``); ``S = 0`` writes the same bits as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import ml_dtypes
import numpy as np

from glm_ep.checkpoint.reader import INDEX_FILE
from glm_ep.config.model import ModelConfig
from glm_ep.errors import InputError
from glm_ep.app.files import save_readable
from glm_ep.dist.progress import progress as progress_bar
from glm_ep.checkpoint.nvfp4 import quantize
from glm_ep.config.presets import preset

log = logging.getLogger(__name__)
CACHE_MANIFEST = "glm-ep-cache.json"  # the built-in checkpoint's files and their SHA-256, beside them
HEAVY_ROW_ODDS = 16
HEAVY_ROW_GAIN = 6.0
BIAS_CENTER = 7.0
BIAS_SPREAD = 0.02
SKEW_STEP = 0.02  # the bias step of the router skew (about a tenth of a unit-variance row's spread of scores)
SKEW_KEY = 1 << 20  # the skew's generator key, apart from every tensor group's (layer, group)
_ITEMSIZE = {"BF16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}


@dataclass(frozen=True)
class _Group:
    """Tensors generated together: their names, shapes and dtypes, and the function making them."""

    specs: tuple[tuple[str, tuple[int, ...], str], ...]
    make: Callable[[np.random.Generator], dict[str, np.ndarray]]
    key: tuple[int, int]  # (layer, group index within the layer): the generator's key

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * _ITEMSIZE[dtype] for _, shape, dtype in self.specs)


def _normal(rng: np.random.Generator, n: int, k: int, heavy_rows: bool) -> np.ndarray:
    """fp32 ``[n, k]`` ~ N(0, 1) / sqrt(k), with occasional heavy output rows when asked."""
    w_NK = rng.standard_normal((n, k), dtype=np.float32) * np.float32(1.0 / math.sqrt(k))
    if heavy_rows:
        heavy_N = rng.random(n) < 1.0 / HEAVY_ROW_ODDS
        w_NK[heavy_N] *= np.float32(HEAVY_ROW_GAIN)
    return w_NK


def _bf16_mlp_group(p: str, width: int, hidden: int, key: tuple[int, int]) -> _Group:
    names = [f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"]

    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        gate_IH = _normal(rng, width, hidden, heavy_rows=True)
        up_IH = _normal(rng, width, hidden, heavy_rows=True)
        down_HI = _normal(rng, hidden, width, heavy_rows=False)
        return {n: w.astype(ml_dtypes.bfloat16) for n, w in zip(names, (gate_IH, up_IH, down_HI))}

    shapes = [(width, hidden), (width, hidden), (hidden, width)]
    return _Group(tuple((n, s, "BF16") for n, s in zip(names, shapes)), make, key)


def _nvfp4_specs(p: str, n: int, k: int, input_scale: bool) -> list[tuple[str, tuple[int, ...], str]]:
    return [(f"{p}.weight", (n, k // 2), "U8"), (f"{p}.weight_scale", (n, k // 16), "F8_E4M3"),
            (f"{p}.weight_scale_2", (), "F32")] + ([(f"{p}.input_scale", (), "F32")] if input_scale else [])


def _expert_group(p: str, inter: int, hidden: int, key: tuple[int, int], input_scale: bool = True) -> _Group:
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}

    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for proj, (n, k) in shapes.items():
            q = quantize(_normal(rng, n, k, heavy_rows=proj != "down_proj"))
            out[f"{p}.{proj}.weight"] = q.packed
            out[f"{p}.{proj}.weight_scale"] = q.scale
            out[f"{p}.{proj}.weight_scale_2"] = np.array(q.scale_2, dtype=np.float32)
            if input_scale:
                out[f"{p}.{proj}.input_scale"] = np.array(1.0, dtype=np.float32)
        return out

    specs = [s for proj, (n, k) in shapes.items() for s in _nvfp4_specs(f"{p}.{proj}", n, k, input_scale)]
    return _Group(tuple(specs), make, key)


def skew_offsets(experts: int, skew: float, seed: int, layer: int) -> np.ndarray:
    """fp32 ``[E]``: what the router skew ``skew`` adds to layer ``layer``'s biases (zeros at 0): the expert ranked
    ``j`` in a seeded order gets ``-SKEW_STEP * skew * ln(1 + j)``."""
    if not skew:
        return np.zeros(experts, np.float32)
    order = np.random.default_rng((seed, layer, SKEW_KEY)).permutation(experts)
    offsets = np.empty(experts, np.float64)
    offsets[order] = -SKEW_STEP * skew * np.log1p(np.arange(experts))
    return offsets.astype(np.float32)



def _router_group(p: str, experts: int, hidden: int, router_dtype: str, key: tuple[int, int], skew: float = 0.0,
                  seed: int = 0) -> _Group:
    stored = {"bf16": ("BF16", ml_dtypes.bfloat16), "f32": ("F32", np.float32)}[router_dtype]

    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        router_EH = _normal(rng, experts, hidden, heavy_rows=False).astype(stored[1])
        bias_E = (BIAS_CENTER + BIAS_SPREAD * rng.standard_normal(experts)).astype(np.float32)
        bias_E = (bias_E + skew_offsets(experts, skew, seed, key[0])).astype(np.float32)
        return {f"{p}.weight": router_EH, f"{p}.e_score_correction_bias": bias_E}

    specs = ((f"{p}.weight", (experts, hidden), stored[0]), (f"{p}.e_score_correction_bias", (experts,), "F32"))
    return _Group(specs, make, key)


def synthetic_router(config: dict[str, Any], layer: int, seed: int = 0, router_dtype: str = "bf16",
                     router_skew: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """``(router [E, H], bias [E])`` of sparse layer ``layer`` as ``write_synthetic`` writes them with these
    arguments (the same bits), without writing or drawing anything else."""
    model = ModelConfig.from_dict(config, source="synthetic config")
    if model.mlp_layer_types[layer] != "sparse":
        raise ValueError(f"layer {layer} is {model.mlp_layer_types[layer]}, expected a sparse layer")
    g = _router_group("gate", model.n_routed_experts, model.hidden_size, router_dtype, (layer, 0), router_skew, seed)
    made = g.make(np.random.default_rng((seed, *g.key)))
    return made["gate.weight"], made["gate.e_score_correction_bias"]


def _plan(model: ModelConfig, prefix: str, router_dtype: str, dense: str, input_scale: bool, skew: float = 0.0,
          seed: int = 0) -> list[_Group]:
    """Every tensor group of the model, in layer order."""
    h, groups = model.hidden_size, []
    for i, kind in enumerate(model.mlp_layer_types):
        p = f"{prefix}.{i}.mlp"
        if kind == "dense":
            groups.append(_expert_group(p, model.intermediate_size, h, (i, 0), input_scale) if dense == "nvfp4"
                          else _bf16_mlp_group(p, model.intermediate_size, h, (i, 0)))
            continue
        groups.append(_router_group(f"{p}.gate", model.n_routed_experts, h, router_dtype, (i, 0), skew, seed))
        if model.n_shared_experts > 0:
            groups.append(_bf16_mlp_group(f"{p}.shared_experts", model.shared_intermediate, h, (i, 1)))
        groups += [_expert_group(f"{p}.experts.{e}", model.moe_intermediate_size, h, (i, 2 + e), input_scale)
                   for e in range(model.n_routed_experts)]
    return groups


def _shards(groups: list[_Group], shard_bytes: int) -> list[list[_Group]]:
    """Consecutive groups packed into shards of at most ``shard_bytes`` (a larger group stands alone)."""
    shards: list[list[_Group]] = [[]]
    size = 0
    for g in groups:
        if shards[-1] and size + g.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += g.nbytes
    return shards


def _config_json(config: dict[str, Any], composite: bool) -> dict[str, Any]:
    if not composite:
        return dict(config)
    text = {k: v for k, v in config.items() if k != "quantization_config"}
    out: dict[str, Any] = {"model_type": config.get("model_type", "glm5_next"), "text_config": text}
    if "quantization_config" in config:
        out["quantization_config"] = config["quantization_config"]
    return out


def write_synthetic(out_dir: str | Path, config: dict[str, Any], seed: int = 0, shard_bytes: int = 256 * 2**20,
                    router_dtype: str = "bf16", composite: bool = False, progress: bool = False,
                    dense: str = "bf16", weight_only: bool = False, router_skew: float = 0.0) -> Path:
    """Write a seeded checkpoint of the shape ``config`` (flat HF text config) into ``out_dir``.

    ``router_dtype`` is ``"bf16"`` or ``"f32"`` (how ``gate.weight`` is stored). ``composite``
    nests the text fields under ``text_config`` and uses the ``model.language_model.layers.{i}``
    prefix. ``dense`` is ``"bf16"`` or ``"nvfp4"`` (the dense FFNs quantized like the experts, as
    ModelOpt's ``nvfp4_experts_dense_mlp`` recipe exports them). ``weight_only`` writes a W4A16
    export (``quant_algo`` ``W4A16_NVFP4``, no ``input_scale`` tensors), as glm_ep runs it; else an
    NVFP4 (W4A4) export, whose static input scales the runtime does not use. ``router_skew`` >= 0 skews each
    router's load (the module's docstring). Returns ``out_dir``.
    """
    if router_dtype not in ("bf16", "f32"):
        raise ValueError(f"router_dtype = {router_dtype!r}, expected 'bf16' or 'f32'")
    if dense not in ("bf16", "nvfp4"):
        raise ValueError(f"dense = {dense!r}, expected 'bf16' or 'nvfp4'")
    if not (math.isfinite(router_skew) and router_skew >= 0):
        raise InputError(f"router skew {router_skew}, expected a finite number >= 0 (0: no skew)")
    if "text_config" in config:
        raise ValueError("config must be flat (text fields at the top level); pass composite=True to nest them")
    if weight_only and "quantization_config" in config:
        config = dict(config, quantization_config=dict(config["quantization_config"], quant_algo="W4A16_NVFP4"))
    written = _config_json(config, composite)
    model = ModelConfig.from_dict(written, source="synthetic config")
    out = _folder(out_dir, "the synthetic checkpoint's folder")
    prefix = "model.language_model.layers" if composite else "model.layers"
    shards = _shards(_plan(model, prefix, router_dtype, dense, not weight_only, router_skew, seed), shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    bar = progress_bar(sum(len(s) for s in shards), "synthetic checkpoint", unit="groups", enabled=progress, log=log)
    for n, shard in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, np.ndarray] = {}
        for g in shard:
            tensors.update(g.make(np.random.default_rng((seed, *g.key))))
            weight_map.update({spec[0]: name for spec in g.specs})
            total += g.nbytes
            bar.update()
        with _writing(out / name):
            save_readable(tensors, out / name, metadata={"format": "pt"})
        del tensors
    bar.close()
    with _writing(out / INDEX_FILE):
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                  "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    with _writing(out / "config.json"):
        (out / "config.json").write_text(json.dumps(written, indent=2))
    return out


def _folder(path: str | Path, what: str) -> Path:
    """``path`` as a folder that exists (made with its parents where missing); an InputError naming ``what``
    where it cannot be (a file is there, a parent is not writable, ...)."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{p}: cannot make {what} there ({e.strerror or e}); expected a folder that exists or "
                         "can be made") from None
    return p


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """An OSError while writing ``path`` as an InputError naming it (a full disk, a folder made read-only; the
    shards' writer, ``save_readable``, reports safetensors' I/O failures as OSError too)."""
    try:
        yield
    except OSError as e:
        raise InputError(f"{path}: cannot write it ({e.strerror or e})") from None


def _cache_damage(path: Path) -> str | None:
    """Why ``path`` is not the built-in checkpoint as ``ensure_default_checkpoint`` wrote it (its manifest lists
    every file with its SHA-256), or None where every file is as written."""
    try:
        files = json.loads((path / CACHE_MANIFEST).read_text())["sha256"]
        if not isinstance(files, dict) or not files:
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"has an unreadable manifest {CACHE_MANIFEST} ({type(e).__name__}: {str(e)[:200]})"
    differ = [name for name, digest in sorted(files.items()) if _sha256(path / str(name)) != digest]
    return f"differs from what was written ({', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''})" \
        if differ else None


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def ensure_default_checkpoint(cache_dir: str | Path) -> Path:
    """``cache_dir/tiny``: the ``tiny`` preset, seed 0, a weight-only (W4A16) export, written once (atomically)
    with a manifest of its files' digests, then reused while every file matches it; one that does not (a
    damaged cache) is written again, with a warning. Anything else at that path (a folder without the manifest,
    a file: not this cache's) is never replaced: an InputError names it.

    Safe to call from several processes at once: each writes a private temporary folder and renames it into
    place; a loser of the race removes its copy and uses the winner's.
    """
    cache = Path(cache_dir)
    target = cache / "tiny"
    if os.path.lexists(target) and not (target.is_dir() and os.path.lexists(target / CACHE_MANIFEST)):
        raise InputError(f"{target}: not a checkpoint this cache wrote (no {CACHE_MANIFEST} in a folder there), so it is "
                         f"left as it is; expected the built-in checkpoint's place: move it away (a cache of a glm_ep "
                         f"from before the manifest: delete it), or give another --cache-dir (or --model {target} to "
                         "run on it)")
    damage = _cache_damage(target) if os.path.lexists(target) else "missing"
    if damage is None:
        return target
    if damage != "missing":
        log.warning("%s: the cached tiny checkpoint %s; writing it again", target, damage)
    _folder(cache, "the checkpoint cache (--cache-dir)")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=cache))
    except OSError as e:
        raise InputError(f"{cache}: cannot write the checkpoint cache (--cache-dir) there ({e.strerror or e})") from None
    stale = cache / f".stale-{tmp.name}"
    try:
        write_synthetic(tmp, preset("tiny"), seed=0, weight_only=True)
        digests = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
        with _writing(tmp / CACHE_MANIFEST):
            (tmp / CACHE_MANIFEST).write_text(json.dumps({"sha256": digests}, indent=2))
        if os.path.lexists(target):
            try:
                os.rename(target, stale)  # aside first: a folder cannot be renamed over a full one
            except OSError:
                pass  # gone already (another process replaced it), or not ours to move: named below
        try:
            os.rename(tmp, target)
        except OSError as e:
            if _cache_damage(target) is not None:  # not another process's complete copy either
                raise InputError(f"{target}: the cached tiny checkpoint {damage} and cannot be replaced "
                                 f"({e.strerror or e}); expected a folder glm_ep may write: delete {target}, or give "
                                 "another --cache-dir") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        elif os.path.lexists(stale):  # a file or a link where the folder was expected: the link, not its target
            stale.unlink()
    return target

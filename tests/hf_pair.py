"""The pairs the ``glm_ep.hf`` tests run, and the checks the unit, MPI and CUDA tests share (one body per check,
whatever the backend and the device): a glm_ep checkpoint of the ``tiny`` preset (4 layers: 1 dense, 3 sparse)
and its HF transformers twin (``glm_ep.hf.pair``), loaded with HF's own MLPs and with glm_ep's.

Top-k routing is discontinuous: in the synthetic checkpoint, at each sparse layer about one row in ten has its 8th
and 9th experts within 5e-3 of each other, so a row's bf16 rounding can pick the other expert and move its MLP output,
and every later row it reaches through attention, by far more than rounding (HF's own bf16 model parts from its
fp32 one the same way). The logits and generation checks therefore run a ``clear`` pair whose correction bias
picks the experts (8 of 32 at +2, spread over the EP ranks; the routing weights are still the unbiased sigmoid
scores): its margins are >= 1, so the whole model is a continuous function of the MLPs' numerics. The sites'
contract is checked on the synthetic pair as it is, site by site on the hidden states the model feeds them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from glm_ep.checkpoint.synth import write_synthetic
from glm_ep.config.presets import preset

from ckpt_writer import read_safetensors, write_safetensors
from helpers import rel_l2

#: the contract's bound on one site against HF's fp32 modules (DESIGN.md)
SITE_BOUND = 1e-2
PROMPT_LENGTHS = [1, 7, 64]
NEW_TOKENS = 16


def route_by_bias(ckpt: Path) -> None:
    """Every sparse layer's correction bias: 9 for experts 1, 5, 9, ... (8 of 32, half on each of 2 EP ranks), 7 for
    the others, so the selection never depends on the scores (their range is 1 < the bias gap)."""
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    for key, shard in weight_map.items():
        if key.endswith("e_score_correction_bias"):
            tensors = read_safetensors(ckpt / shard)
            dtype, shape, _ = tensors[key]
            bias = np.full(shape, 7.0, np.float32)
            bias[1::4] = 9.0
            tensors[key] = (dtype, shape, bias.tobytes())
            write_safetensors(ckpt / shard, tensors)


def write_pair(folder: Path, clear: bool = False, layers: int | None = None) -> tuple[Path, Path]:
    """(glm_ep checkpoint, HF twin) in ``folder``: the tiny preset, seed 0 (``layers``: its first that many)."""
    from glm_ep.hf.pair import write_hf_model

    cfg = preset("tiny")
    if layers is not None:
        cfg.update(num_hidden_layers=layers, mlp_layer_types=cfg["mlp_layer_types"][:layers])
    glm = write_synthetic(folder / "glm", cfg, seed=0, shard_bytes=256 * 1024)
    if clear:
        route_by_bias(glm)
    return glm, write_hf_model(glm, folder / "hf", seed=0)


def prompt(length: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, 255, length).tolist()


@dataclass
class Models:
    """The HF twin four ways: HF's own MLPs in fp32 and bf16, glm_ep's (``mlp``) in fp32 and bf16."""

    hf32: Any
    hf16: Any
    glm32: Any
    glm16: Any


def load_models(hf_dir: Path, mlp: Any) -> Models:
    """On ``mlp``'s device (its CUDA device, or the CPU)."""
    from glm_ep.hf import attach
    from glm_ep.hf.generate import load_model

    def load(dtype: str) -> Any:
        return load_model(str(hf_dir), dtype, mlp.device)

    return Models(load("float32"), load("bfloat16"), attach(load("float32"), mlp), attach(load("bfloat16"), mlp))


def logits(model: Any, ids: list[int]) -> np.ndarray:
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        return model(torch.tensor([ids], device=device)).logits[0].float().cpu().numpy()


def logits_errors(models: Models, ids: list[int]) -> dict[str, float]:
    """Relative L2 of the logits at every position against HF's own fp32 model: glm_ep's fp32 and bf16 models,
    and HF's own bf16 model (how far bf16 rounding alone moves this model)."""
    hf32 = logits(models.hf32, ids)
    return {"glm32": rel_l2(logits(models.glm32, ids), hf32), "glm16": rel_l2(logits(models.glm16, ids), hf32),
            "hf16": rel_l2(logits(models.hf16, ids), hf32)}


def logits_failures(errors: dict[str, float], what: str) -> list[str]:
    """The logits against HF's fp32 model, each bound by what rounding explains. The contract bounds one site; four
    chained sites and the final norm amplify (an MLP about doubles an error in its input), so the model's own bf16
    rounding sets the scale: ``rounding`` = HF's bf16 model's distance, or the one-site bound where larger. An fp32
    model whose MLPs glm_ep serves (bf16 sites, the only rounding in it) stays within ``rounding``; the bf16 one
    within ``rounding`` plus that fp32 model's own distance (its bf16 attention's rounding and glm_ep's). Neither
    is 0: the rounding is there."""
    rounding = max(SITE_BOUND, errors["hf16"])
    bounds = {"glm32": rounding, "glm16": rounding + errors["glm32"]}
    return [f"{what}: logits of glm_ep's {name[3:]}-bit model {errors[name]:.3e} from HF's fp32 one, expected in "
            f"(0, {bound:.3e}] ({errors})" for name, bound in bounds.items() if not 0 < errors[name] <= bound]


def site_errors(hf_dir: Path, mlp: Any, ids: list[int]) -> list[float]:
    """Each site of the fp32 model glm_ep serves, on the hidden state the model fed it, against HF's fp32 module
    on the same (bf16-rounded: a site reads bf16) input: relative L2 per layer."""
    import torch

    from glm_ep.hf import attach
    from glm_ep.hf.generate import load_model

    ref = load_model(str(hf_dir), "float32", mlp.device)
    served = attach(load_model(str(hf_dir), "float32", mlp.device), mlp)
    seen: dict[int, tuple[Any, Any]] = {}

    def keep(i: int) -> Any:
        def hook(module: Any, args: tuple[Any, ...], out: Any) -> None:
            seen.setdefault(i, (args[0], out))  # the first call: the prompt's
        return hook

    for i, layer in enumerate(served.model.language_model.layers):
        layer.mlp.register_forward_hook(keep(i))
    logits(served, ids)
    errors = []
    with torch.no_grad():
        for i, layer in enumerate(ref.model.language_model.layers):
            x, y = seen[i]
            want = layer.mlp(x.to(torch.bfloat16).float())
            errors.append(rel_l2(y.cpu().numpy(), want.cpu().numpy()))
    return errors


def generation(models: Models, dtype: str, ids: list[int], new_tokens: int = NEW_TOKENS) -> Any:
    """glm_ep's greedy generation against HF's own MLPs' (``glm_ep.hf.compare.Comparison``), ``dtype`` models."""
    from glm_ep.hf.compare import compare
    from glm_ep.hf.greedy import RouterMargins, greedy

    ref_model, glm_model = (models.hf32, models.glm32) if dtype == "float32" else (models.hf16, models.glm16)
    margins = RouterMargins(ref_model)
    try:
        ref = greedy(ref_model, ids, new_tokens, keep_logits=True, margins=margins)
    finally:
        margins.remove()
    got = greedy(glm_model, ids, new_tokens, keep_logits=True)
    return compare(ref.tokens, ref.logits, got.tokens, got.logits, ref.margins)

"""An HF transformers ``glm5_next`` model whose MLPs are a glm_ep checkpoint's, so that HF's own modules and glm_ep
compute the same function: the pair ``glm-ep synth --hf-model`` writes and ``glm-ep generate --compare`` runs.

``write_hf_model`` reads every MLP site of the checkpoint whole (one rank's view of world 1) and writes a
``Glm5NextForConditionalGeneration`` (the class transformers ships with an lm head for ``glm5_next``): random
attention, hyper-connections, embeddings, norms and lm head (HF's own initialisation, seeded), a one-block vision
tower that text never reaches, and MLPs holding exactly the checkpoint's weights, stored float32: bf16 tensors as
they are, NVFP4 experts (and dense FFNs stored NVFP4) dequantized (``e2m1 * e4m3 * scale_2``, one fp32 rounding,
``glm_ep.checkpoint.nvfp4.dequantize``), the router fp32 and its correction bias fp32. HF's experts hold
``gate_up_proj[e] = [gate; up]`` ``[2M, H]`` and ``down_proj[e]`` ``[H, M]``; ``save_pretrained`` writes them back
as per-expert tensors, the checkpoint's own names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from glm_ep.checkpoint.layers import load_layer
from glm_ep.checkpoint.nvfp4 import dequantize
from glm_ep.checkpoint.reader import Checkpoint
from glm_ep.checkpoint.weights import DenseWeights, ExpertWeights, MoeWeights
from glm_ep.config.model import ModelConfig, RankLayout, SiteConfig
from glm_ep.errors import ConfigError, InputError
from glm_ep.hf import deps
from glm_ep.hf.attached import MLP_FIELDS, text_model

VOCAB_SIZE = 256
#: the twin's attention, small and the same whatever the MLPs' shape: the MLPs are what the pair is for
ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
             "qk_nope_head_dim": 32, "v_head_dim": 32, "index_n_heads": 2, "index_head_dim": 16,
             "linear_num_heads": 4, "linear_head_dim": 32}
VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "projection_intermediate_size": 64}
Triple = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class MlpArrays:
    """One MLP site's weights as float arrays ``[out, in]``: ``mlp`` the dense FFN, or a sparse site's shared
    expert (None without one), as (gate, up, down); a sparse site's ``router`` ``[E, H]``, correction ``bias``
    ``[E]`` and ``experts[e]`` = (gate ``[M, H]``, up ``[M, H]``, down ``[H, M]``)."""

    mlp: Triple | None
    router: np.ndarray | None = None
    bias: np.ndarray | None = None
    experts: tuple[Triple, ...] = ()


def copy_into(module: Any, w: MlpArrays) -> None:
    """``w`` into HF's ``Glm5NextTextMLP`` or ``Glm5NextTextMoE`` ``module``, cast to the module's dtypes."""
    torch, hf = deps.torch(), deps.glm5_next()

    def t(a: np.ndarray) -> Any:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))

    mlp = module
    with torch.no_grad():
        if isinstance(module, hf.Glm5NextTextMoE):
            module.gate.weight.copy_(t(w.router))
            module.gate.e_score_correction_bias.copy_(t(w.bias))
            module.experts.gate_up_proj.copy_(torch.stack([t(np.concatenate([g, u])) for g, u, _ in w.experts]))
            module.experts.down_proj.copy_(torch.stack([t(d) for _, _, d in w.experts]))
            mlp = module.shared_experts
        if w.mlp is not None:
            for linear, a in zip((mlp.gate_proj, mlp.up_proj, mlp.down_proj), w.mlp):
                linear.weight.copy_(t(a))


def read_mlp(ckpt: Checkpoint, layer: int) -> MlpArrays:
    """Layer ``layer``'s MLP from ``ckpt``, whole and float32 (NVFP4 dequantized)."""
    model = ckpt.config
    w = load_layer(ckpt, SiteConfig.for_rank(model, RankLayout(1, 0, 1, 1)), layer)

    def f32(m: DenseWeights | ExpertWeights) -> Triple:
        if isinstance(m, ExpertWeights):
            return dequantize(m.gate), dequantize(m.up), dequantize(m.down)
        return m.gate.astype(np.float32), m.up.astype(np.float32), m.down.astype(np.float32)

    if not isinstance(w, MoeWeights):
        return MlpArrays(f32(w))
    return MlpArrays(f32(w.shared) if w.shared is not None else None, w.router.astype(np.float32), w.bias,
                     tuple(f32(e) for e in w.experts))


def text_fields(model: ModelConfig, vocab_size: int = VOCAB_SIZE) -> dict[str, Any]:
    """The HF ``Glm5NextTextConfig`` fields of a twin of ``model``: its MLP fields, ``ATTENTION``, the vocabulary."""
    fields = {name: getattr(model, name) for name in MLP_FIELDS}
    fields["mlp_layer_types"] = list(model.mlp_layer_types)
    return {**fields, **ATTENTION, "topk_group": 1, "vocab_size": vocab_size, "pad_token_id": vocab_size - 1}


def check_hf_folder(out_dir: str | Path, ckpt_dir: str | Path, force: bool = False) -> Path:
    """``out_dir`` as a folder the twin of the checkpoint in ``ckpt_dir`` may be written to: not a file, not the
    checkpoint's own folder (both hold a config.json), and without a model already there unless ``force``."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"--hf-model {out}: is a file; expected a folder for the transformers model")
    if out.resolve() == Path(ckpt_dir).resolve():
        raise InputError(f"--hf-model {out}: is the glm_ep checkpoint's own folder; expected another folder (each "
                         "holds its own config.json)")
    held = [n for n in ("config.json", "model.safetensors", "model.safetensors.index.json") if (out / n).exists()]
    if held and not force:
        raise InputError(f"--hf-model {out}: already holds a model ({', '.join(held)}); expected an empty or new "
                         "folder (--force writes over its files)")
    return out


def write_hf_model(ckpt_dir: str | Path, out_dir: str | Path, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> Path:
    """Write the HF twin of the glm_ep checkpoint ``ckpt_dir`` into ``out_dir`` (``save_pretrained``: config.json,
    generation_config.json, model.safetensors); its non-MLP weights are HF's initialisation under ``seed``."""
    torch, hf = deps.torch(), deps.glm5_next()
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig

    with Checkpoint(ckpt_dir) as ckpt:
        model_cfg = ckpt.config
        if model_cfg.router_bf16:
            raise ConfigError(f"{ckpt_dir}: moe_router_dtype = 'bfloat16' routes on bf16 logits, which HF's "
                              "Glm5NextTextTopkRouter does not (it routes in fp32); expected a checkpoint whose router "
                              "runs in float32 for an HF twin")
        config = Glm5NextConfig(text_config=text_fields(model_cfg, vocab_size),
                                vision_config={**VISION, "out_hidden_size": model_cfg.hidden_size})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = hf.Glm5NextForConditionalGeneration(config).float().eval()
        for i, layer in enumerate(text_model(model).layers):
            copy_into(layer.mlp, read_mlp(ckpt, i))
    out = check_hf_folder(out_dir, ckpt_dir, force=True)
    try:
        model.save_pretrained(out)
    except OSError as e:
        raise InputError(f"{out}: cannot write the HF model there ({e.strerror or e})") from None
    return out

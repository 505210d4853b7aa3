"""Built-in model shapes, as the ``config.json`` a checkpoint of that shape carries."""

from __future__ import annotations

from typing import Any

_QUANT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}

PRESETS: dict[str, dict[str, Any]] = {
    # The real GLM-5.3-Flash MLP geometry: 3 dense layers, 42 routed-MoE layers.
    "glm-5.3-flash": {
        "model_type": "glm5_next",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 45,
        "n_shared_experts": 1,
        "n_routed_experts": 288,
        "num_experts_per_tok": 8,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "swiglu_limit": 10.0,
        "first_k_dense_replace": 3,
        "quantization_config": _QUANT,
    },
    # Small enough for CI, same structure: divisible by tp = ep = 2, top-8 over 32 experts.
    "tiny": {
        "model_type": "glm5_next",
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 32,
        "num_experts_per_tok": 8,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "swiglu_limit": 10.0,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "quantization_config": _QUANT,
    },
}


def preset(name: str) -> dict[str, Any]:
    from glm_ep.errors import ConfigError

    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    import copy

    return copy.deepcopy(PRESETS[name])

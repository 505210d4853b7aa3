"""Model config parsing (flat / composite, layer schedule, router dtype, quantization, refusals) and
the per-rank division. Topology files: ``test_topology.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glm_ep.config.model import ModelConfig, RankLayout, SiteConfig
from glm_ep.errors import ConfigError

from helpers import tiny_dict

QUANT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
#: the form recent ModelOpt exports write into config.json (no top-level group_size)
MODELOPT_EXPORT = {"config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16},
                                                 "targets": ["Linear"]}},
                   "ignore": ["lm_head"], "quant_algo": "NVFP4", "producer": {"name": "modelopt"},
                   "quant_method": "modelopt"}


def _parse(d: dict) -> ModelConfig:
    return ModelConfig.from_dict(d, source="cfg.json")


def _composite(flat: dict) -> dict:
    text = {k: v for k, v in flat.items() if k != "quantization_config"}
    return {"model_type": "glm5_next", "text_config": text, "quantization_config": flat["quantization_config"]}


def test_flat_and_composite_configs_parse_the_same() -> None:
    flat = tiny_dict(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4)
    a, b = _parse(flat), _parse(_composite(flat))
    assert a == b
    assert (a.hidden_size, a.n_routed_experts, a.num_experts_per_tok, a.shared_intermediate) == (64, 16, 4, 64)
    assert a.mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    assert a.sparse_layers == (1, 2, 3) and a.dense_layers == (0,)
    # the quantization_config may also sit inside text_config
    nested = _composite(flat)
    nested["text_config"]["quantization_config"] = nested.pop("quantization_config")
    assert _parse(nested) == a


def test_from_file_reads_json_and_names_the_path(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(_composite(tiny_dict())))
    assert ModelConfig.from_file(p).hidden_size == 128
    p.write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json.*not valid JSON"):
        ModelConfig.from_file(p)
    with pytest.raises(ConfigError, match="nowhere.*not found"):
        ModelConfig.from_file(tmp_path / "nowhere" / "config.json")


def test_first_k_dense_replace_and_mlp_layer_types() -> None:
    old = tiny_dict(first_k_dense_replace=2)
    del old["mlp_layer_types"]
    assert _parse(old).mlp_layer_types == ("dense", "dense", "sparse", "sparse")
    # a dense layer may sit after a sparse one (both keys that disagree: test_robust_config)
    both = tiny_dict(mlp_layer_types=["sparse", "dense", "sparse", "dense"])
    assert _parse(both).mlp_layer_types == ("sparse", "dense", "sparse", "dense")
    neither = tiny_dict()
    del neither["mlp_layer_types"]
    with pytest.raises(ConfigError, match="mlp_layer_types.*first_k_dense_replace"):
        _parse(neither)
    with pytest.raises(ConfigError, match=r"mlp_layer_types = \['dense', 'sparse'\].*4 entries"):
        _parse(tiny_dict(mlp_layer_types=["dense", "sparse"]))
    with pytest.raises(ConfigError, match="'moe'"):
        _parse(tiny_dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]))
    old["first_k_dense_replace"] = 5
    with pytest.raises(ConfigError, match="first_k_dense_replace = 5"):
        _parse(old)


def test_moe_router_dtype() -> None:
    assert _parse(tiny_dict()).router_bf16 is False  # float32 is the default
    assert _parse(tiny_dict(moe_router_dtype="float32")).router_bf16 is False
    assert _parse(tiny_dict(moe_router_dtype="bfloat16")).router_bf16 is True
    with pytest.raises(ConfigError, match="moe_router_dtype = 'float16'"):
        _parse(tiny_dict(moe_router_dtype="float16"))


def test_real_modelopt_export_form_is_accepted() -> None:
    assert _parse(tiny_dict(quantization_config=MODELOPT_EXPORT)).hidden_size == 128
    nested = {"producer": {"name": "modelopt"}, "quant_method": "modelopt",
              "quantization": {"quant_algo": "NVFP4", "group_size": 16}}
    assert _parse(tiny_dict(quantization_config=nested)).hidden_size == 128


#: a MIXED_PRECISION export's map: NVFP4 MLP modules, an FP8 attention module and MXFP8 experts of the MTP
#: layer past the last (layer 4 of the tiny config's 4): neither of the last two is read
MIXED = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {
    "model.layers.1.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4", "group_size": 16},
    "model.layers.0.mlp.down_proj": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
    "model.layers.1.self_attn.q_proj": {"quant_algo": "FP8"},
    "model.layers.4.mlp.experts.0.gate_proj": {"quant_algo": "MXFP8", "group_size": 32}}}


@pytest.mark.parametrize("quant", [
    dict(QUANT, quant_algo="W4A16_NVFP4"),  # ModelOpt's weight-only tag: the same tensors
    dict(QUANT, quant_method="modelopt_fp4"),
    {"quant_library": "modelopt", "quant_algo": "NVFP4"},  # intermediate ModelOpt versions: no quant_method
    MIXED,
], ids=["w4a16-nvfp4", "modelopt-fp4", "quant-library", "mixed-precision"])
def test_other_spellings_of_modelopt_nvfp4_are_accepted(quant) -> None:
    assert _parse(tiny_dict(quantization_config=quant)).hidden_size == 128


def test_an_hf_quant_config_file_serves_when_config_json_has_none(tmp_path: Path) -> None:
    """Older ModelOpt exports record the quantization in hf_quant_config.json only."""
    d = tiny_dict()
    del d["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="no quantization_config"):
        ModelConfig.from_file(tmp_path / "config.json")
    hf_quant = {"producer": {"name": "modelopt", "version": "0.39.0"},
                "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    assert ModelConfig.from_file(tmp_path / "config.json").hidden_size == 128
    hf_quant["quantization"]["quant_algo"] = "FP8"
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    with pytest.raises(ConfigError, match="quant_algo='FP8'"):
        ModelConfig.from_file(tmp_path / "config.json")


@pytest.mark.parametrize("hf_quant,named", [
    ({"quantization": {"quant_algo": "FP8"}}, "quantization has quant_algo='FP8', group_size=16; expected ModelOpt"),
    ({"quantization": {"quant_algo": "NVFP4", "group_size": 32}}, "quantization has quant_algo='NVFP4', group_size=32"),
    ({"quant_algo": "FP8"}, "the file has quant_algo='FP8'"),  # not nested under 'quantization'
    (["NVFP4"], "a JSON list, expected an object whose 'quantization' describes ModelOpt NVFP4"),
], ids=["fp8", "group-32", "flat", "list"])
def test_a_refused_hf_quant_config_is_named_not_config_json(tmp_path: Path, hf_quant, named: str) -> None:
    """The quantization settings came from hf_quant_config.json: the refusal names that file, not config.json
    (which had no quantization_config to blame)."""
    d = tiny_dict()
    del d["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_file(tmp_path / "config.json")
    assert str(e.value).startswith(f"{tmp_path / 'hf_quant_config.json'}: {named}"), str(e.value)
    assert "config.json:" not in str(e.value).replace("hf_quant_config.json:", ""), str(e.value)


def test_a_refused_quantization_config_in_config_json_still_names_config_json() -> None:
    with pytest.raises(ConfigError) as e:
        _parse(tiny_dict(quantization_config=dict(QUANT, quant_algo="FP8")))
    assert str(e.value).startswith("cfg.json: quantization_config has quant_algo='FP8', group_size=16; expected")


@pytest.mark.parametrize("quant,named", [
    (dict(QUANT, quant_method="fp8"), "quant_method='fp8'"),
    (dict(QUANT, quant_algo="FP8"), "quant_algo='FP8'"),
    (dict(QUANT, group_size=32), "group_size=32"),
    (None, "no quantization_config"),
    (dict(QUANT, quant_algo="NVFP4_AWQ"), "activation smoothing"),
    (dict(QUANT, pre_quant_scale=True), "activation smoothing"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, "without a quantized_layers map"),
    ({**MIXED, "quantized_layers": {**MIXED["quantized_layers"], "model.layers.2.mlp.shared_experts.up_proj": {
        "quant_algo": "FP8"}}}, r"quantized_layers\['model.layers.2.mlp.shared_experts.up_proj'\]"),
])
def test_quantization_config_other_than_modelopt_nvfp4_16_is_refused(quant, named: str) -> None:
    d = tiny_dict(quantization_config=quant)
    if quant is None:
        del d["quantization_config"]
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        _parse(d)


def test_missing_swiglu_limit_is_refused_never_defaulted() -> None:
    for d in (tiny_dict(), _composite(tiny_dict())):
        text = d.get("text_config", d)
        del text["swiglu_limit"]
        with pytest.raises(ConfigError, match="missing required field 'swiglu_limit'"):
            _parse(d)
    with pytest.raises(ConfigError, match="swiglu_limit = 0.0"):
        _parse(tiny_dict(swiglu_limit=0))


@pytest.mark.parametrize("overrides,named", [
    (dict(n_group=2), "n_group = 2"),
    (dict(num_experts_per_tok=33), "num_experts_per_tok = 33"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok = 0"),
    (dict(hidden_size=120), "hidden_size = 120"),
    (dict(moe_intermediate_size=40), "moe_intermediate_size = 40"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob"),
    (dict(n_routed_experts=32.0), "n_routed_experts"),
    # finite as Python floats, not as the float32 they are applied as
    (dict(routed_scaling_factor=1e300), r"routed_scaling_factor = 1e\+300, expected a number finite in float32"),
    (dict(swiglu_limit=1e-300), r"swiglu_limit = 1e-300, expected a value > 0 that is finite and nonzero in float32"),
    (dict(routed_scaling_factor=0), r"routed_scaling_factor = 0.0, expected a number > 0"),
    (dict(swiglu_limit=1e39), r"swiglu_limit = 1e\+39"),
])
def test_bad_model_values_are_refused_by_name(overrides: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        _parse(tiny_dict(**overrides))


def test_an_activation_other_than_silu_is_refused_by_name() -> None:
    """HF applies config.hidden_act in the dense MLP and the shared expert; glm_ep computes the clamped SwiGLU only,
    so a config naming another was run as SiLU, silently."""
    with pytest.raises(ConfigError, match=r"hidden_act = 'gelu', expected 'silu' \(glm5_next's clamped SwiGLU"):
        _parse(tiny_dict(hidden_act="gelu"))
    assert _parse(tiny_dict(hidden_act="silu")) == _parse(tiny_dict())


@pytest.mark.parametrize("overrides,message", [
    (dict(norm_topk_prob="yes"), "field 'norm_topk_prob' = 'yes' has type str, expected a boolean (true or false)"),
    (dict(n_routed_experts=32.0), "field 'n_routed_experts' = 32.0 has type float, expected an integer"),
    (dict(hidden_size=True), "field 'hidden_size' = True has type bool, expected an integer"),
    (dict(swiglu_limit="7"), "field 'swiglu_limit' = '7' has type str, expected a number"),
], ids=["bool", "int", "bool-for-int", "number"])
def test_a_model_field_of_the_wrong_type_says_what_was_expected_in_words(overrides: dict, message: str) -> None:
    """Not a Python repr ("expected <class 'int'>", "(<class 'int'>, <class 'float'>)")."""
    with pytest.raises(ConfigError) as e:
        _parse(tiny_dict(**overrides))
    assert str(e.value).endswith(message) and "<class" not in str(e.value), str(e.value)


def test_site_config_divides_tp_and_ep_and_names_the_values() -> None:
    m = _parse(tiny_dict())
    c = SiteConfig.for_rank(m, RankLayout(world=2, rank=1, tp=2, ep=2))
    assert (c.local_dense_intermediate, c.local_shared_intermediate, c.local_experts) == (128, 32, 16)
    assert (c.num_experts, c.expert_start, c.tp_rank, c.ep_rank) == (32, 16, 1, 1)  # FULL expert count
    assert c.local_slot(15) is None and c.local_slot(16) == 0 and c.local_slot(31) == 15
    with pytest.raises(ConfigError, match=r"intermediate_size 250 does not divide over tp = 4; expected a tp that "
                       r"divides it, at world 4 one of \[1, 2\] \(--tp, or the topology's tp; with no --topology, tp "
                       r"is the number of ranks\)"):
        SiteConfig.for_rank(_parse(tiny_dict(intermediate_size=250)), RankLayout(4, 0, 4, 1))
    with pytest.raises(ConfigError, match=r"moe_intermediate_size = 64 does not divide over tp = 3"):
        SiteConfig.for_rank(_parse(tiny_dict(intermediate_size=384)), RankLayout(3, 0, 3, 1))
    with pytest.raises(ConfigError, match="n_routed_experts 32 does not divide over ep = 3"):
        SiteConfig.for_rank(m, RankLayout(3, 0, 1, 3))
    with pytest.raises(ConfigError, match="ep = 3 does not divide the world size 2"):
        RankLayout(world=2, rank=0, tp=2, ep=3)


@pytest.mark.parametrize("world,tp,ep", [(1, 1, 1), (2, 2, 2), (2, 1, 2), (2, 2, 1), (4, 2, 4)])
def test_each_piece_is_contributed_by_exactly_one_rank(world: int, tp: int, ep: int) -> None:
    m = _parse(tiny_dict())
    cfgs = [SiteConfig.for_rank(m, RankLayout(world, r, tp, ep)) for r in range(world)]
    for sparse in (False, True):
        # each TP shard index is contributed once when the site reduces; dense without tp: by everyone
        active = [c.tp_rank for c in cfgs if c.tp_active(sparse)]
        if cfgs[0].reduces(sparse):
            assert sorted(active) == list(range(tp)), (sparse, active)
        else:
            assert len(active) == world
    experts = sorted(e for c in cfgs if c.ep_active() for e in range(c.expert_start, c.expert_start + c.local_experts))
    assert experts == list(range(32)) if cfgs[0].reduces(True) else experts == sorted(list(range(32)) * world)


@pytest.mark.parametrize("raw,named", [
    (b'{"hidden_size": "\xff"}', "not UTF-8 text"),
    (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply"),
    (b"{not json", "not valid JSON"),
])
def test_config_file_that_is_not_json_text(tmp_path: Path, raw: bytes, named: str) -> None:
    p = tmp_path / "config.json"
    p.write_bytes(raw)
    with pytest.raises(ConfigError, match=f"config.json: {named}"):
        ModelConfig.from_file(p)


@pytest.mark.parametrize("quant", ["nvfp4", ["NVFP4"], 16])
def test_quantization_config_that_is_not_an_object(quant) -> None:
    with pytest.raises(ConfigError, match=f"quantization_config = {quant!r}".replace("[", r"\[").replace("]", r"\]")
                       + f" has type {type(quant).__name__}, expected an object"):
        _parse(tiny_dict(quantization_config=quant))

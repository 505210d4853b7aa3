"""Model config parsing (flat / composite, layer schedule, router dtype, quantization, refusals),
the per-rank division, and topology files."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from glm_ep.config.model import ModelConfig, RankLayout, SiteConfig
from glm_ep.errors import ConfigError
from glm_ep.config.topology import PathLevers, Topology

from helpers import REPO, tiny_dict

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
    with pytest.raises(ConfigError, match="intermediate_size 250 does not divide over tp = 4"):
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


CONFIG_FILES = sorted((REPO / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.stem for p in CONFIG_FILES])
def test_every_topology_file_loads(path: Path) -> None:
    t = Topology.load(path)
    assert t.name == path.stem
    assert t.world % t.tp == 0 and t.world % t.ep == 0
    assert t.backend in ("cpu", "cuda") and t.workspace_rows >= 1
    t.check_world(t.world)
    RankLayout(t.world, t.world - 1, t.tp, t.ep)
    # what make_backend checks on a device, checked here against the device the file is for: its levers within
    # the backend's kernels, and (CUDA) every ring block within one block's shared memory at the GLM shape
    from glm_ep.backend.cuda import CudaBackend
    from glm_ep.backend.cuda.ring import RingConfig
    from glm_ep.backend.numpy_backend import NumpyBackend
    from glm_ep.config.presets import preset

    glm = ModelConfig.from_dict(preset("glm-5.3-flash"), source="glm-5.3-flash")
    backend = CudaBackend if t.backend == "cuda" else NumpyBackend
    backend.capabilities.check(t.backend, t.levers, glm.num_experts_per_tok)
    if t.backend == "cuda":
        ring = RingConfig.from_levers(t.levers)
        limit = 101376 if path.stem.startswith("gb10") else 232448  # opt-in smem a block: GB10 (sm_121), H200
        ring.forms(glm.swiglu_limit)
        ring.check_fits(limit)


def test_topology_values_and_levers() -> None:
    cpu2 = Topology.load(REPO / "configs" / "cpu-2.toml")
    assert (cpu2.world, cpu2.tp, cpu2.ep, cpu2.backend, cpu2.comm) == (2, 2, 2, "cpu", "mpi")
    assert cpu2.levers == PathLevers()
    gb10 = Topology.load(REPO / "configs" / "gb10-2.toml")
    assert (gb10.workspace_rows, gb10.levers.prefill_gemm_min_rows, gb10.devices) == (256, 32, (0, 0))
    t = Topology.from_dict({"world": 2, "levers": {"prefill_gemm_min_rows": 9, "host_dispatch": True}})
    assert t.levers.prefill_gemm_min_rows == 9 and t.levers.host_dispatch and t.name == "topology"


def test_topology_unknown_keys_bad_toml_and_bad_levers(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown keys.*'wrold'"):
        Topology.from_dict({"wrold": 2})
    with pytest.raises(ConfigError, match="levers.row_batch_maxx"):
        Topology.from_dict({"levers": {"row_batch_maxx": 4}})
    bad = tmp_path / "bad.toml"
    bad.write_text("world = [")
    with pytest.raises(ConfigError, match="bad.toml.*not valid TOML"):
        Topology.load(bad)
    with pytest.raises(ConfigError, match="missing.toml: topology file not found"):
        Topology.load(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match=r"levers.row_batch_max = 0, expected >= 1"):
        Topology.from_dict({"levers": {"row_batch_max": 0}})
    with pytest.raises(ConfigError, match=r"levers.prefill_gemm_min_rows = -1, expected >= 1"):
        Topology.from_dict({"levers": {"prefill_gemm_min_rows": -1}})
    with pytest.raises(ConfigError, match="devices lists 1 entries for world = 2"):
        Topology.from_dict({"world": 2, "devices": [0]})
    with pytest.raises(ConfigError, match="backend = 'tpu'"):
        Topology.from_dict({"backend": "tpu"})
    with pytest.raises(ConfigError, match=r"devices = \[0, -1\]; expected CUDA device numbers >= 0"):
        Topology.from_dict({"world": 2, "devices": [0, -1]})
    with pytest.raises(ConfigError, match="comm = 'nccl' with backend = 'cpu'; NCCL sums the cuda backend's GPU "
                                          "buffers: expected comm = 'auto' or 'mpi'"):
        Topology.from_dict({"comm": "nccl"})
    nccl = Topology.from_dict({"comm": "nccl", "backend": "cuda"})
    assert nccl.comm == "nccl" and nccl.with_overrides(backend="cuda").comm == "nccl"
    assert nccl.with_overrides(backend="cpu").comm == "mpi"  # --backend cpu on a GPU topology (h200-2, gb10-2)
    assert Topology.load(REPO / "configs" / "gb10-2.toml").with_overrides(backend="cpu").backend == "cpu"


@pytest.mark.parametrize("raw,message", [
    ({"wrold": 2}, "unknown keys ['wrold'] (did you mean 'world'?)"),
    ({"levers": {"row_batch_maxx": 4}},
     "unknown keys ['levers.row_batch_maxx'] (did you mean 'levers.row_batch_max'?)"),
    ({"row_batch_max": 4}, "unknown keys ['row_batch_max'] (did you mean 'levers.row_batch_max'?)"),  # not in [levers]
    ({"tpp": 2, "levers": {"pddl": True}}, "unknown keys ['tpp', 'levers.pddl'] (did you mean 'tp' for 'tpp', "
                                           "'levers.pdl' for 'levers.pddl'?)"),
], ids=["typo", "lever-typo", "lever-at-the-top", "two"])
def test_an_unknown_topology_key_with_a_close_match_names_it_not_every_key(raw: dict, message: str) -> None:
    """Each unknown key listed every valid one (about 40): a close match is named instead."""
    with pytest.raises(ConfigError) as e:
        Topology.from_dict(raw)
    assert str(e.value) == f"topology: {message}"


def test_an_unknown_topology_key_without_a_close_match_lists_the_valid_keys() -> None:
    with pytest.raises(ConfigError) as e:
        Topology.from_dict({"wrold": 2, "zzz": 1})
    assert str(e.value).startswith("topology: unknown keys ['wrold', 'zzz'] (did you mean 'world' for 'wrold'?); "
                                   "expected ['allow_nonfinite_input', "), str(e.value)
    assert "[levers] ['graph_decode', " in str(e.value)


def test_topology_world_check_and_overrides() -> None:
    cpu2 = Topology.load(REPO / "configs" / "cpu-2.toml")
    with pytest.raises(ConfigError, match=r"is for 2 ranks \(world = 2\), but the MPI job has 1"):
        cpu2.check_world(1)
    t = cpu2.with_overrides(tp=1, ep=2, backend="cpu")
    assert (t.world, t.tp, t.ep) == (2, 1, 2) and cpu2.tp == 2  # frozen: a new object
    assert cpu2.with_overrides() is cpu2
    with pytest.raises(ConfigError, match="ep = 3 does not divide world = 2"):
        cpu2.with_overrides(ep=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cpu2.world = 4  # type: ignore[misc]


@pytest.mark.parametrize("raw,named", [
    ({"levers": {"host_dispatch": "false"}}, "levers.host_dispatch = 'false' has type str, expected a boolean"),
    ({"levers": {"row_batch_max": True}}, "levers.row_batch_max = True has type bool, expected an integer"),
    ({"shared_workspace": "no"}, "shared_workspace = 'no' has type str, expected a boolean"),
    ({"world": "2"}, "world = '2' has type str, expected an integer"),
    ({"tp": 1.0}, "tp = 1.0 has type float, expected an integer"),
    ({"backend": 1}, "backend = 1 has type int, expected a string"),
    ({"devices": "0,1"}, "devices = '0,1' has type str, expected a list of integers"),
    ({"check_weights": 0}, "check_weights = 0 has type int, expected a boolean"),
    ({"allow_nonfinite_input": "yes"}, "allow_nonfinite_input = 'yes' has type str, expected a boolean"),
    ({"collective_timeout_s": float("nan")}, "collective_timeout_s = nan, expected a finite number of seconds"),
    ({"collective_timeout_s": 0}, "collective_timeout_s = 0, expected a finite number of seconds > 0"),
    ({"levers": 1}, r"levers = 1, expected a \[levers\] table"),
])
def test_topology_values_are_type_checked_by_name(raw: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        Topology.from_dict(raw, source="t.toml")


def test_lists_are_taken_where_a_tuple_of_integers_is_expected() -> None:
    """Python callers write lists (as TOML does): a Topology and its levers take them as tuples, and stay frozen
    and hashable."""
    t = Topology(world=2, tp=2, ep=2, devices=[0, 1], levers=PathLevers(ring_union_slab=[4, 4],
                                                                        ring_union_depth=[2, 2]))
    assert t.devices == (0, 1) and t.levers.ring_union_slab == (4, 4) and t.levers.ring_union_depth == (2, 2)
    assert t == Topology(world=2, tp=2, ep=2, devices=(0, 1), levers=PathLevers(ring_union_slab=(4, 4),
                                                                                ring_union_depth=(2, 2)))
    assert hash(t) == hash(dataclasses.replace(t))
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.devices = [1, 0]  # type: ignore[misc]
    assert Topology.from_dict({"world": 2, "devices": [1, 0]}).devices == (1, 0)  # a TOML array, as before


@pytest.mark.parametrize("make,named", [
    (lambda: Topology(world=2, devices=[0, "1"]), "devices = [0, '1'] holds a non-integer, expected a list of "
                                                  "integers"),
    (lambda: Topology(world=2, devices=[0, 1.0]), "devices = [0, 1.0] holds a non-integer, expected a list"),
    (lambda: Topology(world=2, devices=[True, 0]), "devices = [True, 0] holds a non-integer, expected a list"),
    (lambda: Topology(devices="0"), "devices = '0' has type str, expected a list of integers"),
    (lambda: PathLevers(ring_union_slab=[4, None]), "levers.ring_union_slab = [4, None] holds a non-integer, "
                                                    "expected a list of integers"),
    (lambda: PathLevers(ring_union_slab=[4]), "levers.ring_union_slab = [4], expected two positive integers"),
    (lambda: Topology.from_dict({"levers": {"ring": [True]}}), "levers.ring = [True] has type list, expected a "
                                                               "boolean"),
], ids=["str", "float", "bool", "not-a-list", "lever-none", "lever-one", "list-for-a-boolean"])
def test_a_list_with_a_non_integer_is_refused_naming_it(make, named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        make()


def test_a_python_built_topology_is_not_called_single() -> None:
    """An unnamed Topology is no shipped file: its messages do not name one (world = 2 is not 'single')."""
    assert Topology().name == "unnamed" and Topology(world=2, tp=2, ep=2).name == "unnamed"
    with pytest.raises(ConfigError) as e:
        Topology(world=2, tp=2, ep=2, devices=[0])
    assert str(e.value).startswith("topology 'unnamed': devices lists 1 entries for world = 2"), str(e.value)
    with pytest.raises(ConfigError) as e:
        Topology(world=2, tp=2, ep=2).check_world(1)
    assert str(e.value).startswith("topology 'unnamed' is for 2 ranks (world = 2), but the MPI job has 1")
    assert Topology(name="mine", world=2).name == "mine"
    assert Topology.load(REPO / "configs" / "single.toml").name == "single"  # shipped files keep their names
    assert Topology.load(REPO / "configs" / "cpu-2.toml").name == "cpu-2"


def test_topology_defaults_and_new_keys(tmp_path: Path) -> None:
    t = Topology()
    assert (t.collective_timeout_s, t.check_weights, t.allow_nonfinite_input) == (300.0, True, False)
    p = tmp_path / "t.toml"
    p.write_text("world = 2\ncollective_timeout_s = 7.5\ncheck_weights = false\nallow_nonfinite_input = true\n")
    t = Topology.load(p)
    assert (t.collective_timeout_s, t.check_weights, t.allow_nonfinite_input) == (7.5, False, True)
    assert Topology.from_dict({"collective_timeout_s": 5}).collective_timeout_s == 5  # an integer is a number


def test_topology_file_not_utf8_or_nested_too_deeply(tmp_path: Path) -> None:
    p = tmp_path / "t.toml"
    p.write_bytes(b'name = "\xff"\n')
    with pytest.raises(ConfigError, match="t.toml: not UTF-8 text"):
        Topology.load(p)
    p.write_text("devices = " + "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="t.toml: values nested too deeply"):
        Topology.load(p)


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

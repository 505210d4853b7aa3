"""``glm_ep.hf.pair`` (the HF twin of a glm_ep checkpoint) held against the tests' independent writer and decoder
(``ckpt_writer``). Skipped without torch or a transformers with ``glm5_next``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ckpt_writer import TEXT_CONFIG, read_f64, write_checkpoint


def _hf():
    pytest.importorskip("torch")
    pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")


@pytest.mark.parametrize("dense_nvfp4", [False, True], ids=["dense-bf16", "dense-nvfp4"])
def test_the_twin_holds_exactly_the_checkpoints_decoded_mlps(tmp_path, dense_nvfp4) -> None:
    """Every MLP tensor of the twin (a composite ModelOpt checkpoint with an fp32 router, its dense FFN bf16 or
    NVFP4) is the independent decoder's float64 value rounded once to fp32: NVFP4 ``e2m1 * e4m3`` is exact, times
    ``scale_2`` one rounding, bf16 and the router exact."""
    _hf()
    from safetensors.numpy import load_file

    from glm_ep.hf.pair import write_hf_model

    layers, _ = write_checkpoint(tmp_path / "glm", seed=3, dense_nvfp4=dense_nvfp4)
    hf_dir = write_hf_model(tmp_path / "glm", tmp_path / "hf", seed=0)
    stored = load_file(str(hf_dir / "model.safetensors"))
    config = json.loads((hf_dir / "config.json").read_text())
    text = config["text_config"]
    assert config["model_type"] == "glm5_next"
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "n_shared_experts",
                "n_routed_experts", "num_experts_per_tok", "routed_scaling_factor", "norm_topk_prob", "swiglu_limit",
                "mlp_layer_types"):
        assert text[key] == TEXT_CONFIG[key], key
    compared = 0
    for i, layer in enumerate(read_f64(tmp_path / "glm")[0]):
        p = f"model.language_model.layers.{i}.mlp"
        want = {}
        if layer.kind == "dense":
            want.update(zip((f"{p}.{w}_proj.weight" for w in ("gate", "up", "down")), layer.mlp))
        else:
            want.update(zip((f"{p}.shared_experts.{w}_proj.weight" for w in ("gate", "up", "down")), layer.mlp))
            want[f"{p}.gate.weight"], want[f"{p}.gate.e_score_correction_bias"] = layer.router, layer.bias
            for e, expert in enumerate(layer.experts):
                want.update(zip((f"{p}.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")), expert))
        for key, value in want.items():
            assert stored[key].dtype == np.float32, key
            assert np.array_equal(stored[key], value.astype(np.float32)), key
            compared += 1
    assert compared == 3 + (3 + 2 + 3 * 16) * 2  # one dense and two sparse layers, every MLP tensor


def test_the_twin_refuses_a_bf16_router_and_a_folder_in_use(tmp_path) -> None:
    _hf()
    from glm_ep import ConfigError, InputError
    from glm_ep.hf.pair import check_hf_folder, write_hf_model

    write_checkpoint(tmp_path / "glm", seed=3)
    config = json.loads((tmp_path / "glm" / "config.json").read_text())
    config["text_config"]["moe_router_dtype"] = "bfloat16"
    (tmp_path / "glm" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"moe_router_dtype = 'bfloat16' routes on bf16 logits, which HF's"):
        write_hf_model(tmp_path / "glm", tmp_path / "hf")
    with pytest.raises(InputError, match=r"is the glm_ep checkpoint's own folder"):
        check_hf_folder(tmp_path / "glm", tmp_path / "glm")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(InputError, match=r"already holds a model \(config.json\); expected an empty or new folder"):
        check_hf_folder(tmp_path / "hf", tmp_path / "glm")
    assert check_hf_folder(tmp_path / "hf", tmp_path / "glm", force=True) == tmp_path / "hf"
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match=r"is a file; expected a folder"):
        check_hf_folder(tmp_path / "file", tmp_path / "glm", force=True)

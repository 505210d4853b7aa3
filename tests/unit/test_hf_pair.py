"""``glm_ep.hf.pair`` (the HF twin of a glm_ep checkpoint) held against the tests' independent writer and decoder
(``ckpt_writer``), and ``glm_ep.hf.compare`` (two greedy generations against each other) on made-up logits.
The pair's tests need torch and a transformers with ``glm5_next`` (skipped without); the comparison's do not.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from glm_ep.hf.compare import UNRELATED_REL_L2, bf16_spacing, compare

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


# ---- compare (no torch) ------------------------------------------------------------------------
def _logits(seed: int, steps: int, vocab: int = 32) -> list[np.ndarray]:
    return list(np.random.default_rng(seed).standard_normal((steps, vocab)).astype(np.float32))


def test_bf16_spacing() -> None:
    assert bf16_spacing(1.0) == 2.0 ** -7 and bf16_spacing(-1.5) == 2.0 ** -7 and bf16_spacing(0.25) == 2.0 ** -9
    assert bf16_spacing(0.0) == 0.0 and bf16_spacing(math.inf) == math.inf


def test_identical_generations() -> None:
    ref = _logits(0, 4)
    got = [v + np.float32(1e-3) for v in ref]
    tokens = [int(v.argmax()) for v in ref]
    result = compare(tokens, ref, tokens, got, [0.5, 0.2, math.inf, 0.3])
    assert result.first_diff is None and result.explained and result.steps == 4
    assert result.max_abs == pytest.approx(1e-3, rel=1e-3) and result.margin == 0.2
    assert result.rel_l2 == pytest.approx(1e-3 * math.sqrt(4 * 32) / np.linalg.norm(np.stack(ref)), rel=1e-3)
    assert result.lines()[0] == "compare: HF's own MLPs generate the same 4 tokens"
    assert "max |difference| 1.000e-03" in result.lines()[1] and "routing margin in HF's routers 2.000e-01" in \
        result.lines()[1]


def test_a_near_tie_is_explained_and_a_wide_gap_is_not() -> None:
    ref = _logits(1, 5)
    ref[2][3], ref[2][7] = 10.0, 9.99  # HF chose 3; glm_ep's logits moved 0.02 and chose 7
    got = [v.copy() for v in ref]
    got[2][3], got[2][7] = 9.99, 10.01
    tokens = [int(v.argmax()) for v in ref]
    mine = tokens[:2] + [7, 5, 6]  # after the difference the prefixes differ: nothing there is compared
    result = compare(tokens, ref, mine, got)
    assert (result.first_diff, result.steps, result.margin) == (2, 3, None)
    assert result.gap == pytest.approx(0.01, rel=1e-3) and result.moved == pytest.approx(0.02, rel=1e-3)
    assert result.bf16 == 2.0 ** -4 and result.explained
    assert "first difference at new token 2 of 5" in result.lines()[0] and "a near tie" in result.lines()[0]
    got[2][3], got[2][7] = 9.994, 9.996  # moved 6e-3 only: a 1e-2 gap is not what rounding did
    result = compare(tokens, ref, mine, got)
    assert not result.explained and "not explained by rounding" in result.lines()[0]


def test_logits_of_unrelated_models_are_named_not_explained() -> None:
    """A glm_ep checkpoint of another seed than the HF model's: the logits part at once, HF's gap there is below
    how far they moved (they moved everywhere), and the comparison called it a near tie that bf16 rounding decides.
    Past UNRELATED_REL_L2 it is not explained and says what to check."""
    ref, got = _logits(2, 4), _logits(3, 4)
    tokens, mine = [int(v.argmax()) for v in ref], [int(v.argmax()) for v in got]
    result = compare(tokens, ref, mine, got)
    assert result.rel_l2 > UNRELATED_REL_L2 and result.unrelated and not result.explained
    assert "as far apart as two unrelated models'" in result.lines()[0]
    assert "expected --hf-model to be --model's pair" in result.lines()[0]
    same = compare(tokens, ref, tokens, [v + np.float32(1e-3) for v in ref])
    assert not same.unrelated and same.explained

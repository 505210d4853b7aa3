"""``glm_ep.hf.attach`` on one rank (NumPy backend, torch CPU tensors): HF transformers' ``glm5_next`` model with
its MLPs served by glm_ep, held against the same model with HF's own modules (``hf_pair`` says how), and what
attach refuses. The two-rank runs are in tests/mpi/test_hf_attach_mpi.py, the command in tests/cli, the CUDA
backend in tests/cuda. Skipped where torch or a transformers with ``glm5_next`` is not installed.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

import glm_ep  # noqa: E402
from glm_ep import AgreedError, InputError  # noqa: E402
from glm_ep.hf import attach  # noqa: E402
from glm_ep.hf.attached import GlmEpMlp  # noqa: E402
from glm_ep.hf.generate import load_model  # noqa: E402
from glm_ep.hf.greedy import greedy  # noqa: E402

from hf_pair import (NEW_TOKENS, PROMPT_LENGTHS, SITE_BOUND, generation, load_models, logits_errors,  # noqa: E402
                     logits_failures, prompt, site_errors, write_pair)


def _self_comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("hf-pair"))


@pytest.fixture(scope="module")
def clear(tmp_path_factory):
    glm, hf = write_pair(tmp_path_factory.mktemp("hf-clear"), clear=True)
    return hf, glm_ep.load(glm, comm=_self_comm())


@pytest.fixture(scope="module")
def models(clear):
    hf, mlp = clear
    return load_models(hf, mlp)


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_sites_inside_the_model_hold_the_contract(pair, length) -> None:
    """On the synthetic pair, routing near-ties and all: each site glm_ep serves, fed the model's own hidden
    states (decode, row-group and grouped paths by length), within the contract of HF's fp32 module."""
    glm, hf = pair
    errors = site_errors(hf, glm_ep.load(glm, comm=_self_comm()), prompt(length))
    print(f"prompt {length}: per-site relative L2 vs HF fp32 modules {['%.2e' % e for e in errors]}")
    assert all(0 < e < SITE_BOUND for e in errors), errors


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_logits_against_hf_modules(models, length) -> None:
    errors = logits_errors(models, prompt(length))
    print(f"prompt {length}: logits relative L2 {errors}")
    assert not logits_failures(errors, f"prompt {length}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_generation_matches_hf_modules(models, dtype) -> None:
    """16 new tokens: the same as with HF's own MLPs, or the first difference a near tie (HF's gap between the
    two tokens below how far the logits moved)."""
    result = generation(models, dtype, [1, 2, 3])
    print("\n".join(result.lines()))
    assert result.tokens == NEW_TOKENS and result.explained, result.lines()


def test_the_attached_model_generates_with_hf_generate(models) -> None:
    """HF's own ``generate`` (greedy) runs the attached model to the tokens of the command's loop."""
    ids = [5, 17, 42, 99]
    want = greedy(models.glm16, ids, 8).tokens
    with torch.no_grad():
        got = models.glm16.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert got[0, len(ids):].tolist() == want


def test_attach_replaces_every_mlp_and_keeps_shape_dtype_and_device(clear, pair) -> None:
    hf, mlp = clear
    model = load_model(str(hf), "float32", None)
    assert attach(model, mlp) is model
    layers = model.model.language_model.layers
    assert [type(layer.mlp) for layer in layers] == [GlmEpMlp] * 4
    held = [name for name, _ in model.model.language_model.named_parameters() if ".mlp." in name]
    assert not held, f"HF's MLP weights are still held: {held[:4]}"
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 3, mlp.hidden_size), np.float32))
    for dtype in (torch.float32, torch.bfloat16):
        y = layers[2].mlp(x.to(dtype))
        assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
        want = mlp.site(2, x.reshape(-1, mlp.hidden_size).to(torch.bfloat16))  # the site, on the bf16 input
        assert torch.equal(y.reshape(-1, mlp.hidden_size).to(torch.bfloat16).view(torch.int16), want.view(torch.int16))
    assert attach(model, mlp) is model  # attached again: served again, by the same sites
    other = glm_ep.load(pair[0], comm=_self_comm())
    attach(model, other)
    assert all(layer.mlp.glm_mlp is other for layer in layers)


def _hf_model(hf_dir, **text_changes):
    """The twin's model built from its config with ``text_changes`` (random weights: only the shape matters)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    config = Glm5NextConfig.from_pretrained(hf_dir)
    for key, value in text_changes.items():
        setattr(config.text_config, key, value)
    return Glm5NextForConditionalGeneration(config).eval()


@pytest.mark.parametrize("changes,message", [
    ({"num_hidden_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"]},
     "num_hidden_layers 3 in the model, 4 in the checkpoint; mlp_layer_types ['dense', 'sparse', 'sparse'] in the "
     "model, ['dense', 'sparse', 'sparse', 'sparse'] in the checkpoint"),
    ({"hidden_size": 64}, "hidden_size 64 in the model, 128 in the checkpoint"),
    ({"mlp_layer_types": ["dense", "dense", "sparse", "sparse"]},
     "mlp_layer_types ['dense', 'dense', 'sparse', 'sparse'] in the model, ['dense', 'sparse', 'sparse', 'sparse']"),
    ({"swiglu_limit": 7.0, "num_experts_per_tok": 4},
     "num_experts_per_tok 4 in the model, 8 in the checkpoint; swiglu_limit 7.0 in the model, 10.0 in the checkpoint"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' in the model, 'silu' (the only activation glm_ep computes) in the "
                             "checkpoint"),
])
def test_a_model_of_another_shape_is_refused_by_name(clear, changes, message) -> None:
    hf, mlp = clear
    model = _hf_model(hf, **changes)
    with pytest.raises(AgreedError, match="the transformers model and the glm_ep checkpoint differ") as e:
        attach(model, mlp)
    assert message in str(e.value)
    assert not any(isinstance(m, GlmEpMlp) for m in model.modules()), "a refused model was changed"


def test_a_checkpoint_without_a_matching_layer_is_refused(tmp_path, clear) -> None:
    from glm_ep.checkpoint.synth import write_synthetic
    from glm_ep.config.presets import preset

    three = dict(preset("tiny"), num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"])
    glm3 = write_synthetic(tmp_path / "glm3", three, seed=0)
    hf, _ = clear
    with pytest.raises(AgreedError, match=r"num_hidden_layers 4 in the model, 3 in the checkpoint"):
        attach(load_model(str(hf), "float32", None), glm_ep.load(glm3, comm=_self_comm()))


def test_what_is_not_a_glm5_next_model_or_a_glm_mlp_is_refused(clear) -> None:
    hf, mlp = clear
    with pytest.raises(AgreedError, match=r"model is a builtins.str; expected a transformers glm5_next model"):
        attach("model", mlp)
    with pytest.raises(AgreedError, match=r"model is a Linear holding 0 Glm5NextTextModel modules"):
        attach(torch.nn.Linear(2, 2), mlp)
    model = load_model(str(hf), "float32", None)
    with pytest.raises(InputError, match=r"mlp is a builtins.str; expected the GlmMlp that glm_ep.load returns"):
        attach(model, "mlp")
    model.model.language_model.layers[1].mlp = torch.nn.Identity()
    with pytest.raises(AgreedError, match=r"decoder layer 1's mlp is a Identity; expected the sparse layer's "
                                          r"Glm5NextTextMoE"):
        attach(model, mlp)


def test_missing_torch_or_transformers_names_the_extra(monkeypatch) -> None:
    from glm_ep import ConfigError
    from glm_ep.hf import deps

    monkeypatch.setitem(sys.modules, "transformers.models.glm5_next", None)
    with pytest.raises(ConfigError, match=r"needs HF transformers with the glm5_next model .*pip install '\.\[hf\]'"):
        deps.glm5_next()
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ConfigError, match=r"glm_ep.hf needs torch, which does not import .*pip install '\.\[hf\]'"):
        deps.torch()


def test_load_model_and_the_prompt_check_refuse_by_name(clear, tmp_path) -> None:
    from glm_ep.checkpoint.synth import write_synthetic
    from glm_ep.config.presets import preset
    from glm_ep.hf.generate import _check_prompt

    hf, _ = clear
    with pytest.raises(InputError, match=r"--hf-model .*: cannot read config.json .*expected the folder of a "
                                         r"transformers glm5_next model"):
        load_model(str(tmp_path), "float32", None)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(InputError, match=r"model_type 'llama' in config.json; expected 'glm5_next'"):
        load_model(str(tmp_path), "float32", None)
    glm = write_synthetic(tmp_path / "glm", preset("tiny"), seed=0)  # a glm_ep checkpoint: its MLPs NVFP4, no rest
    with pytest.raises(InputError, match=r"no weights for \d+ tensor\(s\) of the model \(lm_head.weight, .*"
                                         r"expected every one stored"):
        load_model(str(glm), "float32", None)
    model = load_model(str(hf), "bfloat16", None)
    _check_prompt([0, 255], model)
    with pytest.raises(InputError, match=r"--prompt-ids: token 256 is outside the model's vocabulary \(ids 0..255\)"):
        _check_prompt([1, 256], model)

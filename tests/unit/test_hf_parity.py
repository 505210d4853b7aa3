"""``glm-ep forward`` against HF transformers' own ``glm5_next`` modules, evaluated in fp32.

The checkpoint comes from the tests' independent writer (``ckpt_writer``: real ModelOpt NVFP4
layout, composite config, fp32 router). Its decoded values are loaded into
``Glm5NextTextMoE`` / ``Glm5NextTextMLP`` (experts as ``gate_up_proj`` = [gate; up]) and every
site of every layout (world, tp, ep, moe_tp: each routed expert's width split over moe_tp ranks) is held to
1e-2 relative L2 of the HF output, at 1, 5 and 300 rows.
Skipped where torch or a transformers with ``glm5_next`` is not installed.
"""

from __future__ import annotations

import numpy as np
import pytest

from ckpt_writer import TEXT_CONFIG, write_checkpoint
from cli_jobs import glm_ep, load_outputs, save_hidden
from helpers import random_x, rel_l2

torch = pytest.importorskip("torch")
hf = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
hf_config = pytest.importorskip("transformers.models.glm5_next.configuration_glm5_next")

LAYOUTS = [(1, 1, 1, 1), (2, 2, 2, 1), (2, 1, 2, 1), (2, 2, 1, 1), (2, 2, 1, 2), (4, 2, 2, 2)]
IDS = [f"w{w}-tp{t}-ep{e}" + (f"-moetp{m}" if m > 1 else "") for w, t, e, m in LAYOUTS]
ROWS = [1, 5, 300]
BOUND = 1e-2


def _t(a: np.ndarray) -> "torch.Tensor":
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def hf_sites(layers, text: dict) -> list:
    """One HF module per layer, in fp32, holding the checkpoint's decoded weights (``glm_ep.hf.pair.copy_into``:
    experts as ``gate_up_proj`` = [gate; up])."""
    from glm_ep.hf.pair import MlpArrays, copy_into

    fields = {k: v for k, v in text.items() if k != "model_type"}
    heads = fields["num_attention_heads"]  # attention is not built here, but the config checks it
    cfg = hf_config.Glm5NextTextConfig(num_key_value_heads=heads, **fields)
    modules = []
    for layer in layers:
        mod = hf.Glm5NextTextMLP(cfg) if layer.kind == "dense" else hf.Glm5NextTextMoE(cfg)
        copy_into(mod, MlpArrays(layer.mlp, layer.router, layer.bias, tuple(layer.experts or ())))
        modules.append(mod.float().eval())
    return modules


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "glm"
    layers, _ = write_checkpoint(folder, seed=11)
    return folder, hf_sites(layers, TEXT_CONFIG)


@pytest.fixture(scope="module")
def model_dense_nvfp4(tmp_path_factory):
    """The same layout with the dense MLP stored NVFP4 (ModelOpt's nvfp4_experts_dense_mlp recipe, as in
    nvidia/GLM-5.3-Flash-NVFP4): HF's ``Glm5NextTextMLP`` holds its decoded weights."""
    folder = tmp_path_factory.mktemp("hf") / "glm-dense-nvfp4"
    layers, _ = write_checkpoint(folder, seed=12, dense_nvfp4=True)
    return folder, hf_sites(layers, TEXT_CONFIG)


@pytest.fixture(scope="module")
def hf_outputs(model, tmp_path_factory):
    return _hf_outputs(model, tmp_path_factory)


@pytest.fixture(scope="module")
def hf_outputs_dense_nvfp4(model_dense_nvfp4, tmp_path_factory):
    return _hf_outputs(model_dense_nvfp4, tmp_path_factory)


def _hf_outputs(model, tmp_path_factory) -> dict:
    """rows -> (input file, per-site HF outputs)."""
    _, modules = model
    out = {}
    for rows in ROWS:
        x = random_x(100 + rows, rows, TEXT_CONFIG["hidden_size"])
        path = save_hidden(tmp_path_factory.mktemp("in") / f"x{rows}.safetensors", x)
        with torch.no_grad():
            xt = _t(x.astype(np.float32))
            out[rows] = (path, [m(xt[None]).numpy()[0] if isinstance(m, hf.Glm5NextTextMoE) else m(xt).numpy()
                                for m in modules])
    return out


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("world,tp,ep,moe_tp", LAYOUTS, ids=IDS)
def test_forward_matches_hf_modules(model, hf_outputs, tmp_path, world, tp, ep, moe_tp, rows):
    _forward_matches(model, hf_outputs, tmp_path, world, tp, ep, rows, moe_tp)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("world,tp,ep,moe_tp", LAYOUTS[:2], ids=IDS[:2])
def test_forward_with_nvfp4_dense_mlp_matches_hf_modules(model_dense_nvfp4, hf_outputs_dense_nvfp4, tmp_path, world,
                                                        tp, ep, moe_tp, rows):
    """The dense MLP stored NVFP4 (its TP slices: gate/up rows, down columns on block boundaries), on the
    decode, row-group and grouped paths."""
    _forward_matches(model_dense_nvfp4, hf_outputs_dense_nvfp4, tmp_path, world, tp, ep, rows)


def _forward_matches(model, hf_outputs, tmp_path, world, tp, ep, rows, moe_tp=1) -> None:
    folder, _ = model
    x_path, ref = hf_outputs[rows]
    out_path = tmp_path / "out.safetensors"
    r = glm_ep(world, "forward", "--model", str(folder), "--input", str(x_path), "--output", str(out_path),
               "--tp", str(tp), "--ep", str(ep), "--moe-tp", str(moe_tp))
    assert r.returncode == 0, r.stderr[-3000:]
    got = load_outputs(out_path)
    errs = [rel_l2(got[f"layers.{i}"], ref[i]) for i in range(len(ref))]
    assert max(errs) < BOUND, f"per-site relative L2 vs HF fp32: {errs}"
    assert min(errs) > 0.0  # bf16 rounding is there: the comparison is not against itself

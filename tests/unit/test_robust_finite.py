"""Non-finite data never passes silently: NaN/Inf weights are refused at load and NaN/Inf input rows
before it, by one agreed message naming the file, the tensor and the value, on two ranks. The
topology levers ``check_weights`` and ``allow_nonfinite_input`` let them through."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from glm_ep.checkpoint.finite import nonfinite_mask
from glm_ep.errors import EXIT_FAIL

from cli_jobs import copy_checkpoint, fails, glm_ep, load_outputs, loaded_weights, save_hidden, set_bits, write_topology
from helpers import random_x

NAN_BF16, NAN_F32, INF_F32, NAN_E4M3 = 0x7FC0, 0x7FC00000, 0x7F800000, 0x7F
ONE_F32, ZERO_F32, MINUS_ONE_F32 = 0x3F800000, 0x00000000, 0xBF800000
HUGE_F32, HUGE_BF16 = 0x7F61B1E6, 0x7F61  # 3e38 and 2.99e38: finite, and near the top of both ranges


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path) -> Path:
    return copy_checkpoint(tiny_checkpoint, tmp_path / "tiny")


def _forward(ckpt: Path, tmp_path: Path, *extra: str, x_file: Path | None = None):
    x_file = x_file or save_hidden(tmp_path / "x.safetensors", random_x(0, 5, 128))
    return glm_ep(2, "forward", "--model", str(ckpt), "--input", str(x_file), "--output",
                  str(tmp_path / "out.safetensors"), *extra)


# (tensor, element, bits, needles): tp = ep = 2, so rank 1 holds experts 16..31 and the second
# half of the dense FFN's columns; both ranks read the router and its bias.
WEIGHTS = {
    "e4m3-block-scale-0x7F": ("model.layers.2.mlp.experts.20.gate_proj.weight_scale", (3, 1), NAN_E4M3,
                              ["NaN block scale", "bits 0x7F", "at [3, 1]", "(on rank 1)"]),
    "bf16-dense-weight-nan": ("model.layers.0.mlp.down_proj.weight", (5, 200), NAN_BF16,
                              ["NaN or Inf", "bits 0x7FC0", "at [5, 200]", "(on rank 1)"]),
    "shared-expert-nan": ("model.layers.1.mlp.shared_experts.up_proj.weight", (2, 9), NAN_BF16,
                          ["NaN or Inf", "at [2, 9]", "(on rank 0)"]),
    "weight-scale-2-nan": ("model.layers.1.mlp.experts.3.up_proj.weight_scale_2", (...,), NAN_F32,
                           ["NaN or Inf", "(on rank 0)"]),
    "weight-scale-2-zero": ("model.layers.1.mlp.experts.3.up_proj.weight_scale_2", (...,), ZERO_F32,
                            ["= 0.0, expected a finite value > 0", "(on rank 0)"]),
    "weight-scale-2-negative": ("model.layers.3.mlp.experts.30.down_proj.weight_scale_2", (...,), MINUS_ONE_F32,
                                ["= -1.0, expected a finite value > 0", "(on rank 1)"]),
    "router-nan-column": ("model.layers.3.mlp.gate.weight", (slice(None), 7), NAN_BF16,
                          ["NaN or Inf", "at [0, 7]", "32 of 4096 values"]),
    "bias-nan": ("model.layers.2.mlp.gate.e_score_correction_bias", (4,), NAN_F32, ["at [4]"]),
    "bias-inf": ("model.layers.2.mlp.gate.e_score_correction_bias", (4,), INF_F32, ["inf (bits 0x7F800000)"]),
    # finite, and yet nonsense: what the numbers would do is checked too
    "e4m3-block-scale-negative": ("model.layers.2.mlp.experts.20.gate_proj.weight_scale", (3, 1), 0xB8,
                                  ["negative block scale", "-1.0 (bits 0xB8) at [3, 1]",
                                   "expected E4M3 block scales >= 0", "(on rank 1)"]),
    "weight-scale-2-past-bf16": ("model.layers.1.mlp.experts.3.up_proj.weight_scale_2", (...,), HUGE_F32,
                                 ["= 3e+38: the projection holds weights up to 8.064e+41 (largest block scale 448 x 6",
                                  "they pass bf16's and fp32's range", "(on rank 0)"]),
}


@pytest.mark.parametrize("case", list(WEIGHTS))
def test_non_finite_weight_is_refused_at_load(ckpt, tmp_path, case: str) -> None:
    key, index, bits, needles = WEIGHTS[case]
    shard = set_bits(ckpt, key, index, bits)
    r = _forward(ckpt, tmp_path)
    fails(r, shard.name, f"'{key}'", *needles)
    if not any("(on rank" in n for n in needles):  # read on both ranks: both found it
        assert "(on rank" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "out.safetensors").exists()


def test_check_weights_lever_loads_them_anyway(ckpt, tmp_path) -> None:
    set_bits(ckpt, "model.layers.0.mlp.down_proj.weight", (5, 200), NAN_BF16)
    set_bits(ckpt, "model.layers.1.mlp.experts.3.up_proj.weight_scale_2", (...,), ZERO_F32)
    topo = write_topology(tmp_path / "lax.toml", world=2, tp=2, ep=2, check_weights=False)
    r = _forward(ckpt, tmp_path, "--topology", str(topo))
    assert r.returncode == 0, r.stderr[-3000:]
    y0 = load_outputs(tmp_path / "out.safetensors")["layers.0"]
    assert nonfinite_mask(y0)[:, 5].all()  # output column 5 of the dense site sums the NaN weight


def test_non_finite_input_rows_are_refused_before_the_load(ckpt, tmp_path) -> None:
    x = random_x(1, 6, 128)
    x[1, 17], x[4, 0] = np.nan, -np.inf
    r = _forward(ckpt, tmp_path, x_file=save_hidden(tmp_path / "bad.safetensors", x))
    fails(r, "bad.safetensors", "2 of 6 rows holding NaN or Inf (rows [1, 4])", "allow_nonfinite_input")
    assert not loaded_weights(r)


def test_allowed_non_finite_rows_keep_ids_in_range_and_other_rows_intact(ckpt, tmp_path) -> None:
    """With the lever, a NaN row routes to valid expert ids (no crash) and leaves the other rows'
    outputs bitwise what they are without it."""
    clean = random_x(2, 6, 128)
    dirty = clean.copy()
    dirty[2, :] = np.nan
    dirty[5, 3] = np.inf
    topo = write_topology(tmp_path / "allow.toml", world=2, tp=2, ep=2, allow_nonfinite_input=True)
    outs = {}
    for name, x in (("clean", clean), ("dirty", dirty)):
        inp, out = save_hidden(tmp_path / f"{name}.safetensors", x), tmp_path / f"{name}-out.safetensors"
        r = glm_ep(2, "forward", "--model", str(ckpt), "--input", str(inp), "--output", str(out),
                   "--topology", str(topo))
        assert r.returncode == 0, r.stderr[-3000:]
        outs[name] = load_outputs(out)
    for i in range(4):
        y, ref = outs["dirty"][f"layers.{i}"], outs["clean"][f"layers.{i}"]
        assert nonfinite_mask(y)[[2, 5]].any(axis=1).all(), i
        keep = [0, 1, 3, 4]
        assert np.array_equal(y[keep].view(np.uint16), ref[keep].view(np.uint16)), i
    assert "overflowed" not in r.stderr  # NaN in, NaN out: not an overflow


def test_outputs_that_overflow_from_finite_inputs_are_an_error_naming_the_layers(ckpt, tmp_path) -> None:
    """Finite bf16 inputs near bf16's largest overflow the sites: an agreed error naming each layer and its rows,
    and nothing written (where before the file was written with NaN/Inf rows and exit 0)."""
    x = random_x(3, 4, 128)
    x[2] *= 3e37  # |x| up to ~1e38: finite in bf16
    out = tmp_path / "out.safetensors"
    r = glm_ep(2, "forward", "--model", str(ckpt), "--input", str(save_hidden(tmp_path / "big.safetensors", x)),
               "--output", str(out))
    fails(r, "NaN or Inf outputs from finite inputs (largest |input|", "layer 1: 1 of 4 rows (rows [2])",
          "the site overflowed", "nothing was written")
    assert not out.exists()
    assert "RuntimeWarning" not in r.stderr, r.stderr[-3000:]  # the error alone, not NumPy's warnings before it


def test_finite_weights_whose_products_overflow_are_an_error_naming_the_layer(ckpt, tmp_path) -> None:
    """A row of the dense FFN's down projection at 3e38, finite and so passed by the load's scan: every output of
    layer 0 overflows in that column. The error names layer 0 alone, on every rank; the other layers are fine."""
    set_bits(ckpt, "model.layers.0.mlp.down_proj.weight", (0, ...), HUGE_BF16)
    out = tmp_path / "out.safetensors"
    r = _forward(ckpt, tmp_path)
    fails(r, "at layer 0: 5 of 5 rows (rows [0, 1, 2, 3, 4])", "the site overflowed")
    assert "layer 1:" not in r.stderr and not out.exists()
    lax = write_topology(tmp_path / "lax.toml", world=2, tp=2, ep=2, check_weights=False)
    r = _forward(ckpt, tmp_path, "--topology", str(lax))  # unchecked weights: written as computed, with a warning
    assert r.returncode == 0 and "(check_weights = false: the weights may hold them)" in r.stderr, r.stderr[-3000:]
    assert nonfinite_mask(load_outputs(out)["layers.0"][:, 0]).all()


def test_run_names_the_layer_that_overflowed_and_never_exits_0(ckpt, tmp_path) -> None:
    """The same finite row of 3e38 weights under ``run``: its check FAILs (exit 3) naming layer 0 as the first
    that overflowed; without the check (exit 0 before, with NaN outputs) it is an agreed error naming layer 0."""
    set_bits(ckpt, "model.layers.0.mlp.down_proj.weight", (0, ...), HUGE_BF16)
    args = ["run", "--model", str(ckpt), "--prefill", "5", "--decode", "1", "--verify", "2"]
    checked = glm_ep(2, *args)
    assert checked.returncode == EXIT_FAIL, checked.stdout[-2000:] + checked.stderr[-2000:]
    assert "(expected 0; the first from finite inputs at layer 0)" in checked.stdout, checked.stdout[-2000:]
    fails(glm_ep(2, *args, "--check", "none"), "the prefill call's outputs (5 rows) hold NaN or Inf from finite "
          "inputs, the first at layer 0: the site overflowed")

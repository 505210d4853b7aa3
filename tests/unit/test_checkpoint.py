"""Checkpoint reading: formats, F8 scales, and every error naming its cause (what one rank reads of a site:
test_checkpoint_layers.py)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from glm_ep.checkpoint.reader import Checkpoint
from glm_ep.checkpoint.layers import load_layer
from glm_ep.config.model import RankLayout, SiteConfig
from glm_ep.errors import CheckpointError, ConfigError
from glm_ep.config.presets import preset
from glm_ep.check.reference import Reference
from glm_ep.checkpoint.synth import write_synthetic
from glm_ep.checkpoint.weights import ExpertWeights, MoeWeights

from ckpt_writer import read_safetensors, write_checkpoint, write_safetensors
from cli_jobs import shard_of
from helpers import nvfp4_to_f64, random_x, rel_l2, site64

LAYOUTS = [(1, 0, 1, 1), (2, 0, 2, 2), (2, 1, 2, 2), (2, 1, 1, 2), (2, 1, 2, 1)]
SPARSE = "model.layers.1.mlp"

RawTensors = dict[str, list]  # key -> [dtype, shape, raw bytes]


def _rewrite(path: Path, edit: Callable[[RawTensors], None]) -> None:
    """Rewrite a shard by hand (the tests' own safetensors writer), its entries editable in place."""
    tensors = {k: list(v) for k, v in read_safetensors(path).items()}
    edit(tensors)
    write_safetensors(path, tensors)


@pytest.fixture
def ckpt_copy(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "tiny"))


def _site(ck: Checkpoint, layout: tuple[int, int, int, int]) -> SiteConfig:
    return SiteConfig.for_rank(ck.config, RankLayout(*layout))


def test_f8_scales_read_from_hand_written_bytes(tmp_path: Path) -> None:
    # E4M3 bit patterns and their values: 1, 2, -1, 448 (max), 2^-9 (smallest subnormal), 0.5
    bits_23 = np.array([[0x38, 0x40, 0xB8], [0x7E, 0x01, 0x30]], dtype=np.uint8)
    expect_23 = np.array([[1.0, 2.0, -1.0], [448.0, 2.0**-9, 0.5]], dtype=np.float32)
    packed = np.arange(12, dtype=np.uint8).reshape(2, 6)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(preset("tiny")))
    path = model / "model.safetensors"
    save_file({"model.layers.0.a.weight": packed, "model.layers.0.a.weight_scale": bits_23}, str(path))
    _rewrite(path, lambda t: t["model.layers.0.a.weight_scale"].__setitem__(0, "F8_E4M3"))
    with Checkpoint(model) as ck:
        scale = ck.read("model.layers.0.a.weight_scale", (2, 3), ("F8_E4M3",))
        assert scale.dtype == ml_dtypes.float8_e4m3fn
        assert np.array_equal(scale.astype(np.float32), expect_23)
        part = ck.read("model.layers.0.a.weight_scale", (2, 3), ("F8_E4M3",), rows=slice(1, 2), cols=slice(1, 3))
        assert np.array_equal(part.astype(np.float32), expect_23[1:2, 1:3])
        assert np.array_equal(ck.read("model.layers.0.a.weight", (2, 6), ("U8",), cols=slice(2, 4)), packed[:, 2:4])


def _load_all(model_dir: Path, layer: int) -> MoeWeights:
    with Checkpoint(model_dir) as ck:
        return load_layer(ck, _site(ck, LAYOUTS[0]), layer)


def test_composite_and_single_file_and_f32_router(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ref = _load_all(tiny_checkpoint, 2)
    comp = write_synthetic(tmp_path / "comp", preset("tiny"), composite=True)
    assert "text_config" in json.loads((comp / "config.json").read_text())
    with Checkpoint(comp) as ck:
        assert ck.layer_prefix(3) == "model.language_model.layers.3"
    single = write_synthetic(tmp_path / "single", preset("tiny"), shard_bytes=2**40)
    (single / "model-00001-of-00001.safetensors").rename(single / "model.safetensors")
    (single / "model.safetensors.index.json").unlink()
    for other in (_load_all(comp, 2), _load_all(single, 2)):
        assert np.array_equal(other.router.view(np.uint16), ref.router.view(np.uint16))
        assert np.array_equal(other.experts[5].down.packed, ref.experts[5].down.packed)
    f32 = _load_all(write_synthetic(tmp_path / "f32", preset("tiny"), router_dtype="f32"), 1)
    assert f32.router.dtype == np.float32 and f32.router.shape == ref.router.shape


def _self_comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


def _matches_float64(folder: Path, layers: list, p, x: np.ndarray) -> None:
    """``glm_ep.check.reference.Reference`` agrees with the tests' own float64 site to rounding, and the runtime loaded
    from ``folder`` (one rank, NumPy) is within the run's bound of it, at every site."""
    import glm_ep

    with Reference(folder) as ref:
        for i, layer in enumerate(layers):
            np.testing.assert_allclose(ref.site(i, x), site64(layer, p, x), rtol=1e-9, atol=1e-9,
                                       err_msg=f"Reference, site {i}")
    mlp = glm_ep.load(folder, comm=_self_comm())
    errs = [rel_l2(mlp.site(i, x), site64(layer, p, x)) for i, layer in enumerate(layers)]
    assert all(e < 1e-2 for e in errs), errs


def test_norm_topk_prob_false_is_followed_by_the_reference_and_the_runtime(tmp_path: Path) -> None:
    """``norm_topk_prob = false``: a routed weight is the expert's unbiased score times routed_scaling_factor, not
    renormalised over the chosen experts, in the float64 Reference (what ``run``'s check holds the runtime
    against) and in the runtime, on a checkpoint of the independent writer."""
    folder = tmp_path / "no-renorm"
    layers, p = write_checkpoint(folder, seed=5, text={"norm_topk_prob": False})
    assert p.renormalize is False
    x = random_x(8, 6, layers[0].mlp[0].shape[1], gain=1.5)
    with Reference(folder) as ref:
        _, wts = ref.route(0, x)
    # renormalised weights would sum to routed_scaling_factor on every row
    assert np.abs(wts.sum(axis=1) - p.routed_scale).min() > 0.05 * p.routed_scale, wts.sum(axis=1)
    _matches_float64(folder, layers, p, x)


def _scale_2_shapes(folder: Path) -> set[tuple[int, ...]]:
    return {shape for f in folder.glob("*.safetensors") for k, (_, shape, _) in read_safetensors(f).items()
            if k.endswith(".weight_scale_2")}


def test_weight_scale_2_stored_with_shape_1_is_read(tmp_path: Path) -> None:
    """A ``weight_scale_2`` of shape ``[1]`` (README: ``[]`` or ``[1]``), routed experts and a dense FFN stored
    NVFP4 alike: read as the scalar it holds, by the loader, the float64 Reference and the runtime."""
    folder = tmp_path / "scale2-1"
    layers, p = write_checkpoint(folder, seed=6, dense_nvfp4=True, scale_2_shape=(1,))
    assert _scale_2_shapes(folder) == {(1,)}
    with Checkpoint(folder) as ck:
        dense, moe = (load_layer(ck, _site(ck, LAYOUTS[0]), i) for i in (1, 0))
        assert isinstance(dense, ExpertWeights) and isinstance(moe, MoeWeights)
        # the decoded projections are the values the writer meant: scale_2 taken whole from the [1] tensor
        for q, want in ((dense.gate, layers[1].mlp[0]), (moe.experts[3].down, layers[0].experts[3][2])):
            assert isinstance(q.scale_2, float), type(q.scale_2)
            np.testing.assert_array_equal(nvfp4_to_f64(q.packed, q.scale.view(np.uint8), q.scale_2), want)
    x = random_x(9, 5, layers[0].mlp[0].shape[1], gain=1.5)
    _matches_float64(folder, layers, p, x)


def test_weight_scale_2_of_another_shape_is_refused(tmp_path: Path, ckpt_copy: Path) -> None:
    """``[1, 1]`` (one value, so a reshape would take it silently) and ``[2]``: refused, naming file and tensor."""
    folder = tmp_path / "scale2-11"
    write_checkpoint(folder, seed=6, scale_2_shape=(1, 1))
    assert _scale_2_shapes(folder) == {(1, 1)}
    with Checkpoint(folder) as ck, pytest.raises(
            CheckpointError, match=r"model-0000\d-of-00003\.safetensors: tensor 'model\.language_model\.layers\.0\.mlp"
                                   r"\.experts\.0\.gate_proj\.weight_scale_2' has shape \[1, 1\], expected a scalar "
                                   r"\(\[\] or \[1\]\)"):
        load_layer(ck, _site(ck, LAYOUTS[0]), 0)
    key = f"{SPARSE}.experts.3.down_proj.weight_scale_2"
    shard = shard_of(ckpt_copy, key)
    _rewrite(shard, lambda t: t.__setitem__(key, ["F32", [2], np.array([0.5, 0.5], np.float32).tobytes()]))
    with Checkpoint(ckpt_copy) as ck:
        with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor '{key}' has shape \[2\], expected a scalar"):
            load_layer(ck, _site(ck, LAYOUTS[0]), 1)
        assert len(load_layer(ck, _site(ck, (2, 1, 2, 2)), 1).experts) == 16  # rank 1 never reads expert 3


# ---- errors: each names the file, tensor or value at fault ------------------------------------

def test_missing_folder_and_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nowhere.*model folder not found"):
        Checkpoint(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="config.json not found"):
        Checkpoint(tmp_path)


def test_no_weights(ckpt_copy: Path) -> None:
    (ckpt_copy / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        Checkpoint(ckpt_copy)


def test_missing_shard(ckpt_copy: Path) -> None:
    shard = shard_of(ckpt_copy, f"{SPARSE}.experts.7.up_proj.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: shard file not found"):
        Checkpoint(ckpt_copy)


def test_truncated_shard(ckpt_copy: Path) -> None:
    shard = shard_of(ckpt_copy, f"{SPARSE}.experts.7.up_proj.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: truncated: header says (\d+) bytes of data, file has"):
        Checkpoint(ckpt_copy)


@pytest.mark.parametrize("damage", ["json", "length", "short"])
def test_corrupt_header(ckpt_copy: Path, damage: str) -> None:
    shard = shard_of(ckpt_copy, f"{SPARSE}.gate.weight")
    data = bytearray(shard.read_bytes())
    if damage == "json":
        data[8] = ord("#")
    elif damage == "length":
        data[:8] = struct.pack("<Q", len(data) * 2)
    else:
        data = data[:5]
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name}: corrupt header"):
        Checkpoint(ckpt_copy)


@pytest.mark.parametrize("value", ["1e999", "2.5", "4.0", "true"])
def test_header_numbers_that_are_not_integers_are_refused(ckpt_copy: Path, value: str) -> None:
    """A shape or offset must be a JSON integer: 1e999 (inf to Python's JSON) stopped the load with an
    OverflowError, and 2.5 was truncated to 2."""
    key = f"{SPARSE}.gate.weight"
    shard = shard_of(ckpt_copy, key)
    data = shard.read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + hlen])
    header[key]["shape"][0] = "@@"
    text = json.dumps(header).replace('"@@"', value).encode()
    shard.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + hlen:])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupt header: entry for tensor '{key}' is "
                                              rf"malformed .*is not an integer"):
        Checkpoint(ckpt_copy)


@pytest.mark.parametrize("edit,needle", [
    ({"num_hidden_layers": 100_000, "mlp_layer_types": None, "first_k_dense_replace": 1},
     r"num_hidden_layers = 100000, but .* holds MLP tensors for layers 0..3 \(4 layers\); no "
     r"'model.layers.\{i\}.mlp.\*' for layer 4, 5, 6, 7 \(and 99992 more\)"),
    ({"n_routed_experts": 2_000_000},
     r"n_routed_experts = 2000000, but layer 1 of .* holds 32 routed experts; no "
     r"'model.layers.1.mlp.experts.\{e\}.\*' for expert 32, 33, 34, 35 \(and 1999964 more\)"),
], ids=["layers", "experts"])
def test_a_config_that_declares_more_than_the_checkpoint_holds_is_refused_at_once(ckpt_copy: Path, tiny_checkpoint,
                                                                                 edit: dict, needle: str) -> None:
    """From the keys alone, with no per-tensor lookup: a typo of 100000 layers took 40 s (10^6: minutes) of
    header lookups before the first missing tensor was named."""
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg.update(edit)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    with Checkpoint(ckpt_copy) as ck, pytest.raises(CheckpointError, match=needle):
        ck.info = lambda name: pytest.fail(f"looked up {name}")
        ck.check_extent()
    with Checkpoint(tiny_checkpoint) as ck:  # what a checkpoint holds, declared as it is
        ck.check_extent()


def test_a_config_that_declares_less_than_the_checkpoint_holds_says_what_is_not_used(ckpt_copy: Path,
                                                                                        tiny_checkpoint) -> None:
    """Fewer layers, experts or shared experts than stored run, as HF loads such a checkpoint, on what config.json
    declares; what they leave unread is said (it ran silently, and printed PASS on part of the weights)."""
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg.update(num_hidden_layers=3, mlp_layer_types=cfg["mlp_layer_types"][:3], n_routed_experts=16,
               n_shared_experts=0)
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    with Checkpoint(ckpt_copy) as ck:
        ck.check_extent()
        config = ckpt_copy / "config.json"
        assert ck.unused == [
            f"{config}: num_hidden_layers = 3, but the checkpoint holds MLP tensors for layer 3 too: they are not used",
            f"{config}: n_routed_experts = 16, but layer 1 holds routed expert 16, 17, 18, 19 (and 12 more) too: they "
            "are not used",
            f"{config}: n_shared_experts = 0, but the checkpoint holds shared-expert tensors "
            "('model.layers.{i}.mlp.shared_experts.*') for layer 1, 2: they are not used"]
    with Checkpoint(tiny_checkpoint) as ck:  # what a checkpoint holds, declared as it is: nothing unused
        ck.check_extent()
        assert ck.unused == []


@pytest.mark.parametrize("types,needle", [
    (["sparse"] * 4, "makes layer 0 sparse, but .* holds a dense FFN there \\(disagreeing layers: 0\\)"),
    (["dense", "dense", "dense", "sparse"], "makes layer 1 dense, but .* holds routed experts there "
     "\\(disagreeing layers: 1, 2\\)"),
    ({"first_k_dense_replace": 0}, "makes layer 0 sparse, but .* holds a dense FFN there"),
], ids=["dense-as-sparse", "sparse-as-dense", "first-k-0"])
def test_a_schedule_that_does_not_match_the_tensors_is_named(ckpt_copy: Path, types, needle: str) -> None:
    """A layer the schedule calls sparse that holds a dense FFN (or the reverse) is named as a schedule mismatch,
    not as a missing expert count or a missing tensor."""
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    if isinstance(types, dict):
        cfg.pop("mlp_layer_types")
        cfg.update(types)
    else:
        cfg["mlp_layer_types"] = types
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    with Checkpoint(ckpt_copy) as ck, pytest.raises(CheckpointError, match="the schedule \\(mlp_layer_types or "
                                                                          "first_k_dense_replace\\) " + needle):
        ck.check_extent()


def test_missing_tensor(ckpt_copy: Path) -> None:
    key = f"{SPARSE}.experts.3.down_proj.weight_scale"
    _rewrite(shard_of(ckpt_copy, key), lambda t: t.pop(key))
    with Checkpoint(ckpt_copy) as ck:
        with pytest.raises(CheckpointError, match=rf"tensor '{key}' not found in .*{shard_of(ckpt_copy, key).name}"):
            load_layer(ck, _site(ck, LAYOUTS[0]), 1)
        # rank 1 of ep = 2 owns experts 16..31 and never asks for expert 3
        assert len(load_layer(ck, _site(ck, (2, 1, 2, 2)), 1).experts) == 16
    index = ckpt_copy / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    del raw["weight_map"][key]
    index.write_text(json.dumps(raw))
    with Checkpoint(ckpt_copy) as ck, pytest.raises(CheckpointError, match=rf"'{key}' not found in .*index.json"):
        load_layer(ck, _site(ck, LAYOUTS[0]), 1)


def test_activation_smoothing_tensors_are_refused(ckpt_copy: Path) -> None:
    """An NVFP4_AWQ export's pre_quant_scale would scale the activations before the product: never ignored."""
    key = f"{SPARSE}.experts.5.up_proj.pre_quant_scale"
    shard = shard_of(ckpt_copy, f"{SPARSE}.experts.5.up_proj.weight")
    _rewrite(shard, lambda t: t.update({key: ["F32", [128], np.ones(128, np.float32).tobytes()]}))
    index = ckpt_copy / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"][key] = shard.name
    index.write_text(json.dumps(raw))
    with Checkpoint(ckpt_copy) as ck:
        with pytest.raises(CheckpointError, match=rf"'{key}' is stored: an activation smoothing"):
            load_layer(ck, _site(ck, LAYOUTS[0]), 1)
        assert len(load_layer(ck, _site(ck, (2, 1, 2, 2)), 1).experts) == 16  # rank 1 never reads expert 5


def test_an_expert_left_unquantized_is_named(ckpt_copy: Path) -> None:
    """Exports whose ignore list keeps some layers' experts in bf16: the projection is named as unquantized,
    not reported as a missing scale."""
    q = f"{SPARSE}.experts.2.down_proj"
    shard = shard_of(ckpt_copy, f"{q}.weight")

    def unquantize(t: RawTensors) -> None:
        for part in ("weight_scale", "weight_scale_2", "input_scale"):
            t.pop(f"{q}.{part}")
        n, half = t[f"{q}.weight"][1]
        t[f"{q}.weight"] = ["BF16", [n, 2 * half], bytes(n * 2 * half * 2)]

    _rewrite(shard, unquantize)
    with Checkpoint(ckpt_copy) as ck, pytest.raises(CheckpointError, match=rf"'{q}.weight' is stored unquantized "
                                                                           r"\(BF16: the export left this projection"):
        load_layer(ck, _site(ck, LAYOUTS[0]), 1)


def test_wrong_shape(ckpt_copy: Path) -> None:
    key = f"{SPARSE}.gate.weight"
    _rewrite(shard_of(ckpt_copy, key), lambda t: t[key].__setitem__(1, [16, 256]))  # same bytes
    with Checkpoint(ckpt_copy) as ck, pytest.raises(
            CheckpointError, match=rf"{shard_of(ckpt_copy, key).name}: tensor '{key}' has shape \[16, 256\], "
                                   r"expected \[32, 128\]"):
        load_layer(ck, _site(ck, LAYOUTS[0]), 1)


def test_bf16_bias_is_refused(ckpt_copy: Path) -> None:
    key = f"{SPARSE}.gate.e_score_correction_bias"

    def to_bf16(t: RawTensors) -> None:
        t[key] = ["BF16", t[key][1], np.frombuffer(t[key][2], np.float32).astype(ml_dtypes.bfloat16).tobytes()]

    _rewrite(shard_of(ckpt_copy, key), to_bf16)
    with Checkpoint(ckpt_copy) as ck, pytest.raises(
            CheckpointError, match=rf"tensor '{key}' has dtype BF16, expected F32 \(the routing bias must stay fp32"):
        load_layer(ck, _site(ck, LAYOUTS[0]), 1)


def test_wrong_dtype_generic(ckpt_copy: Path) -> None:
    key = "model.layers.0.mlp.up_proj.weight"
    _rewrite(shard_of(ckpt_copy, key), lambda t: t[key].__setitem__(0, "F16"))  # same itemsize
    with Checkpoint(ckpt_copy) as ck, pytest.raises(CheckpointError, match=rf"'{key}' has dtype F16, expected BF16"):
        load_layer(ck, _site(ck, LAYOUTS[0]), 0)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("swiglu_limit"), "missing required field 'swiglu_limit'"),
    (lambda c: c.update(n_group=2), "n_group = 2, expected 1"),
])
def test_bad_config(ckpt_copy: Path, edit: Callable[[dict], None], message: str) -> None:
    path = ckpt_copy / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        Checkpoint(ckpt_copy)

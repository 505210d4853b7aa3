"""Synthetic checkpoints: the real on-disk format, deterministic values, sharding, the default cache."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import glm_ep.checkpoint.synth as synth
from glm_ep.checkpoint.reader import Checkpoint
from glm_ep.checkpoint.layers import load_layer
from glm_ep.config.model import RankLayout, SiteConfig
from glm_ep.errors import ConfigError, InputError
from glm_ep.checkpoint.nvfp4 import Nvfp4Weight, dequantize
from glm_ep.config.presets import preset

P = "model.layers.1.mlp"


def _header(path: Path) -> dict:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n])


def _all_headers(model_dir: Path) -> dict[str, dict]:
    return {k: v for f in sorted(model_dir.glob("model-*.safetensors"))
            for k, v in _header(f).items() if k != "__metadata__"}


def _load_sparse(model_dir: Path, layer: int):
    with Checkpoint(model_dir) as ck:
        return load_layer(ck, SiteConfig.for_rank(ck.config, RankLayout(1, 0, 1, 1)), layer)


def test_layout_dtypes_and_index(tiny_checkpoint: Path) -> None:
    index = json.loads((tiny_checkpoint / "model.safetensors.index.json").read_text())
    shards = sorted(tiny_checkpoint.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 1 and [s.name for s in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    headers = _all_headers(tiny_checkpoint)
    assert set(index["weight_map"]) == set(headers)
    assert index["metadata"]["total_size"] == sum(v["data_offsets"][1] - v["data_offsets"][0] for v in headers.values())
    for s in shards:  # every tensor group of tiny is far below the 256 KiB shard size
        assert s.stat().st_size <= 256 * 1024 + 16 * 1024
    want = {
        "model.layers.0.mlp.gate_proj.weight": ("BF16", [256, 128]),
        "model.layers.0.mlp.down_proj.weight": ("BF16", [128, 256]),
        f"{P}.gate.weight": ("BF16", [32, 128]),
        f"{P}.gate.e_score_correction_bias": ("F32", [32]),
        f"{P}.shared_experts.up_proj.weight": ("BF16", [64, 128]),
        f"{P}.experts.31.gate_proj.weight": ("U8", [64, 64]),
        f"{P}.experts.31.gate_proj.weight_scale": ("F8_E4M3", [64, 8]),
        f"{P}.experts.31.down_proj.weight": ("U8", [128, 32]),
        f"{P}.experts.31.down_proj.weight_scale": ("F8_E4M3", [128, 4]),
        f"{P}.experts.31.down_proj.weight_scale_2": ("F32", []),
        f"{P}.experts.31.down_proj.input_scale": ("F32", []),
    }
    for key, (dtype, shape) in want.items():
        assert (headers[key]["dtype"], headers[key]["shape"]) == (dtype, shape), key
    assert "model.layers.0.mlp.gate.weight" not in headers and f"{P}.gate_proj.weight" not in headers
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    assert cfg == preset("tiny")


def test_deterministic_and_independent_of_sharding(tiny_checkpoint: Path, tmp_path: Path) -> None:
    again = synth.write_synthetic(tmp_path / "again", preset("tiny"), seed=0, shard_bytes=256 * 1024)
    for f in tiny_checkpoint.glob("model-*.safetensors"):
        assert (again / f.name).read_bytes() == f.read_bytes()
    resharded = synth.write_synthetic(tmp_path / "one", preset("tiny"), seed=0, shard_bytes=2**40)
    assert len(list(resharded.glob("model-*.safetensors"))) == 1
    a, b = _load_sparse(tiny_checkpoint, 3), _load_sparse(resharded, 3)
    assert np.array_equal(a.experts[9].up.packed, b.experts[9].up.packed)
    assert np.array_equal(a.shared.down.view(np.uint16), b.shared.down.view(np.uint16))
    other = _load_sparse(synth.write_synthetic(tmp_path / "s1", preset("tiny"), seed=1), 3)
    assert not np.array_equal(a.experts[9].up.packed, other.experts[9].up.packed)


def test_values_follow_the_recipe(tiny_checkpoint: Path) -> None:
    w = _load_sparse(tiny_checkpoint, 1)
    assert w.bias.dtype == np.float32
    assert abs(float(w.bias.mean()) - 7.0) < 0.02 and 0.005 < float(w.bias.std()) < 0.05
    router = w.router.astype(np.float32)
    assert abs(float(router.std()) * np.sqrt(128) - 1.0) < 0.1
    down = dequantize(w.experts[0].down)
    assert abs(float(down.std()) * np.sqrt(64) - 1.0) < 0.2
    # heavy gate rows make the clamp at swiglu_limit = 10 fire on unit-variance inputs
    x = np.random.default_rng(5).standard_normal((256, 128)).astype(np.float32)
    g = x @ w.shared.gate.astype(np.float32).T
    assert (g > 10.0).any() and (np.abs(g) > 10.0).mean() < 0.05


def test_experts_read_back_exactly_as_quantized(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Nvfp4Weight] = []
    real = synth.quantize

    def recording(w_NK: np.ndarray) -> Nvfp4Weight:
        made.append(real(w_NK))
        return made[-1]

    monkeypatch.setattr(synth, "quantize", recording)
    cfg = preset("tiny") | {"num_hidden_layers": 2, "mlp_layer_types": ["dense", "sparse"]}
    model = synth.write_synthetic(tmp_path / "m", cfg, seed=3)
    loaded = [getattr(e, proj) for e in _load_sparse(model, 1).experts for proj in ("gate", "up", "down")]
    assert len(made) == len(loaded) == 32 * 3
    for q, r in zip(made, loaded):
        assert np.array_equal(q.packed, r.packed)
        assert np.array_equal(q.scale.view(np.uint8), r.scale.view(np.uint8))
        assert r.scale.dtype == ml_dtypes.float8_e4m3fn and np.float32(q.scale_2) == np.float32(r.scale_2)
        assert np.array_equal(dequantize(q), dequantize(r))


def test_composite_config_nests_text_fields(tmp_path: Path) -> None:
    model = synth.write_synthetic(tmp_path / "c", preset("tiny"), composite=True)
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["quantization_config"]["quant_algo"] == "NVFP4"
    assert cfg["text_config"]["hidden_size"] == 128 and "hidden_size" not in cfg
    assert all(k.startswith("model.language_model.layers.") for k in _all_headers(model))


def test_refuses_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="swiglu_limit"):
        synth.write_synthetic(tmp_path / "a", {k: v for k, v in preset("tiny").items() if k != "swiglu_limit"})
    with pytest.raises(ConfigError, match="n_group = 2"):
        synth.write_synthetic(tmp_path / "b", preset("tiny") | {"n_group": 2})
    with pytest.raises(ValueError, match="router_dtype"):
        synth.write_synthetic(tmp_path / "c", preset("tiny"), router_dtype="fp8")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_ensure_default_checkpoint(tmp_path: Path, tiny_checkpoint: Path) -> None:
    path = synth.ensure_default_checkpoint(tmp_path / "cache")
    assert path == tmp_path / "cache" / "tiny"
    stamp = {f.name: f.stat().st_mtime_ns for f in path.iterdir()}
    assert synth.ensure_default_checkpoint(tmp_path / "cache") == path
    assert {f.name: f.stat().st_mtime_ns for f in path.iterdir()} == stamp  # reused, not rewritten
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["tiny"]  # no temporary left behind
    a, b = _load_sparse(path, 2), _load_sparse(tiny_checkpoint, 2)
    assert np.array_equal(a.experts[4].gate.packed, b.experts[4].gate.packed)
    (path / "model.safetensors.index.json").unlink()  # an incomplete cache entry is replaced
    assert _load_sparse(synth.ensure_default_checkpoint(tmp_path / "cache"), 2).experts


def test_default_checkpoint_is_a_weight_only_export(tmp_path: Path) -> None:
    """The built-in checkpoint does not look like a foreign W4A4 export: no static input scales, and its
    config says W4A16."""
    path = synth.ensure_default_checkpoint(tmp_path / "cache")
    assert not [k for k in _all_headers(path) if k.endswith("input_scale")]
    assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_algo"] == "W4A16_NVFP4"
    assert any(k.endswith("input_scale") for k in _all_headers(synth.write_synthetic(tmp_path / "w4a4",
                                                                                     preset("tiny"))))


@pytest.mark.parametrize("damage", ["flipped-byte", "truncated", "manifest-garbled", "file-gone"])
def test_damaged_default_checkpoint_is_written_again(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                     damage: str) -> None:
    path = synth.ensure_default_checkpoint(tmp_path / "cache")
    want = {p.name: p.read_bytes() for p in path.iterdir()}
    shard = next(path.glob("model-*.safetensors"))
    if damage == "flipped-byte":  # same size: only the digest tells
        data = bytearray(shard.read_bytes())
        data[-1000] ^= 0x40
        shard.write_bytes(bytes(data))
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "manifest-garbled":  # bytes that are not text: the warning names the error, not the bytes
        (path / synth.CACHE_MANIFEST).write_bytes(bytes(range(128, 256)) * 200)
    else:
        (path / "config.json").unlink()
    with caplog.at_level("WARNING"):
        assert synth.ensure_default_checkpoint(tmp_path / "cache") == path
    assert "the cached tiny checkpoint" in caplog.text and "writing it again" in caplog.text
    assert len(caplog.text) < 1000, caplog.text[:300]
    assert {p.name: p.read_bytes() for p in path.iterdir()} == want
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["tiny"]  # nothing left aside


@pytest.mark.parametrize("found", ["checkpoint-of-the-user", "file"])
def test_what_the_cache_did_not_write_is_never_replaced(tmp_path: Path, found: str) -> None:
    """A folder without the cache's manifest (a user's own checkpoint written there, say) or a file at the cache's
    place is left as it is, every byte: an InputError names it and what to do."""
    cache = tmp_path / "cache"
    if found == "file":
        cache.mkdir()
        (cache / "tiny").write_text("mine")
    else:
        synth.write_synthetic(cache / "tiny", preset("tiny"), seed=7)
        (cache / "tiny" / "NOTES.txt").write_text("mine")
    before = {p.relative_to(cache): p.read_bytes() for p in cache.rglob("*") if p.is_file()}
    with pytest.raises(InputError, match=rf"{cache / 'tiny'}: not a checkpoint this cache wrote \(no "
                                         rf"{synth.CACHE_MANIFEST} in a folder there\), so it is left as it is"):
        synth.ensure_default_checkpoint(cache)
    assert {p.relative_to(cache): p.read_bytes() for p in cache.rglob("*") if p.is_file()} == before


def test_damaged_default_checkpoint_that_cannot_be_replaced_says_to_delete_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = synth.ensure_default_checkpoint(tmp_path / "cache")
    (path / "config.json").write_text("{}")

    def refused(src, dst):  # the system refuses every rename (a read-only cache, say)
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr(synth.os, "rename", refused)
    with pytest.raises(InputError, match=rf"{path}: the cached tiny checkpoint differs from what was written "
                                         rf"\(config.json\) and cannot be replaced .*delete {path}"):
        synth.ensure_default_checkpoint(tmp_path / "cache")


@pytest.mark.parametrize("name,layers,types,first_k", [
    ("tiny", 2, ["dense", "sparse"], None), ("glm-5.3-flash", 2, None, 1), ("glm-5.3-flash", 5, None, 3),
    ("glm-5.3-flash", 1, None, 0), ("tiny", 1, ["sparse"], None)])
def test_synth_layers_keeps_one_schedule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, layers: int,
                                        types, first_k) -> None:
    """``--layers N`` cuts the preset's own schedule: mlp_layer_types where it has one (and no first_k_dense_replace
    beside it, which a reader of that key alone would take as another schedule), else first_k_dense_replace."""
    from glm_ep.app.cli import build_parser
    from glm_ep.app.local_jobs import synth_job
    from glm_ep.config.model import ModelConfig

    args = build_parser().parse_args(["synth", "--preset", name, "--layers", str(layers), "--out", str(tmp_path)])
    written = {}
    import glm_ep.checkpoint.synth as synth

    monkeypatch.setattr(synth, "write_synthetic", lambda out, cfg, **kw: written.update(cfg) or Path(out))
    assert synth_job(args) == 0
    assert written.get("mlp_layer_types") == types and written.get("first_k_dense_replace") == first_k
    expected = types or ["dense"] * first_k + ["sparse"] * (layers - first_k)
    assert list(ModelConfig.from_dict(written, source="x").mlp_layer_types) == expected

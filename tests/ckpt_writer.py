"""An independent writer (and reader) of GLM-5.3-Flash NVFP4 checkpoints, for the end-to-end tests.

It shares no code with ``glm_ep`` (not ``nvfp4``, ``synth`` nor ``checkpoint``): its own bf16
rounding, E4M3 encoder, E2M1 quantizer, nibble packer and safetensors container. It writes the
real ModelOpt layout: a composite ``config.json`` (text fields under ``text_config``, the
``quantization_config`` of a ModelOpt export), the ``model.language_model.layers.{i}`` prefix,
an fp32 router, sharded files with an index, and tensors the MLP loader must ignore.
``write_checkpoint`` returns the float64 values the files hold; ``read_f64`` decodes any such
checkpoint (also ``glm_ep.checkpoint.synth``'s) back to float64 with the same independent decoders.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

from helpers import E2M1, Ref64Layer, RefParams, e4m3_to_f64, nvfp4_to_f64

TEXT_CONFIG: dict[str, Any] = {
    "model_type": "glm5_next_text", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "n_shared_experts": 2, "n_routed_experts": 16, "num_experts_per_tok": 4,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "swiglu_limit": 4.0,
    "mlp_layer_types": ["sparse", "dense", "sparse"], "num_attention_heads": 4, "vocab_size": 64,
}
QUANT = {"config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16},
                                       "targets": ["Linear"]}},
         "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_experts.*", "re:.*layers.1.mlp.*"],
         "quant_algo": "NVFP4", "quant_method": "modelopt", "producer": {"name": "modelopt", "version": "0.33"}}
PREFIX = "model.language_model.layers"
# positive finite E4M3 values by bit pattern 0..126 (0x7F is NaN)
E4M3_POS = e4m3_to_f64(np.arange(127))


# ---- encoders ----------------------------------------------------------------------------------
def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_f64(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """Non-negative values -> the nearest E4M3 bit pattern (saturating at 448)."""
    idx = np.searchsorted(E4M3_POS, x)
    lo, hi = np.clip(idx - 1, 0, 126), np.clip(idx, 0, 126)
    return np.where(np.abs(E4M3_POS[hi] - x) < np.abs(x - E4M3_POS[lo]), hi, lo).astype(np.uint8)


def nvfp4_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """``[N, K]`` -> packed bytes ``[N, K/2]`` (even k in the low nibble), E4M3 scale bits ``[N, K/16]``
    and a float32 ``scale_2`` (ModelOpt's: global amax / (6 * 448))."""
    n, k = w.shape
    amax = float(np.abs(w).max())
    scale_2 = np.float32(amax / (6.0 * 448.0) if amax > 0 else 1.0)
    blocks = w.reshape(n, k // 16, 16).astype(np.float64)
    scale_bits = e4m3_encode(np.abs(blocks).max(-1) / (6.0 * float(scale_2)))
    unit = E4M3_POS[scale_bits][..., None] * float(scale_2)
    q = np.divide(blocks, unit, out=np.zeros_like(blocks), where=unit > 0)
    mag = np.argmin(np.abs(np.abs(q)[..., None] - E2M1), axis=-1)  # index 0..7 into the E2M1 grid
    nib = (mag | np.where((q < 0) & (mag > 0), 8, 0)).reshape(n, k).astype(np.uint8)
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8), scale_bits, scale_2


# ---- safetensors container ---------------------------------------------------------------------
def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset, blobs = 0, []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def read_safetensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"]), data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in header.items()}


def _decode(dtype: str, shape: tuple[int, ...], data: bytes) -> np.ndarray:
    if dtype == "BF16":
        return bf16_f64(np.frombuffer(data, np.uint16)).reshape(shape)
    if dtype == "F32":
        return np.frombuffer(data, np.float32).astype(np.float64).reshape(shape)
    if dtype in ("U8", "F8_E4M3"):
        return np.frombuffer(data, np.uint8).reshape(shape)
    raise ValueError(f"unexpected dtype {dtype}")


# ---- writer ------------------------------------------------------------------------------------
def write_checkpoint(out: Path, seed: int, text: dict[str, Any] | None = None, out_gain: float = 1.0,
                     bias_spread: float = 0.05, shards: int = 3, dense_nvfp4: bool = False,
                     scale_2_shape: tuple[int, ...] = ()) -> tuple[list[Ref64Layer], RefParams]:
    """Write the checkpoint; return its float64 layers and routing parameters. ``dense_nvfp4``: the dense
    MLPs quantized like the experts (ModelOpt's nvfp4_experts_dense_mlp recipe). ``scale_2_shape``: the stored
    shape of every ``weight_scale_2`` (``()`` or ``(1,)``, both of which exports write; any other one-element
    shape to test its refusal)."""
    if math.prod(scale_2_shape) != 1:
        raise ValueError(f"scale_2_shape {scale_2_shape} does not hold one value")
    t = dict(TEXT_CONFIG, **(text or {}))
    rng = np.random.default_rng(seed)
    h, inter, m, e = t["hidden_size"], t["intermediate_size"], t["moe_intermediate_size"], t["n_routed_experts"]
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    layers: list[Ref64Layer] = []

    def normal(n: int, k: int, gain: float = 1.0, heavy: bool = False) -> np.ndarray:
        w = rng.standard_normal((n, k)) * gain / math.sqrt(k)
        if heavy:
            w[rng.random(n) < 0.2] *= 6.0  # so the clamp (limit 4) fires on the tails
        return w.astype(np.float32)

    def bf16(name: str, w: np.ndarray) -> np.ndarray:
        bits = bf16_bits(w)
        tensors[name] = ("BF16", w.shape, bits.tobytes())
        return bf16_f64(bits)

    def mlp(p: str, width: int) -> tuple[np.ndarray, ...]:
        return (bf16(f"{p}.gate_proj.weight", normal(width, h, heavy=True)),
                bf16(f"{p}.up_proj.weight", normal(width, h, heavy=True)),
                bf16(f"{p}.down_proj.weight", normal(h, width, out_gain)))

    def nvfp4_mlp(p: str, width: int) -> tuple[np.ndarray, ...]:
        return tuple(nvfp4(f"{p}.{proj}", normal(*shape, gain, heavy=proj != "down_proj"))
                     for proj, shape, gain in (("gate_proj", (width, h), 1.0), ("up_proj", (width, h), 1.0),
                                               ("down_proj", (h, width), out_gain)))

    def nvfp4(p: str, w: np.ndarray) -> np.ndarray:
        packed, scale_bits, scale_2 = nvfp4_encode(w)
        tensors[f"{p}.weight"] = ("U8", packed.shape, packed.tobytes())
        tensors[f"{p}.weight_scale"] = ("F8_E4M3", scale_bits.shape, scale_bits.tobytes())
        tensors[f"{p}.weight_scale_2"] = ("F32", tuple(scale_2_shape), np.float32(scale_2).tobytes())
        tensors[f"{p}.input_scale"] = ("F32", (), np.float32(0.0123).tobytes())  # unused: W4A16
        return nvfp4_to_f64(packed, scale_bits, float(scale_2))

    bf16("model.language_model.embed_tokens.weight", normal(t["vocab_size"], h))
    for i, kind in enumerate(t["mlp_layer_types"]):
        p = f"{PREFIX}.{i}"
        bf16(f"{p}.self_attn.q_proj.weight", normal(h, h))  # not an MLP tensor: must be ignored
        if kind == "dense":
            layers.append(Ref64Layer("dense", (nvfp4_mlp if dense_nvfp4 else mlp)(f"{p}.mlp", inter)))
            continue
        router = normal(e, h, 3.0)
        tensors[f"{p}.mlp.gate.weight"] = ("F32", router.shape, router.tobytes())
        bias = (7.0 + bias_spread * rng.standard_normal(e)).astype(np.float32)
        tensors[f"{p}.mlp.gate.e_score_correction_bias"] = ("F32", bias.shape, bias.tobytes())
        shared = mlp(f"{p}.mlp.shared_experts", t["n_shared_experts"] * m)
        experts = [nvfp4_mlp(f"{p}.mlp.experts.{x}", m) for x in range(e)]
        layers.append(Ref64Layer("sparse", shared, router.astype(np.float64), bias.astype(np.float64), experts))
    bf16("lm_head.weight", normal(t["vocab_size"], h))

    out.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s * per:(s + 1) * per]
        write_safetensors(out / file, {n: tensors[n] for n in reversed(part)})  # file order != key order
        weight_map.update({n: file for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(len(v[2]) for v in tensors.values())}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(
        {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
         "text_config": t, "quantization_config": QUANT}, indent=1))
    return layers, RefParams(t["num_experts_per_tok"], t["routed_scaling_factor"], t["norm_topk_prob"],
                             t["swiglu_limit"])


# ---- reader ------------------------------------------------------------------------------------
def read_f64(model_dir: Path) -> tuple[list[Ref64Layer], RefParams]:
    """Any GLM NVFP4 checkpoint (flat or composite, sharded or not) decoded to float64."""
    cfg = json.loads((model_dir / "config.json").read_text())
    t = cfg.get("text_config", cfg)
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    raw: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for f in files:
        raw.update(read_safetensors(model_dir / f))
    prefix = PREFIX if any(k.startswith(PREFIX) for k in raw) else "model.layers"

    def get(name: str) -> np.ndarray:
        return _decode(*raw[name])

    def proj(name: str) -> np.ndarray:  # bf16 or NVFP4, by what is stored
        if raw[f"{name}.weight"][0] == "BF16":
            return get(f"{name}.weight")
        return nvfp4_to_f64(get(f"{name}.weight"), get(f"{name}.weight_scale"),
                            float(get(f"{name}.weight_scale_2").reshape(())))

    kinds = t.get("mlp_layer_types") or ["dense" if i < t["first_k_dense_replace"] else "sparse"
                                         for i in range(t["num_hidden_layers"])]
    layers = []
    for i, kind in enumerate(kinds):
        p = f"{prefix}.{i}.mlp"
        if kind == "dense":
            layers.append(Ref64Layer("dense", tuple(proj(f"{p}.{x}_proj") for x in ("gate", "up", "down"))))
            continue
        shared = (tuple(get(f"{p}.shared_experts.{x}_proj.weight") for x in ("gate", "up", "down"))
                  if t["n_shared_experts"] else None)
        experts = [tuple(proj(f"{p}.experts.{e}.{x}_proj") for x in ("gate", "up", "down"))
                   for e in range(t["n_routed_experts"])]
        layers.append(Ref64Layer("sparse", shared, get(f"{p}.gate.weight"), get(f"{p}.gate.e_score_correction_bias"),
                                 experts))
    return layers, RefParams(t["num_experts_per_tok"], float(t["routed_scaling_factor"]), t["norm_topk_prob"],
                             float(t["swiglu_limit"]))

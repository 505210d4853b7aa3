"""What one rank reads of one MLP site: its TP slices of the dense FFN / shared expert (bf16, or NVFP4
as some exports store the dense FFN), its EP range of routed experts (with ``moe_tp`` > 1, its slice of
each one's width), and the (never sharded) router,
each tensor checked by ``glm_ep.checkpoint.reader.Checkpoint``; and the bytes such a read moves.

Shapes are ``[out, in]`` as stored. Suffixes: H hidden, I dense/shared width (``Il`` this rank's
slice), E routed experts, M an expert's width (``Ml`` this rank's slice: ``M / moe_tp``, on 16-element
block boundaries, so 8 bytes of ``weight`` and 1 column of ``weight_scale`` per block; ``weight_scale_2``
stays whole).
"""

from __future__ import annotations

from typing import Sequence

import ml_dtypes
import numpy as np

from glm_ep.checkpoint.nvfp4 import E2M1_MAX, Nvfp4Weight
from glm_ep.checkpoint.reader import Checkpoint
from glm_ep.checkpoint.weights import DenseWeights, ExpertWeights, MoeWeights
from glm_ep.config.model import NVFP4_GROUP, ModelConfig, SiteConfig
from glm_ep.errors import CheckpointError, ConfigError

BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)  # below fp32's: a bound for both


def dense_is_nvfp4(ckpt: Checkpoint, layer: int) -> bool:
    """Whether dense layer ``layer``'s FFN is stored NVFP4 (ModelOpt exports that quantize the dense MLPs
    too, e.g. the ``nvfp4_experts_dense_mlp`` recipe) rather than bf16: its gate projection's stored
    dtype says (U8 nibbles); a missing tensor is left to the read to name."""
    try:
        return ckpt.info(f"{ckpt.layer_prefix(layer)}.mlp.gate_proj.weight").dtype == "U8"
    except CheckpointError:
        return False


def _nvfp4_mlp(ckpt: Checkpoint, prefix: str, width: int, hidden: int, tp_rank: int, local: int) -> ExpertWeights:
    """TP slice of an NVFP4 SwiGLU MLP (a dense FFN stored NVFP4), as ``_bf16_mlp`` cuts it: gate/up rows
    ``[tp_rank*Il, (tp_rank+1)*Il)``, down those columns (each projection keeps its own scale_2)."""
    if local % NVFP4_GROUP:
        raise ConfigError(f"{prefix}: a TP slice of {local} of the NVFP4 dense FFN's width {width}, expected a "
                          f"multiple of {NVFP4_GROUP} (its block scales cover {NVFP4_GROUP} columns each)")
    part = slice(tp_rank * local, (tp_rank + 1) * local)
    return ExpertWeights(gate=read_nvfp4(ckpt, f"{prefix}.gate_proj", width, hidden, rows=part),
                         up=read_nvfp4(ckpt, f"{prefix}.up_proj", width, hidden, rows=part),
                         down=read_nvfp4(ckpt, f"{prefix}.down_proj", hidden, width, cols=part))


def _bf16_mlp(ckpt: Checkpoint, prefix: str, width: int, hidden: int, tp_rank: int,
              local: int) -> DenseWeights:
    """TP slice of a bf16 SwiGLU MLP: gate/up rows ``[tp_rank*Il, (tp_rank+1)*Il)``, down those columns."""
    part = slice(tp_rank * local, (tp_rank + 1) * local)
    return DenseWeights(
        gate=ckpt.read(f"{prefix}.gate_proj.weight", (width, hidden), ("BF16",), rows=part),  # [Il, H]
        up=ckpt.read(f"{prefix}.up_proj.weight", (width, hidden), ("BF16",), rows=part),  # [Il, H]
        down=ckpt.read(f"{prefix}.down_proj.weight", (hidden, width), ("BF16",), cols=part),  # [H, Il]
    )


def read_nvfp4(ckpt: Checkpoint, prefix: str, n: int, k: int, rows: slice | None = None,
               cols: slice | None = None) -> Nvfp4Weight:
    """The ModelOpt NVFP4 projection ``prefix`` (e.g. ``{p}.mlp.experts.{e}.gate_proj``) of shape
    ``[n, k]``, or its ``rows`` / ``cols`` (element columns: multiples of the 16-k scale block, a TP
    slice of a row-parallel projection); ``input_scale`` is not read (activations stay bf16)."""
    packed_cols = scale_cols = None
    if cols is not None:
        lo, hi, step = cols.indices(k)
        if step != 1 or lo % NVFP4_GROUP or hi % NVFP4_GROUP:
            raise ConfigError(f"{prefix}: columns {lo}..{hi} of an NVFP4 projection, expected a contiguous slice "
                              f"on {NVFP4_GROUP}-column block boundaries (the TP split of its in width {k})")
        packed_cols, scale_cols = slice(lo // 2, hi // 2), slice(lo // NVFP4_GROUP, hi // NVFP4_GROUP)
    weight = ckpt.info(f"{prefix}.weight")
    if weight.dtype in ("BF16", "F16", "F32"):
        raise CheckpointError(f"{weight.file}: tensor '{prefix}.weight' is stored unquantized ({weight.dtype}: the "
                              "export left this projection out of its NVFP4 quantization); expected a ModelOpt NVFP4 "
                              "projection (U8 weight, weight_scale, weight_scale_2): glm_ep runs routed experts in "
                              "NVFP4 only")
    if ckpt.has(f"{prefix}.pre_quant_scale"):
        raise CheckpointError(f"{ckpt.info(prefix + '.pre_quant_scale').file}: tensor '{prefix}.pre_quant_scale' is "
                              "stored: an activation smoothing (NVFP4_AWQ) that glm_ep does not apply; expected a plain "
                              "ModelOpt NVFP4 projection (weight, weight_scale, weight_scale_2)")
    scale_2 = ckpt.read_scalar(f"{prefix}.weight_scale_2")
    if ckpt.check_finite and not scale_2 > 0:  # NaN and Inf are refused by the read
        raise CheckpointError(f"{ckpt.info(prefix + '.weight_scale_2').file}: tensor '{prefix}.weight_scale_2' = "
                              f"{scale_2}, expected a finite value > 0 (the projection's NVFP4 scale; "
                              "check_weights = false in the topology skips this check)")
    q = Nvfp4Weight(
        packed=ckpt.read(f"{prefix}.weight", (n, k // 2), ("U8",), rows=rows, cols=packed_cols),
        scale=ckpt.read(f"{prefix}.weight_scale", (n, k // NVFP4_GROUP), ("F8_E4M3",), rows=rows, cols=scale_cols),
        scale_2=scale_2,
    )
    if ckpt.check_finite:
        _check_scales(ckpt, prefix, q, k, rows, scale_cols)
    return q


def _check_scales(ckpt: Checkpoint, prefix: str, q: Nvfp4Weight, k: int, rows: slice | None,
                  scale_cols: slice | None) -> None:
    """What the scales will do, not only that they are finite: every E4M3 block scale >= 0 (ModelOpt writes
    ``block_amax / (6 * scale_2)``; a negative one flips its block's signs), and the largest weight the
    projection can hold, ``max block scale x 6 x scale_2``, summed over its ``k`` inputs of magnitude 1, within
    bf16's range (and so fp32's): the bf16 dequantized forms hold the weight itself, and every path accumulates
    such sums in fp32. ``rows`` / ``scale_cols``: where the read slice sits in the stored tensor."""
    bits = q.scale.view(np.uint8)
    negative = (bits & 0x80).astype(bool) & (bits & 0x7F).astype(bool)  # -0 is a zero scale
    info = ckpt.info(f"{prefix}.weight_scale")
    if negative.any():
        r, c = (int(i) for i in np.unravel_index(int(np.argmax(negative)), bits.shape))
        at = [r + (rows.indices(info.shape[0])[0] if rows is not None else 0),
              c + (scale_cols.indices(info.shape[1])[0] if scale_cols is not None else 0)]
        raise CheckpointError(f"{info.file}: tensor '{prefix}.weight_scale' holds a negative block scale: "
                              f"{q.scale[r, c]} (bits 0x{int(bits[r, c]):02X}) at {at}; {int(negative.sum())} of "
                              f"{bits.size} are negative; expected E4M3 block scales >= 0 (check_weights = false in "
                              "the topology skips this check)")
    largest = float(np.uint8(bits.max(initial=0) & 0x7F).view(ml_dtypes.float8_e4m3fn)) * E2M1_MAX * q.scale_2
    if largest * k > BF16_MAX:
        raise CheckpointError(f"{ckpt.info(prefix + '.weight_scale_2').file}: tensor '{prefix}.weight_scale_2' = "
                              f"{q.scale_2:.4g}: the projection holds weights up to {largest:.4g} (largest block "
                              f"scale {largest / E2M1_MAX / q.scale_2:g} x {E2M1_MAX:g} x weight_scale_2), and summed "
                              f"over its {k} inputs of magnitude 1 they pass bf16's and fp32's range "
                              f"({BF16_MAX:.4g}); expected |weight| <= {BF16_MAX / k:.4g} (check_weights = false in "
                              "the topology skips this check)")


def _check_site(model: ModelConfig, cfg: SiteConfig) -> None:
    for what, ours, theirs in (("hidden", cfg.hidden, model.hidden_size),
                               ("moe_intermediate * moe_tp", cfg.moe_intermediate * cfg.moe_tp,
                                model.moe_intermediate_size),
                               ("num_experts", cfg.num_experts, model.n_routed_experts)):
        if ours != theirs:
            raise ConfigError(f"site config {what} = {ours} does not match the checkpoint's {theirs}")


def expert_prefix(ckpt: Checkpoint, layer: int, e: int) -> str:
    """Key prefix of routed expert ``e`` of layer ``layer``."""
    return f"{ckpt.layer_prefix(layer)}.mlp.experts.{e}"


def held_experts(cfg: SiteConfig, held: Sequence[int] | None) -> Sequence[int]:
    """The experts a rank reads, in slot order: a placement's (``held``), else its contiguous EP range."""
    if held is None:
        return range(cfg.expert_start, cfg.expert_start + cfg.local_experts)
    if len(held) != cfg.local_experts:
        raise ConfigError(f"a placement gives this rank {len(held)} experts, its geometry {cfg.local_experts}")
    return held


def layer_read_bytes(ckpt: Checkpoint, cfg: SiteConfig, layer: int, held: Sequence[int] | None = None) -> int:
    """The bytes ``load_layer(ckpt, cfg, layer, held)`` reads, from the headers alone (a tensor missing
    from them counts 0: the load names it)."""
    def stored(name: str, part: int = 1, whole: int = 1) -> int:
        try:
            return ckpt.info(name).nbytes * part // whole
        except CheckpointError:
            return 0

    model, p = ckpt.config, ckpt.layer_prefix(layer)
    projections = ("gate_proj", "up_proj", "down_proj")
    if model.mlp_layer_types[layer] == "dense":
        if not cfg.tp_active(False):
            return 0
        part, whole = cfg.local_dense_intermediate, model.intermediate_size
        if dense_is_nvfp4(ckpt, layer):
            return sum(stored(f"{p}.mlp.{w}.weight", part, whole) + stored(f"{p}.mlp.{w}.weight_scale", part, whole)
                       + stored(f"{p}.mlp.{w}.weight_scale_2") for w in projections)
        return sum(stored(f"{p}.mlp.{w}.weight", part, whole) for w in projections)
    total = stored(f"{p}.mlp.gate.weight") + stored(f"{p}.mlp.gate.e_score_correction_bias")
    if cfg.ep_active():
        for e in held_experts(cfg, held):  # a 1 / moe_tp slice of each
            q = expert_prefix(ckpt, layer, e)
            total += sum(stored(f"{q}.{w}.weight", 1, cfg.moe_tp) + stored(f"{q}.{w}.weight_scale", 1, cfg.moe_tp)
                         + stored(f"{q}.{w}.weight_scale_2") for w in projections)
    if cfg.tp_active(True) and model.n_shared_experts > 0:
        total += sum(stored(f"{p}.mlp.shared_experts.{w}.weight", cfg.local_shared_intermediate,
                            model.shared_intermediate) for w in projections)
    return total


def load_layer(ckpt: Checkpoint, cfg: SiteConfig, layer: int,
               held: Sequence[int] | None = None) -> DenseWeights | ExpertWeights | MoeWeights | None:
    """What this rank holds at MLP site ``layer``.

    Dense site: this rank's TP slice (``DenseWeights``, or ``ExpertWeights`` for a dense FFN stored
    NVFP4), or None on a replica that does not contribute it. Sparse
    site: the router and its fp32 bias (always), experts ``expert_start ..`` (a placement's ``held``
    experts in their slots, ``expert_start ..`` counting slots; empty on a
    non-contributing EP replica; each cut to ``cfg.moe_slice``: gate/up rows ``[Ml, H]``, down columns
    ``[H, Ml]``), the shared expert's TP slice (None on a non-contributing TP replica or when the
    model has no shared expert).
    """
    model = ckpt.config
    _check_site(model, cfg)
    if not 0 <= layer < model.num_hidden_layers:
        raise ConfigError(f"layer {layer} is outside 0..{model.num_hidden_layers - 1}")
    p = ckpt.layer_prefix(layer)
    h = model.hidden_size
    if model.mlp_layer_types[layer] == "dense":
        if not cfg.tp_active(False):
            return None
        read = _nvfp4_mlp if dense_is_nvfp4(ckpt, layer) else _bf16_mlp
        return read(ckpt, f"{p}.mlp", model.intermediate_size, h, cfg.tp_rank, cfg.local_dense_intermediate)

    e_all, inter = model.n_routed_experts, model.moe_intermediate_size
    router_EH = ckpt.read(f"{p}.mlp.gate.weight", (e_all, h), ("BF16", "F32"))
    bias_name = f"{p}.mlp.gate.e_score_correction_bias"
    info = ckpt.info(bias_name)
    if info.dtype != "F32":
        raise CheckpointError(f"{info.file}: tensor '{bias_name}' has dtype {info.dtype}, expected F32 "
                              "(the routing bias must stay fp32: GLM biases sit close together near 7 and "
                              "rounding them changes which experts are chosen)")
    bias_E = ckpt.read(bias_name, (e_all,), ("F32",))

    experts: list[ExpertWeights] = []
    if cfg.ep_active():
        part = cfg.moe_slice if cfg.moe_tp > 1 else None  # this rank's Ml of each expert's width
        for e in held_experts(cfg, held):
            q = expert_prefix(ckpt, layer, e)
            experts.append(ExpertWeights(gate=read_nvfp4(ckpt, f"{q}.gate_proj", inter, h, rows=part),  # [Ml, H]
                                         up=read_nvfp4(ckpt, f"{q}.up_proj", inter, h, rows=part),  # [Ml, H]
                                         down=read_nvfp4(ckpt, f"{q}.down_proj", h, inter, cols=part)))  # [H, Ml]
    shared = None
    if cfg.tp_active(True) and model.n_shared_experts > 0:
        shared = _bf16_mlp(ckpt, f"{p}.mlp.shared_experts", model.shared_intermediate, h, cfg.tp_rank,
                           cfg.local_shared_intermediate)
    return MoeWeights(router=router_EH, bias=bias_E, expert_start=cfg.expert_start,
                      experts=tuple(experts), shared=shared)

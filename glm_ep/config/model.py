"""Model geometry from a checkpoint's ``config.json`` and the per-rank site geometry.

``ModelConfig`` is the model as the checkpoint describes it (global counts). ``RankLayout``
places one MPI rank in the tp/ep split, and ``SiteConfig`` is what one rank's MLP sites
compute: the TP division of the dense/shared widths and the EP division of the experts are
applied in exactly one place, ``SiteConfig.for_rank``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from glm_ep.errors import ConfigError, GlmEpError, not_a_file

#: NVFP4 block size: one E4M3 scale per 16 consecutive k.
NVFP4_GROUP = 16
HF_QUANT_FILE = "hf_quant_config.json"  # ModelOpt's own record of the quantization, beside config.json

_REQUIRED = {
    "hidden_size": int,
    "intermediate_size": int,
    "moe_intermediate_size": int,
    "num_hidden_layers": int,
    "n_shared_experts": int,
    "n_routed_experts": int,
    "num_experts_per_tok": int,
    "routed_scaling_factor": (int, float),
    "norm_topk_prob": bool,
    "n_group": int,
    "swiglu_limit": (int, float),
}
_EXPECTED = {int: "an integer", (int, float): "a number", bool: "a boolean (true or false)"}  # of _REQUIRED's types


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a key given twice (``json`` would keep the last silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse_json(raw: bytes, source: str, error: type[GlmEpError] = ConfigError) -> Any:
    """The JSON value of a file's bytes; ``error`` naming ``source`` and the fault when it is not one, or when an
    object names a key twice (which of the two a reader takes is not defined: Python's keeps the last)."""
    try:
        return json.loads(raw, object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as e:
        raise error(f"{source}: not UTF-8 text ({e}); expected a JSON file") from None
    except _DuplicateKey as e:
        raise error(f"{source}: the key {e.args[0]!r} is given twice in one object; expected each key once") from None
    except json.JSONDecodeError as e:
        raise error(f"{source}: not valid JSON ({e})") from None
    except RecursionError:
        raise error(f"{source}: JSON nested too deeply to parse; expected a flat JSON object") from None


@dataclass(frozen=True)
class ModelConfig:
    """GLM-5.3 MLP geometry and routing semantics, global (unsharded) counts."""

    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    n_shared_experts: int
    n_routed_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    n_group: int
    swiglu_limit: float
    mlp_layer_types: tuple[str, ...]
    router_bf16: bool = False

    @property
    def shared_intermediate(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "sparse")

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "dense")

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if (problem := not_a_file(path, "config.json")) is not None:
            raise ConfigError(f"{problem}; expected the HF config.json of the model folder, a regular file")
        return cls.from_dict(parse_json(path.read_bytes(), str(path)), source=str(path),
                             quant_file=path.parent / HF_QUANT_FILE)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config", quant_file: Path | None = None) -> "ModelConfig":
        """Parse an HF ``glm5_next`` config: text fields at the top level or under ``text_config``. Without a
        ``quantization_config``, older ModelOpt exports record it in ``quant_file`` (hf_quant_config.json)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        quant = raw.get("quantization_config", text.get("quantization_config"))
        quant_source, quant_key = source, "quantization_config"  # the file and key the settings came from
        if ("quantization_config" not in raw and "quantization_config" not in text and quant_file is not None
                and quant_file.is_file()):
            quant_source = str(quant_file)
            found = parse_json(quant_file.read_bytes(), quant_source)
            if not isinstance(found, dict):
                raise ConfigError(f"{quant_source}: a JSON {type(found).__name__}, expected an object whose "
                                  f"'quantization' describes {_EXPECTED_QUANT}")
            quant = dict(found, quant_method="modelopt")
            quant_key = "quantization" if isinstance(found.get("quantization"), dict) else "the file"
        vals: dict[str, Any] = {}
        for key, typ in _REQUIRED.items():
            if key not in text:
                why = (" (GLM-5.3 clamps its SwiGLU asymmetrically; the limit is never defaulted)"
                       if key == "swiglu_limit" else "")
                raise ConfigError(f"{source}: missing required field '{key}'{why}")
            v = text[key]
            if isinstance(v, bool) and typ is not bool or not isinstance(v, typ):
                raise ConfigError(f"{source}: field '{key}' = {v!r} has type {type(v).__name__}, "
                                  f"expected {_EXPECTED[typ]}")
            vals[key] = v
        vals["routed_scaling_factor"] = float(vals["routed_scaling_factor"])
        vals["swiglu_limit"] = float(vals["swiglu_limit"])
        vals["mlp_layer_types"] = _layer_types(text, vals["num_hidden_layers"], source)
        act = text.get("hidden_act", "silu")  # HF's default; its MLPs and shared expert apply config.hidden_act
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act = {act!r}, expected 'silu' (glm5_next's clamped SwiGLU, the only "
                              "activation glm_ep computes)")
        router_dtype = text.get("moe_router_dtype", "float32")
        if router_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"{source}: moe_router_dtype = {router_dtype!r}, expected 'float32' or 'bfloat16'")
        vals["router_bf16"] = router_dtype == "bfloat16"
        _check_quantization(quant, source, vals["num_hidden_layers"], quant_source, quant_key)
        cfg = cls(**vals)
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"{source}: {msg}")

        for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "n_routed_experts"):
            if getattr(self, key) <= 0:
                raise bad(f"{key} = {getattr(self, key)}, expected a positive integer")
        if self.n_shared_experts < 0:
            raise bad(f"n_shared_experts = {self.n_shared_experts}, expected >= 0")
        if self.n_group != 1:
            raise bad(f"n_group = {self.n_group}, expected 1 (grouped top-k routing is not supported)")
        # both are applied in fp32 (the kernels' and the NumPy backend's): they must be finite, and the limit
        # nonzero, there, not only as Python floats (1e300 is inf in fp32, 1e-300 is 0)
        if not (math.isfinite(_f32(self.swiglu_limit)) and _f32(self.swiglu_limit) > 0):
            raise bad(f"swiglu_limit = {self.swiglu_limit}, expected a value > 0 that is finite and nonzero in "
                      "float32 (a zero limit is not 'no clamp', it forces the gate to <= 0)")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:  # the backend's own limit: make_backend
            raise bad(f"num_experts_per_tok = {self.num_experts_per_tok}, expected 1 to {self.n_routed_experts} "
                      "(n_routed_experts)")
        for key in ("hidden_size", "moe_intermediate_size"):
            if getattr(self, key) % NVFP4_GROUP:
                raise bad(f"{key} = {getattr(self, key)} is not a multiple of the NVFP4 group size "
                          f"{NVFP4_GROUP}")
        if not math.isfinite(_f32(self.routed_scaling_factor)):
            raise bad(f"routed_scaling_factor = {self.routed_scaling_factor}, expected a number finite in float32 "
                      f"(|v| <= {float(np.finfo(np.float32).max):.4g})")
        if not self.routed_scaling_factor > 0:  # it multiplies the routing weights: <= 0 flips or drops the experts
            raise bad(f"routed_scaling_factor = {self.routed_scaling_factor}, expected a number > 0 (it scales the "
                      "chosen experts' weights)")


def _f32(v: float) -> float:
    """``v`` as the float32 it is applied as (inf past float32's range, 0 below its least subnormal)."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def _layer_types(text: dict[str, Any], n_layers: int, source: str) -> tuple[str, ...]:
    """The MLP schedule: ``mlp_layer_types``, or the first ``first_k_dense_replace`` layers dense; where both are
    given they must say the same (a reader of either key alone would take the other schedule)."""
    first_k = None
    if "first_k_dense_replace" in text:
        k = text["first_k_dense_replace"]
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= n_layers:
            raise ConfigError(f"{source}: first_k_dense_replace = {k!r}, expected an integer in 0..={n_layers}")
        first_k = tuple("dense" if i < k else "sparse" for i in range(n_layers))
    if "mlp_layer_types" in text:
        types = text["mlp_layer_types"]
        if not isinstance(types, list) or len(types) != n_layers or any(t not in ("dense", "sparse") for t in types):
            raise ConfigError(f"{source}: mlp_layer_types = {types!r}, expected a list of {n_layers} "
                              "entries, each 'dense' or 'sparse'")
        if first_k is not None and tuple(types) != first_k:
            differ = [i for i, (a, b) in enumerate(zip(types, first_k)) if a != b]
            raise ConfigError(f"{source}: mlp_layer_types and first_k_dense_replace = "
                              f"{text['first_k_dense_replace']} disagree on layer(s) {differ[:8]}"
                              f"{' ...' if len(differ) > 8 else ''}; expected one schedule (drop one of the keys, or "
                              "make them agree)")
        return tuple(types)
    if first_k is not None:
        return first_k
    raise ConfigError(f"{source}: neither 'mlp_layer_types' nor 'first_k_dense_replace' is set; "
                      "one of them is needed to know which layers are dense")


#: quant_algo tags whose weights are ModelOpt NVFP4 as glm_ep reads them (W4A16_NVFP4: ModelOpt's weight-only tag;
#: an NVFP4 (W4A4) checkpoint's static input scales are not used: activations stay bf16)
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
_EXPECTED_QUANT = "ModelOpt NVFP4 (quant_method 'modelopt', quant_algo 'NVFP4' or 'W4A16_NVFP4', group_size 16)"
_MLP_MODULE = re.compile(r"layers\.(\d+)\.mlp\.")


def _check_quantization(quant: Any, source: str, n_layers: int, quant_source: str | None = None,
                        key: str = "quantization_config") -> None:
    """The checkpoint's quantization is ModelOpt NVFP4 with 16-element blocks for every MLP tensor it
    quantizes: a config.json ``quantization_config`` (``quant_method`` or the older ``quant_library``), or an
    hf_quant_config.json (``quantization`` nested); ``MIXED_PRECISION`` where every MLP module of layers
    ``0 .. n_layers - 1`` in its ``quantized_layers`` map is NVFP4 (other modules, and MTP layers past the
    last, are not read). Activation smoothing (``pre_quant_scale``, NVFP4_AWQ) is refused: glm_ep does not
    apply it, and the products would be silently wrong. ``source`` is config.json; ``quant_source`` and ``key``
    name the file and key the settings came from (hf_quant_config.json's ``quantization``), which a refusal names."""
    quant_source = source if quant_source is None else quant_source
    if quant is None:
        raise ConfigError(f"{source}: no quantization_config (nor an hf_quant_config.json beside it); expected "
                          f"{_EXPECTED_QUANT} routed experts")
    if not isinstance(quant, dict):
        raise ConfigError(f"{quant_source}: {key} = {quant!r} has type {type(quant).__name__}, expected "
                          f"an object describing {_EXPECTED_QUANT}")
    method = str(quant.get("quant_method", quant.get("quant_library", ""))).lower()
    q = quant["quantization"] if isinstance(quant.get("quantization"), dict) else quant
    algo, group = str(q.get("quant_algo")).upper(), q.get("group_size", NVFP4_GROUP)

    def refuse(what: str) -> ConfigError:
        return ConfigError(f"{quant_source}: {key} has {what}; expected {_EXPECTED_QUANT}")

    if method not in ("modelopt", "modelopt_fp4"):
        raise refuse(f"quant_method={method!r}")
    if q.get("pre_quant_scale") or "AWQ" in algo:
        raise refuse(f"quant_algo={q.get('quant_algo')!r} with activation smoothing (pre_quant_scale), which glm_ep "
                     "does not apply")
    if algo != "MIXED_PRECISION":
        if algo not in NVFP4_ALGOS or group != NVFP4_GROUP:
            raise refuse(f"quant_algo={q.get('quant_algo')!r}, group_size={group!r}")
        return
    layers = q.get("quantized_layers")
    if not isinstance(layers, dict):
        raise refuse("quant_algo='MIXED_PRECISION' without a quantized_layers map")
    for name, spec in layers.items():
        m = _MLP_MODULE.search(name)
        if m is None or int(m.group(1)) >= n_layers:
            continue  # not an MLP tensor glm_ep reads (attention; an MTP layer past the last)
        spec = spec if isinstance(spec, dict) else {}
        a, g = str(spec.get("quant_algo")).upper(), spec.get("group_size", NVFP4_GROUP)
        if a not in NVFP4_ALGOS or g != NVFP4_GROUP or spec.get("pre_quant_scale"):
            raise refuse(f"quantized_layers[{name!r}] = {spec!r} (MIXED_PRECISION)")


@dataclass(frozen=True)
class RankLayout:
    """Where one rank sits: ``tp`` divides ``world``, and so does ``ep * moe_tp``.

    Convention (docs/PLACEMENT.md): ``tp_rank = rank % tp``. The routed experts are split over
    ``ep`` expert groups of ``moe_tp`` consecutive ranks: ``moe_tp_rank = rank % moe_tp`` picks the
    slice of every expert's intermediate width, ``ep_rank = (rank // moe_tp) % ep`` the group's
    contiguous expert range (``moe_tp = 1``: ``ep_rank = rank % ep``, as before).

    Replica rule: when a degree is below ``world`` the shards are replicated, and only the first
    replica may contribute to an all-reduced sum: ranks ``< tp`` for the TP shards, ranks
    ``< ep * moe_tp`` for the routed experts. Every piece of work is then counted exactly once.
    """

    world: int
    rank: int
    tp: int
    ep: int
    moe_tp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "moe_tp"):
            d = getattr(self, name)
            if d < 1 or self.world % d:
                raise ConfigError(f"{name} = {d} does not divide the world size {self.world}; "
                                  f"expected a divisor of {self.world}")
        if self.world % (self.ep * self.moe_tp):
            raise ConfigError(f"ep * moe_tp = {self.ep} * {self.moe_tp} = {self.ep * self.moe_tp} does not divide the "
                              f"world size {self.world}; expected ep groups of moe_tp ranks that tile the world")
        if not 0 <= self.rank < self.world:
            raise ConfigError(f"rank {self.rank} is outside world size {self.world}")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp

    @property
    def ep_rank(self) -> int:
        return (self.rank // self.moe_tp) % self.ep


@dataclass(frozen=True)
class SiteConfig:
    """One rank's MLP geometry: global expert count, local widths, and who contributes what.

    ``moe_intermediate`` is the width this rank runs of each routed expert: ``moe_intermediate_size /
    moe_tp`` (its slice ``moe_tp_rank``: gate/up rows, down columns), the whole width at ``moe_tp = 1``."""

    hidden: int
    local_dense_intermediate: int
    moe_intermediate: int
    local_shared_intermediate: int
    num_experts: int  # FULL routed-expert count: the router ranks all of them
    local_experts: int
    ep_rank: int
    tp_rank: int
    top_k: int
    routed_scale: float
    renormalize: bool
    swiglu_limit: float
    router_bf16: bool
    tp: int
    ep: int
    world: int
    rank: int
    moe_tp: int = 1
    moe_tp_rank: int = 0

    @classmethod
    def for_rank(cls, model: ModelConfig, layout: RankLayout) -> "SiteConfig":
        tp, ep, moe_tp = layout.tp, layout.ep, layout.moe_tp
        if model.intermediate_size % tp or model.shared_intermediate % tp:
            fits = [t for t in range(1, layout.world + 1)
                    if layout.world % t == 0 and not model.intermediate_size % t and not model.shared_intermediate % t]
            hint = (f"; expected a tp that divides it, at world {layout.world} one of {fits} (--tp, or the topology's "
                    "tp; with no --topology, tp is the number of ranks)")
            if model.intermediate_size % tp:
                raise ConfigError(f"intermediate_size {model.intermediate_size} does not divide over tp = {tp}{hint}")
            raise ConfigError(f"n_shared_experts * moe_intermediate_size = {model.shared_intermediate} "
                              f"does not divide over tp = {tp}{hint}")
        if model.n_routed_experts % ep:
            raise ConfigError(f"n_routed_experts {model.n_routed_experts} does not divide over ep = {ep}; "
                              "a ragged split would leave some expert ids owned by nobody")
        if model.moe_intermediate_size % (moe_tp * NVFP4_GROUP):
            raise ConfigError(f"moe_tp = {moe_tp}: moe_intermediate_size {model.moe_intermediate_size} does not split "
                              f"into {moe_tp} slices on {NVFP4_GROUP}-element NVFP4 block boundaries; expected a moe_tp "
                              f"that divides {model.moe_intermediate_size // NVFP4_GROUP} (its scale blocks)")
        return cls(
            hidden=model.hidden_size,
            local_dense_intermediate=model.intermediate_size // tp,
            moe_intermediate=model.moe_intermediate_size // moe_tp,
            local_shared_intermediate=model.shared_intermediate // tp,
            num_experts=model.n_routed_experts,
            local_experts=model.n_routed_experts // ep,
            ep_rank=layout.ep_rank,
            tp_rank=layout.tp_rank,
            top_k=model.num_experts_per_tok,
            routed_scale=model.routed_scaling_factor,
            renormalize=model.norm_topk_prob,
            swiglu_limit=model.swiglu_limit,
            router_bf16=model.router_bf16,
            tp=tp,
            ep=ep,
            world=layout.world,
            rank=layout.rank,
            moe_tp=moe_tp,
            moe_tp_rank=layout.moe_tp_rank,
        )

    @property
    def expert_start(self) -> int:
        return self.ep_rank * self.local_experts

    @property
    def moe_slice(self) -> slice:
        """This rank's columns of each routed expert's intermediate width (gate/up rows, down columns)."""
        return slice(self.moe_tp_rank * self.moe_intermediate, (self.moe_tp_rank + 1) * self.moe_intermediate)

    def with_slots(self, slots: int) -> "SiteConfig":
        """The geometry under a placement of ``slots`` physical expert slots (experts + replicas: ``glm_ep.balance
        .placement``), ``slots / ep`` a group: ``local_experts`` and ``expert_start`` count physical slots."""
        if slots < self.num_experts or slots % self.ep:
            raise ConfigError(f"{slots} expert slots do not split over ep = {self.ep} (or cover {self.num_experts} "
                              "experts)")
        return replace(self, local_experts=slots // self.ep)

    def physical(self) -> "SiteConfig":
        """The geometry the routed-expert dispatch runs with: ids are physical slots (``glm_ep.mlp.expert_map``),
        ``local_experts * ep`` of them (the experts themselves without a placement)."""
        return replace(self, num_experts=self.local_experts * self.ep)

    def local_slot(self, global_id: int) -> int | None:
        """Global expert id -> local index, or None when another rank owns it (it contributes zero)."""
        local = global_id - self.expert_start
        return local if 0 <= local < self.local_experts else None

    def reduces(self, sparse: bool) -> bool:
        """Whether a site's output leaves this rank as a partial sum needing the all-reduce."""
        return self.tp > 1 or (sparse and self.ep * self.moe_tp > 1)

    def tp_active(self, sparse: bool) -> bool:
        """Whether this rank adds its TP shard (dense FFN / shared expert) to the site output."""
        return not self.reduces(sparse) or self.rank < self.tp

    def ep_active(self) -> bool:
        """Whether this rank adds its routed experts (its slice of each) to the (sparse) site output."""
        return not self.reduces(True) or self.rank < self.ep * self.moe_tp

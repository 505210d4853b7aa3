"""``attach``: a transformers ``glm5_next`` model whose decoder layers' MLPs glm_ep serves.

Each decoder layer's ``mlp`` (HF's ``Glm5NextTextMLP`` or ``Glm5NextTextMoE``) becomes a ``GlmEpMlp`` calling
``mlp.site(i, x)``: ``x`` ``[batch, seq, hidden]`` (the hidden state after the post-attention norm) goes in as
bf16 ``[batch*seq, hidden]``, and the result comes back in ``x``'s shape, dtype and device. Everything else stays
HF's: attention, hyper-connections, norms, the KV cache, generation. HF's MLP modules are dropped (their memory
is freed once nothing else holds them). Inference only: no gradient flows through a served MLP.

Numerics are glm_ep's contract (DESIGN.md): a site reads bf16 and returns bf16, so a float32 model rounds the
MLP's input to bf16 and widens its output exactly.

Every rank runs the whole model, its attention replicated, and its share of each site. A site is collective:
every rank calls the model the same way with the same input bits. With the same weights, the same prompt and
deterministic kernels that holds by itself; a topology with ``check_calls = true`` makes the ranks agree each
site's input bits, so a rank whose attention computed otherwise is an error on every rank.
"""

from __future__ import annotations

from typing import Any

from glm_ep.api import GlmMlp
from glm_ep.dist.ranks import Ranks
from glm_ep.errors import ConfigError, InputError
from glm_ep.hf import deps

torch = deps.torch()
hf = deps.glm5_next()

#: the HF text config's fields that define its MLPs, each the ``ModelConfig`` field of the same name
MLP_FIELDS = ("num_hidden_layers", "hidden_size", "mlp_layer_types", "intermediate_size", "moe_intermediate_size",
              "n_shared_experts", "n_routed_experts", "num_experts_per_tok", "routed_scaling_factor", "norm_topk_prob",
              "n_group", "swiglu_limit")
_MODELS = "a transformers glm5_next model (Glm5NextForConditionalGeneration, Glm5NextModel or Glm5NextTextModel)"


class GlmEpMlp(torch.nn.Module):
    """Decoder layer ``layer``'s MLP served by glm_ep: ``[..., hidden]`` in, the same shape, dtype, device out."""

    def __init__(self, mlp: GlmMlp, layer: int):
        super().__init__()
        self.glm_mlp, self.layer = mlp, layer

    def forward(self, hidden_states: Any) -> Any:
        x_TH = hidden_states.reshape(-1, hidden_states.shape[-1]).to(torch.bfloat16)
        y_TH = self.glm_mlp.site(self.layer, x_TH)
        return y_TH.to(hidden_states.dtype).reshape(hidden_states.shape)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, served by {self.glm_mlp!r}"


def text_model(model: Any) -> Any:
    """The one ``Glm5NextTextModel`` inside ``model`` (or ``model`` itself); InputError otherwise."""
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model is a {type(model).__module__}.{type(model).__qualname__}; expected {_MODELS}")
    found = [m for m in model.modules() if isinstance(m, hf.Glm5NextTextModel)]
    if len(found) != 1:
        raise InputError(f"model is a {type(model).__name__} holding {len(found)} Glm5NextTextModel modules; "
                         f"expected {_MODELS}")
    return found[0]


def _differences(config: Any, mlp: GlmMlp) -> list[str]:
    """Each MLP field where the HF text config and the glm_ep checkpoint differ, as 'name: model vs checkpoint'."""
    out = []
    for name in MLP_FIELDS:
        theirs, ours = getattr(config, name, None), getattr(mlp.config, name)
        same = (tuple(theirs or ()) == ours if name == "mlp_layer_types"
                else theirs is not None and float(theirs) == float(ours))
        if not same:
            out.append(f"{name} {list(theirs) if isinstance(theirs, (list, tuple)) else theirs!r} in the model, "
                       f"{list(ours) if isinstance(ours, tuple) else ours!r} in the checkpoint")
    act = getattr(config, "hidden_act", "silu")  # a checkpoint's config refuses any other (ModelConfig.from_dict)
    if act != "silu":
        out.append(f"hidden_act {act!r} in the model, 'silu' (the only activation glm_ep computes) in the checkpoint")
    return out


def _layers(model: Any, mlp: GlmMlp) -> list[Any]:
    """The decoder layers whose MLPs ``mlp`` serves, after checking that model and checkpoint match."""
    text = text_model(model)
    differ = _differences(text.config, mlp)
    if differ:
        raise ConfigError(f"the transformers model and the glm_ep checkpoint differ: {'; '.join(differ)}; expected "
                          "the model the checkpoint was made from (glm-ep synth --hf-model writes a matching pair)")
    layers = list(text.layers)
    if len(layers) != mlp.num_layers:
        raise ConfigError(f"the transformers model holds {len(layers)} decoder layers, its config says "
                          f"num_hidden_layers = {mlp.num_layers}; expected one layer each")
    for i, (layer, kind) in enumerate(zip(layers, mlp.config.mlp_layer_types)):
        want = hf.Glm5NextTextMoE if kind == "sparse" else hf.Glm5NextTextMLP
        held = getattr(layer, "mlp", None)
        if not isinstance(held, (want, GlmEpMlp)):
            raise ConfigError(f"decoder layer {i}'s mlp is a {type(held).__name__}; expected the {kind} layer's "
                              f"{want.__name__} (or one glm_ep serves)")
    return layers


def attach(model: Any, mlp: GlmMlp) -> Any:
    """Serve every decoder layer's MLP of ``model`` (a transformers ``glm5_next`` model) from ``mlp``
    (``glm_ep.load``) and return ``model``. Collective: every rank attaches its model; a model whose layer count,
    hidden size, schedule or other MLP field differs from the checkpoint's, on any rank, is an error on every
    rank, naming the fields."""
    if not isinstance(mlp, GlmMlp):
        raise InputError(f"mlp is a {type(mlp).__module__}.{type(mlp).__qualname__}; expected the GlmMlp that "
                         "glm_ep.load returns")
    ranks = Ranks(mlp.comm, mlp.topology.collective_timeout_s)
    layers = ranks.agree("transformers model check", lambda: _layers(model, mlp))
    for i, layer in enumerate(layers):
        layer.mlp = GlmEpMlp(mlp, i)
    return model

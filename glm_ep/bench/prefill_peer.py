"""The PyTorch peers of ``glm-ep bench --prefill``, at the GLM-5.3-Flash shape with bf16 weights:
HF transformers' own ``Glm5NextTextMoE`` / ``Glm5NextTextMLP`` (each experts implementation it
offers, the fastest reported) and ``torch._grouped_mm`` over pre-dequantized bf16 experts.

Shape suffixes: T rows, H hidden, E experts, M moe width, S = T*K sorted slots.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from glm_ep.bench.common import torch_time_us
from glm_ep.config.model import ModelConfig

#: transformers' experts implementations, with the widest rows each is tried at (batched_mm
#: gathers every slot's weights: [S, 2M, H] bf16 runs out of memory past a few dozen rows; the
#: eager loop over experts is 30x slower than grouped_mm from 128 rows on, 130+ ms a call)
EXPERTS_IMPLS = {"grouped_mm": 1 << 30, "batched_mm": 32, "eager": 16}


def hf_available() -> str:
    """'' when transformers' glm5_next modules import, else why not."""
    try:
        importlib.import_module("transformers.models.glm5_next.modeling_glm5_next")
    except Exception as e:  # not installed, or a transformers without glm5_next
        return f"{type(e).__name__}: {e}"
    return ""


def _hf_config(m: ModelConfig) -> Any:
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    return Glm5NextTextConfig(
        hidden_size=m.hidden_size, intermediate_size=m.intermediate_size, moe_intermediate_size=m.moe_intermediate_size,
        num_hidden_layers=1, n_shared_experts=m.n_shared_experts, n_routed_experts=m.n_routed_experts,
        num_experts_per_tok=m.num_experts_per_tok, routed_scaling_factor=m.routed_scaling_factor,
        norm_topk_prob=m.norm_topk_prob, n_group=1, topk_group=1, swiglu_limit=m.swiglu_limit,
        mlp_layer_types=["sparse"], num_attention_heads=64, num_key_value_heads=64, vocab_size=64)


@torch.no_grad()
def hf_moe(m: ModelConfig) -> Any:
    """``Glm5NextTextMoE`` in bf16 on the GPU with random weights (the router in bf16 too, upcast
    by the module itself, as a bf16 checkpoint loads)."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMoE

    cfg = _hf_config(m)
    with torch.device("cuda"):
        mod = Glm5NextTextMoE(cfg).to(torch.bfloat16).eval()
    h, mi = m.hidden_size, m.moe_intermediate_size
    mod.experts.gate_up_proj.normal_(0.0, h ** -0.5)
    mod.experts.down_proj.normal_(0.0, mi ** -0.5)
    mod.gate.weight.normal_(0.0, h ** -0.5)
    mod.gate.e_score_correction_bias.copy_(7.0 + 0.02 * torch.randn(m.n_routed_experts, device="cuda"))
    for lin in (mod.shared_experts.gate_proj, mod.shared_experts.up_proj, mod.shared_experts.down_proj):
        lin.weight.normal_(0.0, lin.weight.shape[1] ** -0.5)
    return mod


@torch.no_grad()
def hf_mlp(m: ModelConfig, width: int) -> Any:
    """``Glm5NextTextMLP`` (the dense site, or the shared expert's shape) in bf16 on the GPU."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMLP

    with torch.device("cuda"):
        mod = Glm5NextTextMLP(_hf_config(m), intermediate_size=width).to(torch.bfloat16).eval()
    for lin in (mod.gate_proj, mod.up_proj, mod.down_proj):
        lin.weight.normal_(0.0, lin.weight.shape[1] ** -0.5)
    return mod


def set_experts_impl(mod: Any, impl: str) -> None:
    mod.experts.config._experts_implementation = impl


def hf_moe_fastest(mod: Any, x_TH: torch.Tensor, iters: int) -> dict[str, Any]:
    """``mod`` (``hf_moe``) timed under every experts implementation that runs at ``x``'s width:
    ``hf_moe_{impl}_us`` each (None where it ran out of memory), ``hf_moe_best`` (the fastest
    implementation's name) and ``hf_moe_us`` (its time)."""
    r: dict[str, Any] = {}
    for impl, widest in EXPERTS_IMPLS.items():
        if x_TH.shape[0] > widest:
            continue
        set_experts_impl(mod, impl)
        try:
            r[f"hf_moe_{impl}_us"] = torch_time_us(lambda: mod(x_TH), iters=iters)
        except torch.OutOfMemoryError:
            r[f"hf_moe_{impl}_us"] = None
        torch.cuda.empty_cache()
    timed = {i: r[f"hf_moe_{i}_us"] for i in EXPERTS_IMPLS if r.get(f"hf_moe_{i}_us")}
    r["hf_moe_best"] = min(timed, key=timed.get)
    r["hf_moe_us"] = timed[r["hf_moe_best"]]
    return r


def torch_router(m: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """The router as HF runs it: fp32 logits of the upcast x and weight, sigmoid, biased top-k."""
    w_EH = torch.randn(m.n_routed_experts, m.hidden_size, device="cuda", dtype=torch.bfloat16) * m.hidden_size ** -0.5
    bias = 7.0 + 0.02 * torch.randn(m.n_routed_experts, device="cuda")

    def route(x_TH: torch.Tensor) -> torch.Tensor:
        s = torch.nn.functional.linear(x_TH.float(), w_EH.float()).sigmoid()
        return torch.topk(s + bias, m.num_experts_per_tok, dim=-1, sorted=False).indices

    return route


def grouped_mm_experts(mod: Any, m: ModelConfig, x_TH: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The routed expert GEMMs alone as ``torch._grouped_mm`` runs them on the HF module's bf16
    weights: slots sorted by expert once (outside the timing), then gate_up, SwiGLU, down."""
    with torch.no_grad():
        _, _, ids_TK = mod.gate(x_TH)
    flat = ids_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    x_SH = x_TH[order // m.num_experts_per_tok].contiguous()
    offs = torch.cumsum(torch.bincount(flat, minlength=m.n_routed_experts), 0).to(torch.int32)
    w_gu = mod.experts.gate_up_proj.transpose(1, 2)  # [E, H, 2M]
    w_d = mod.experts.down_proj.transpose(1, 2)  # [E, M, H]
    lim = m.swiglu_limit

    def run() -> torch.Tensor:
        gu = torch._grouped_mm(x_SH, w_gu, offs=offs)
        g, u = gu.chunk(2, dim=-1)
        act = torch.nn.functional.silu(g.clamp(max=lim)) * u.clamp(-lim, lim)
        return torch._grouped_mm(act, w_d, offs=offs)

    return run


def bf16_gemm_tflops(n: int = 8192) -> float:
    """The measured bf16 GEMM rate (torch.matmul, n x n x n, random data)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = torch_time_us(lambda: a @ b, iters=10)
    return 2 * n ** 3 / (us * 1e-6) / 1e12

"""The PyTorch peer for ``glm-ep bench``: a sparse site written the way HF transformers' eager
``glm5_next`` MoE runs it (fp32 router, sigmoid + bias top-k, a Python loop over the chosen
experts with bf16 weights, a bf16 shared expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm_ep.config.model import ModelConfig


def clamped_swiglu(g: torch.Tensor, u: torch.Tensor, lim: float) -> torch.Tensor:
    return F.silu(g.clamp(max=lim)) * u.clamp(-lim, lim)


class HfStyleMlp(nn.Module):
    """A bf16 dense site as ``Glm5NextTextMLP`` runs it."""

    def __init__(self, m: ModelConfig, width: int, device: str = "cuda"):
        super().__init__()
        h, bf = m.hidden_size, dict(dtype=torch.bfloat16, device=device)
        self.lim = m.swiglu_limit
        self.gate = nn.Parameter(torch.randn(width, h, **bf) * h ** -0.5, requires_grad=False)
        self.up = nn.Parameter(torch.randn(width, h, **bf) * h ** -0.5, requires_grad=False)
        self.down = nn.Parameter(torch.randn(h, width, **bf) * width ** -0.5, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(clamped_swiglu(F.linear(x, self.gate), F.linear(x, self.up), self.lim), self.down)


class HfStyleMoe(nn.Module):
    def __init__(self, m: ModelConfig, device: str = "cuda"):
        super().__init__()
        h, mi, e = m.hidden_size, m.moe_intermediate_size, m.n_routed_experts
        bf = dict(dtype=torch.bfloat16, device=device)
        self.cfg = m
        self.router = nn.Parameter(torch.randn(e, h, **bf) * h ** -0.5, requires_grad=False)
        self.bias = nn.Parameter(7.0 + 0.02 * torch.randn(e, device=device), requires_grad=False)
        self.gate_up = nn.Parameter(torch.randn(e, 2 * mi, h, **bf) * h ** -0.5, requires_grad=False)
        self.down = nn.Parameter(torch.randn(e, h, mi, **bf) * mi ** -0.5, requires_grad=False)
        s = m.shared_intermediate
        self.sh_gate = nn.Parameter(torch.randn(s, h, **bf) * h ** -0.5, requires_grad=False)
        self.sh_up = nn.Parameter(torch.randn(s, h, **bf) * h ** -0.5, requires_grad=False)
        self.sh_down = nn.Parameter(torch.randn(h, s, **bf) * s ** -0.5, requires_grad=False)

    def act(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(g, u, self.cfg.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.cfg
        scores = torch.sigmoid(F.linear(x.float(), self.router.float()))
        ids = torch.topk(scores + self.bias, m.num_experts_per_tok, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        if m.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * m.routed_scaling_factor
        out = torch.zeros_like(x, dtype=torch.float32)
        mask = F.one_hot(ids, m.n_routed_experts).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():  # the eager HF loop
            k, t = torch.where(mask[e[0]])
            g, u = F.linear(x[t], self.gate_up[e[0]]).chunk(2, dim=-1)
            y = F.linear(self.act(g, u), self.down[e[0]])
            out.index_add_(0, t, y.float() * w[t, k, None])
        shared = F.linear(self.act(F.linear(x, self.sh_gate), F.linear(x, self.sh_up)), self.sh_down)
        return (out + shared.float()).to(x.dtype)

"""Weight bytes each rank holds, from the config alone (what ``load_layer`` would read)."""

from __future__ import annotations

from glm_ep.config.model import NVFP4_GROUP, ModelConfig, RankLayout, SiteConfig
from glm_ep.config.topology import Topology


def nvfp4_bytes(n: int, k: int) -> int:
    return n * k // 2 + n * k // NVFP4_GROUP + 4  # packed nibbles, E4M3 block scales, scale_2


def rank_weight_bytes(model: ModelConfig, cfg: SiteConfig, router_itemsize: int = 2, dense_nvfp4: bool = False) -> int:
    """``dense_nvfp4``: the dense FFNs are stored NVFP4 (else bf16, as the shared experts are)."""
    h, m = model.hidden_size, cfg.moe_intermediate  # this rank's slice of each expert's width (moe_tp)
    expert = 2 * nvfp4_bytes(m, h) + nvfp4_bytes(h, m)
    total = 0
    for kind in model.mlp_layer_types:
        sparse = kind == "sparse"
        width = cfg.local_shared_intermediate if sparse else cfg.local_dense_intermediate
        if cfg.tp_active(sparse) and width:
            total += 3 * nvfp4_bytes(width, h) if dense_nvfp4 and not sparse else 3 * width * h * 2
        if sparse:
            total += model.n_routed_experts * (h * router_itemsize + 4)
            total += expert * cfg.local_experts if cfg.ep_active() else 0
    return total


def weight_bytes_per_rank(model: ModelConfig, topo: Topology, dense_nvfp4: bool = False,
                          router_itemsize: int = 2) -> list[int]:
    """``router_itemsize``: 4 where the checkpoint stores the router F32 (the runtime holds it as stored)."""
    return [rank_weight_bytes(model, SiteConfig.for_rank(model, RankLayout(topo.world, r, topo.tp, topo.ep,
                                                                           topo.moe_tp)),
                              router_itemsize, dense_nvfp4) for r in range(topo.world)]

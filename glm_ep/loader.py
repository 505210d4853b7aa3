"""Load one rank's share of a checkpoint into an ``MlpStack`` and report the footprints.

Each rank reads only what it owns (its experts, its TP slices). Rank 0 prints the per-rank
weight bytes and the workspace footprint, per workspace and for the stack, in decimal MB/GB.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm_ep.backend import make_backend, make_comm
from glm_ep.backend.base import Backend
from glm_ep.checkpoint import Checkpoint, load_layer
from glm_ep.comm import Communicator
from glm_ep.config import ModelConfig, RankLayout, SiteConfig
from glm_ep.experts import ExpertDispatch
from glm_ep.parallel import agree
from glm_ep.placement import discover
from glm_ep.site import DenseSite, MoeSite
from glm_ep.stack import MlpStack
from glm_ep.topology import Topology
from glm_ep.weights import MoeWeights
from glm_ep.workspace import fmt_bytes, footprint_lines

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """Everything one rank holds: the model config, its site geometry, backend, comm and stack."""

    model: ModelConfig
    cfg: SiteConfig
    topo: Topology
    be: Backend
    comm: Communicator
    stack: MlpStack
    weight_bytes: int


def site_config(model: ModelConfig, topo: Topology, rank: int) -> SiteConfig:
    return SiteConfig.for_rank(model, RankLayout(topo.world, rank, topo.tp, topo.ep))


def report_lines(model: ModelConfig, cfg: SiteConfig, topo: Topology, weight_bytes: list[int]) -> list[str]:
    lines = [f"model: {model.num_hidden_layers} layers ({len(model.dense_layers)} dense, "
             f"{len(model.sparse_layers)} sparse), hidden {model.hidden_size}, "
             f"{model.n_routed_experts} experts top-{model.num_experts_per_tok}; world {topo.world}, "
             f"tp {topo.tp}, ep {topo.ep}, backend {topo.backend}"]
    lines += [f"weights: rank {r} holds {fmt_bytes(b)}" for r, b in enumerate(weight_bytes)]
    lines += footprint_lines(cfg, topo.workspace_rows, model.num_hidden_layers, topo.shared_workspace)
    return lines


def load_runtime(model_dir: str | Path, topo: Topology, mpi_comm: Any) -> Runtime:
    rank = mpi_comm.Get_rank()
    # agreed, not raised bare: every rank sees the mismatch, and an unagreed error takes the
    # MPI-abort path, where the first rank to abort can kill the others before they report
    agree(mpi_comm, lambda: topo.check_world(mpi_comm.Get_size()))
    ckpt = agree(mpi_comm, lambda: Checkpoint(model_dir))
    model = ckpt.config
    cfg = agree(mpi_comm, lambda: site_config(model, topo, rank))
    placement = discover(mpi_comm)  # collective, and it cannot fail on one rank alone
    be = agree(mpi_comm, lambda: make_backend(topo, placement))
    comm = agree(mpi_comm, lambda: make_comm(mpi_comm, be, topo, placement))

    def read_all() -> list[Any]:
        big = model.n_routed_experts * model.hidden_size * model.moe_intermediate_size > 50e6
        return [load_layer(ckpt, cfg, i, progress=big and rank == 0)
                for i in range(model.num_hidden_layers)]

    host_weights = agree(mpi_comm, read_all)
    ckpt.close()
    weight_bytes = sum(w.nbytes for w in host_weights if w is not None)
    dispatch = ExpertDispatch(be, cfg, topo.levers)
    sites: list[Any] = []
    for w in host_weights:
        if isinstance(w, MoeWeights):
            sites.append(MoeSite(be, comm, cfg, be.upload_moe(w), dispatch))
        else:
            sites.append(DenseSite(be, comm, cfg, be.upload_dense(w) if w is not None else None))
    stack = MlpStack(be, comm, cfg, sites, topo.levers, topo.workspace_rows, topo.shared_workspace)
    all_bytes = mpi_comm.allgather(weight_bytes)
    if rank == 0:
        for line in report_lines(model, cfg, topo, all_bytes):
            log.info("%s", line)
    return Runtime(model, cfg, topo, be, comm, stack, weight_bytes)

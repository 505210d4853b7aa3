"""Open a checkpoint on every rank, then load one rank's share into an ``MlpStack``.

``open_checkpoint`` reads only headers and configs, and agrees across ranks that they opened the
same checkpoint with the same topology. ``load_runtime`` builds the backend and communicator,
allocates the workspace (checked against the free memory) and only then reads the weights, one
agreed layer at a time: each rank reads only what it owns (its experts, its TP slices), and a bad
tensor on any rank stops every rank at that layer. Rank 0 shows one progress bar over the bytes
it reads (its share, from the headers; each rank reads about as much), then logs the load time of
the slowest rank with the throughput, the per-rank weight bytes and the workspace footprint (per
workspace and for the stack, then the scratch made once for the stack), in decimal MB/GB.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from glm_ep.backend import make_backend, make_comm
from glm_ep.backend.base import Backend
from glm_ep.checkpoint.reader import Checkpoint
from glm_ep.checkpoint.layers import dense_is_nvfp4, expert_prefix, layer_read_bytes, load_layer
from glm_ep.dist.comm import Communicator
from glm_ep.config.model import ModelConfig, RankLayout, SiteConfig
from glm_ep.errors import ConfigError
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.dist.progress import progress
from glm_ep.mlp.expert_map import ExpertMap
from glm_ep.balance.eplb import ExpertPlacement, read as read_placement
from glm_ep.dist.ranks import Ranks
from glm_ep.dist.placement import discover
from glm_ep.mlp.site import DenseSite, MoeSite, Nvfp4DenseSite, site_buffers
from glm_ep.mlp.stack import MlpStack
from glm_ep.config.topology import Topology
from glm_ep.checkpoint.weights import ExpertWeights, MoeWeights
from glm_ep.mlp.workspace import Buffer, allocate_workspaces, fmt_bytes, footprint_lines, free_memory_bytes, merged

log = logging.getLogger(__name__)
PROGRESS_MIN_BYTES = 256e6  # smaller loads take a moment: no bar


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
    expert_placement: ExpertPlacement | None = None  # the topology's, loaded (None: the contiguous EP ranges)
    identity: str = ""  # the same on every rank of one load: its checkpoint, routers and layout, as a digest


def site_config(model: ModelConfig, topo: Topology, rank: int, placed: ExpertPlacement | None = None) -> SiteConfig:
    cfg = SiteConfig.for_rank(model, RankLayout(topo.world, rank, topo.tp, topo.ep, topo.moe_tp))
    return cfg.with_slots(placed.slots) if placed is not None else cfg


def expert_placement(model: ModelConfig, topo: Topology, ranks: Ranks) -> ExpertPlacement | None:
    """The topology's ``expert_placement``, read and checked on every rank, its digest agreed (None without one)."""
    if not topo.expert_placement:
        return None
    placed = ranks.agree("expert placement", lambda: read_placement(topo.expert_placement, model, topo.ep))
    ranks.check_same("expert placement", "expert placements", {"expert placement": placed.digest})
    return placed


def report_lines(model: ModelConfig, topo: Topology, weight_bytes: list[int], buffers: Iterable[Buffer]) -> list[str]:
    """The model, each rank's weight bytes, and the footprint of ``buffers`` (what this rank's sites and backend
    declared) at the topology's workspace rows and mode."""
    lines = [f"model: {model.num_hidden_layers} layers ({len(model.dense_layers)} dense, "
             f"{len(model.sparse_layers)} sparse), hidden {model.hidden_size}, "
             f"{model.n_routed_experts} experts top-{model.num_experts_per_tok}; world {topo.world}, "
             f"{topo.layout_text}, backend {topo.backend}"]
    lines += [f"weights: rank {r} holds {fmt_bytes(b)}" for r, b in enumerate(weight_bytes)]
    return lines + footprint_lines(buffers, topo.workspace_rows, model.num_hidden_layers, topo.shared_workspace)


def load_line(read_bytes: list[int], seconds: list[float]) -> str:
    """The load time (the slowest rank's) and the throughput of all ranks together."""
    slowest = max(seconds)
    rate = sum(read_bytes) / slowest if slowest > 0 else float("inf")
    return (f"load: {fmt_bytes(sum(read_bytes))} read by {len(seconds)} rank(s) in {slowest:.2f} s "
            f"(slowest rank), {fmt_bytes(rate)}/s")


def topology_values(topo: Topology) -> dict[str, str]:
    """Every topology value but its name (two files saying the same are one layout), by key (``levers.<key>`` for
    a lever): ranks that differ are told which keys, with each rank's value."""
    values = {}
    for f in dataclasses.fields(topo):
        if f.name == "name":
            continue
        v = getattr(topo, f.name)
        if dataclasses.is_dataclass(v):
            values.update({f"topology levers.{g.name}": repr(getattr(v, g.name)) for g in dataclasses.fields(v)})
        else:
            values[f"topology {f.name}"] = repr(v)
    return values


def router_digest(host_weights: list[Any]) -> dict[str, str]:
    """A digest of the router weights and correction biases of every sparse layer: the tensors every rank reads
    whole (the experts and the dense FFNs are sharded), so ranks that opened different checkpoints of the same
    shapes (each node its own copy) differ here."""
    routed = [w for w in host_weights if isinstance(w, MoeWeights)]
    h = hashlib.blake2b(digest_size=16)
    for w in routed:
        for a in (w.router, w.bias):
            h.update(np.ascontiguousarray(a).view(np.uint8).data)
    return {"router weights and biases": h.hexdigest()} if routed else {}


def _opened(model_dir: str | Path, check_weights: bool) -> Checkpoint:
    ckpt = Checkpoint(model_dir, check_finite=check_weights)
    ckpt.check_extent()  # the layers and experts config.json declares are there, from the keys alone
    return ckpt


def open_checkpoint(model_dir: str | Path, topo: Topology, ranks: Ranks) -> Checkpoint:
    """The checkpoint's config and headers, opened on every rank; refused unless every rank opened
    the same checkpoint (config, index, shard headers) under the same topology."""
    # agreed, not raised bare: every rank sees the mismatch, and an unagreed error takes the
    # MPI-abort path, where the first rank to abort can kill the others before they report
    ranks.agree("world size check", lambda: topo.check_world(ranks.size))
    ckpt = ranks.agree("checkpoint open", lambda: _opened(model_dir, topo.check_weights))
    ranks.check_same("checkpoint fingerprint", "checkpoints or layouts",
                     dict(ckpt.fingerprint, **topology_values(topo)))
    return ckpt


def load_runtime(ckpt: Checkpoint, topo: Topology, ranks: Ranks) -> Runtime:
    """This rank's share of ``ckpt`` resident on its backend, as an ``MlpStack``; closes ``ckpt``."""
    rank, model = ranks.rank, ckpt.config
    placed = expert_placement(model, topo, ranks)
    cfg = ranks.agree("site geometry", lambda: site_config(model, topo, rank, placed))
    slots_cfg = cfg.physical()  # what the dispatch and its workspace count: physical expert slots
    with ranks.guard("placement discovery"):
        placement = discover(ranks.comm)  # collective, and it cannot fail on one rank alone
    be = ranks.agree("backend", lambda: make_backend(topo, placement, slots_cfg))
    comm = ranks.agree("communicator", lambda: make_comm(ranks.comm, be, topo, placement, ranks.deadline))
    # ranks that allocate from the same memory (one host's on NumPy, one GPU's on CUDA) each take a share of what
    # was free before any of them allocated
    domain, free = (placement.node, getattr(be, "pci_bus_id", "host")), free_memory_bytes(be.xp)
    sharers = [d for d, _ in ranks.allgather("free memory", (domain, free))].count(domain)
    # what the sites and the backend declare, made once: a dense FFN stored NVFP4 (its headers say) that this rank
    # holds adds its dequant path's scratch
    nvfp4_dense = cfg.tp_active(False) and any(dense_is_nvfp4(ckpt, i) for i in model.dense_layers)
    # (sized for the physical expert slots the dispatch counts: the experts themselves without a placement)
    buffers = merged((*site_buffers(slots_cfg, topo.levers, nvfp4_dense), *be.buffers(slots_cfg, topo.levers)))
    workspaces = ranks.agree("workspace allocation", lambda: allocate_workspaces(
        be, buffers, topo.workspace_rows, model.num_hidden_layers, topo.shared_workspace, free, sharers))

    def held(i: int) -> list[int] | None:  # the experts a placement gives this rank at sparse layer i
        return placed.held(i, cfg.ep_rank) if placed is not None and i in placed.layers else None

    to_read = sum(layer_read_bytes(ckpt, cfg, i, held(i)) for i in range(model.num_hidden_layers))
    static_input_scales = "sparse" in model.mlp_layer_types and ckpt.has(
        f"{expert_prefix(ckpt, model.mlp_layer_types.index('sparse'), 0)}.gate_proj.input_scale")
    t0 = time.perf_counter()
    with ckpt, progress(to_read, "loading weights", unit="B", enabled=rank == 0 and to_read >= PROGRESS_MIN_BYTES,
                        log=log, unit_scale=True) as bar:
        ckpt.on_read = bar.update
        host_weights = [ranks.agree(f"load of layer {i}", lambda i=i: load_layer(ckpt, cfg, i, held(i)))
                        for i in range(model.num_hidden_layers)]
        ckpt.on_read = None
    routers = router_digest(host_weights)
    ranks.check_same("weight fingerprint", "checkpoints", routers)
    identity = hashlib.sha256(repr((sorted(ckpt.fingerprint.items()), sorted(routers.items()),
                                    sorted(topology_values(topo).items()))).encode()).hexdigest()
    load_s = time.perf_counter() - t0
    weight_bytes = sum(w.nbytes for w in host_weights if w is not None)
    dispatch = ExpertDispatch.routed(be, slots_cfg, topo.levers)  # ids are physical expert slots
    dense_nvfp4 = ExpertDispatch.nvfp4_dense(be, cfg, topo.levers)  # a dense FFN stored NVFP4: one expert

    def site(i: int, w: Any) -> Any:
        site_comm = comm.at(f"layer {i} all-reduce")
        if isinstance(w, MoeWeights):
            mapped = ExpertMap.upload(be, placed.phys_expert[placed.layers.index(i)], cfg.num_experts) if placed else None
            return MoeSite(be, site_comm, cfg, be.upload_moe(w, cfg.swiglu_limit), dispatch, mapped)
        if isinstance(w, ExpertWeights):
            mlp = be.upload_experts((w,), 0, cfg.swiglu_limit, what=f"layer {i} dense mlp")
            return Nvfp4DenseSite(be, site_comm, cfg, mlp, dense_nvfp4)
        return DenseSite(be, site_comm, cfg, be.upload_dense(w) if w is not None else None)

    def upload() -> list[Any]:  # agreed: a rank that cannot place its weights stops every rank, not only itself
        sites = []
        for i, w in enumerate(host_weights):
            try:
                sites.append(site(i, w))
            except MemoryError as e:
                raise ConfigError(f"layer {i}: this rank's weights do not fit its device's memory ({e}); spread "
                                  "the experts and the dense FFNs over more ranks (ep, tp) or free the device") from None
        return sites

    sites = ranks.agree("weight upload", upload)
    stack = MlpStack(be, comm, slots_cfg, sites, topo.levers, topo.workspace_rows, topo.shared_workspace, workspaces)
    every = ranks.allgather("weight report", (weight_bytes, to_read, load_s))
    if rank == 0:
        log.info("%s", load_line([b for _, b, _ in every], [t for _, _, t in every]))
        for line in ckpt.unused:
            log.warning("%s", line)
        if static_input_scales:
            log.info("the checkpoint's NVFP4 projections carry static input scales (a W4A4 export): they are not "
                     "used; activations stay bf16 (W4A16), so outputs differ from a W4A4 engine's by its "
                     "activation rounding")
        for line in report_lines(model, topo, [b for b, _, _ in every], buffers):
            log.info("%s", line)
        if placed is not None:
            log.info("expert placement: %s (%d slots over ep = %d, %d redundant; digest %s)", topo.expert_placement,
                     placed.slots, placed.ep, placed.redundant, placed.digest)
    return Runtime(model, cfg, topo, be, comm, stack, weight_bytes, placed, identity)

"""Balance on the CUDA backend against NumPy: expert tensor parallelism (``moe_tp``) and a placement's id map.

* the id map kernel (``expert_map.cu``) equals ``glm_ep.mlp.expert_map.map_ids`` exactly, in place too;
* a stack with a placement of replicas (more expert slots than experts, ids mapped on the device right after
  routing) on every path, the one-row step captured and replayed, equals NumPy with the same placement within bf16
  rounding;
* ranks sharing ONE GPU through the host-staged MPI communicator at world 2 (tp 2, moe_tp 2) and world 4 (tp 2,
  ep 2 x moe_tp 2): each rank's slice of every expert, the partial sums in the one all-reduce, equal to NumPy ranks
  on the same shards (``mpiexec -n 2`` / ``-n 4 python -m pytest -m "cuda and mpi" tests/cuda/test_cuda_balance.py``).

The model is ``test_cuda_paths``' (integer router inputs, spaced biases: both backends choose the same experts),
its expert width 128 split into two slices of 64, the grouped GEMM's stage of k.
"""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.balance.eplb import balanced_placement
from glm_ep.config.model import RankLayout, SiteConfig
from glm_ep.config.topology import PathLevers, Topology
from glm_ep.dist.comm import MpiComm, SelfComm
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.mlp.expert_map import ExpertMap, map_ids, replica_table
from glm_ep.mlp.site import DenseSite, MoeSite
from glm_ep.mlp.stack import MlpStack
from glm_ep.checkpoint.weights import MoeWeights

import test_cuda_paths as T
from _cuda import backend, dev, host, requires_cuda
from helpers import assert_close, shard_layer

pytestmark = [pytest.mark.cuda, requires_cuda]


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_the_id_map_kernel_is_the_numpy_rule(rows: int) -> None:
    rng = np.random.default_rng(rows)
    phys = np.concatenate([np.arange(T.E), rng.integers(0, T.E, 12)])  # 12 replicas, some experts thrice
    table, nrep = replica_table(phys, T.E)
    ids = np.stack([rng.choice(T.E, T.TOP_K, replace=False) for _ in range(rows)]).astype(np.int32)
    want = map_ids(ids, table, nrep)
    be = backend()
    got = dev(np.full_like(ids, -7))
    be.map_expert_ids(dev(ids), dev(table), dev(nrep), got)
    np.testing.assert_array_equal(host(got), want)
    inplace = dev(ids)
    be.map_expert_ids(inplace, dev(table), dev(nrep), inplace)
    np.testing.assert_array_equal(host(inplace), want)


def _placed_stack(be, cfg: SiteConfig, weights, placed, levers: PathLevers, comm=None):
    """``test_cuda_paths.build_stack`` with each sparse layer's experts in the placement's slots and its map."""
    comm = comm or SelfComm()
    slots = cfg.physical()
    sites = []
    for i, w in enumerate(weights):
        if not isinstance(w, MoeWeights):
            sites.append(DenseSite(be, comm, cfg, be.upload_dense(w)))
            continue
        phys = placed.phys_expert[placed.layers.index(i)]
        held = tuple(w.experts[e] for e in phys[cfg.expert_start:cfg.expert_start + cfg.local_experts])
        mine = MoeWeights(w.router, w.bias, cfg.expert_start, held, w.shared)
        sites.append(MoeSite(be, comm, cfg, be.upload_moe(mine, cfg.swiglu_limit), ExpertDispatch.routed(be, slots, levers),
                             ExpertMap.upload(be, phys, cfg.num_experts)))
    return MlpStack(be, comm, slots, sites, levers, T.MAX_ROWS)


@pytest.mark.parametrize("rows", [1, 4, 20, 300])
def test_a_placement_with_replicas_matches_numpy(rows: int) -> None:
    layer_types = ("dense", "sparse")
    weights = T.full_weights(3, layer_types)
    load = np.random.default_rng(0).zipf(1.5, (1, T.E)).clip(max=200)
    placed = balanced_placement(load, (1,), ep=1, redundant=8)  # 40 slots on one rank: every replica local
    cfg = SiteConfig.for_rank(T.model(layer_types), RankLayout(1, 0, 1, 1)).with_slots(placed.slots)
    levers = PathLevers(prefill_gemm_min_rows=24)
    cuda = _placed_stack(backend(), cfg, weights, placed, levers)
    ref = _placed_stack(NumpyBackend(), cfg, weights, placed, levers)
    rng = np.random.default_rng(rows)
    for step in range(3 if rows <= 8 else 1):  # 1..8 rows: captured on the first step, replayed after
        x = T.int_rows(rng, rows)
        assert_close(host(cuda.step(dev(x))), np.array(ref.step(x), copy=True), f"{rows} rows, step {step}")
    assert (rows in cuda._graphs) == (rows <= 8)


LAYOUTS = [(2, 2, 1, 2), (4, 2, 2, 2)]  # world, tp, ep, moe_tp


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("world,tp,ep,moe_tp", LAYOUTS, ids=["w2-moetp2", "w4-ep2-moetp2"])
def test_moe_tp_ranks_on_one_gpu_match_numpy_ranks(world, tp, ep, moe_tp) -> None:
    from mpi4py import MPI

    from glm_ep.backend import make_comm
    from glm_ep.dist.placement import discover

    comm_world = MPI.COMM_WORLD
    if comm_world.Get_size() != world:
        pytest.skip(f"run under mpiexec -n {world}")
    rank = comm_world.Get_rank()
    layer_types = ("dense", "sparse")
    layout = RankLayout(world, rank, tp, ep, moe_tp)
    cfg = SiteConfig.for_rank(T.model(layer_types), layout)
    mine = [shard_layer(w, layout) for w in T.full_weights(5, layer_types)]
    be = backend()
    comm = make_comm(comm_world, be, Topology(world=world, tp=tp, ep=ep, moe_tp=moe_tp, backend="cuda"),
                     discover(comm_world))
    failures = [] if isinstance(comm, MpiComm) else [f"rank {rank}: {type(comm).__name__}, expected MpiComm"]
    failures += [] if cfg.moe_intermediate == T.M // moe_tp else [f"rank {rank}: width {cfg.moe_intermediate}"]
    every = sum(comm_world.allgather(failures), [])
    if every:
        pytest.fail("\n".join(every))
    levers = PathLevers(prefill_gemm_min_rows=24)
    cuda = T.build_stack(be, comm, cfg, mine, levers, max_rows=300)
    ref = T.build_stack(NumpyBackend(), MpiComm(comm_world), cfg, mine, levers, max_rows=300)
    # decode ring, union, row groups, grouped GEMM
    failures += T.site_mismatches(cuda, ref, (1, 4, 20, 300), f"rank {rank}")
    failures = sum(comm_world.allgather(failures), [])
    assert not failures, "\n".join(failures)

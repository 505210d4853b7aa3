"""Multi-rank NumPy stacks against the one-rank result, in one MPI job.

    mpiexec -n 2 python -m pytest --with-mpi -m mpi tests/test_mpi.py

Every rank computes its checks, the ranks exchange their failure messages, and every rank
asserts on all of them: a failure on one rank never leaves the other waiting in a collective.
"""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.comm import MpiComm
from glm_ep.config import RankLayout, SiteConfig
from glm_ep.footprint import rank_weight_bytes
from glm_ep.nvfp4 import quantize
from glm_ep.topology import PathLevers
from glm_ep.weights import ExpertWeights, MoeWeights

from helpers import (BF16, RefParams, agreed, bf16_ulps, build_stack, random_weights, random_x, ref64_layers, rel_l2,
                     route_margins64, tiny_model)

pytestmark = pytest.mark.mpi(min_size=2)


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def same_on_all_ranks(comm, name: str, a: np.ndarray, failures: list[str]) -> None:
    blobs = comm.allgather(np.ascontiguousarray(a).tobytes())
    if any(b != blobs[0] for b in blobs):
        failures.append(f"{name} differs between ranks")


def test_all_reduce_is_the_rank_order_bf16_sum_on_every_rank() -> None:
    comm = _world()
    rank, size = comm.Get_rank(), comm.Get_size()
    parts = [(np.random.default_rng((3, r)).standard_normal((7, 33)) * 4).astype(BF16) for r in range(size)]
    parts[0][0, :4] = [1.0, 256.0, -3.0, 0.0]
    parts[1][0, :4] = [2.0 ** -8, 1.0, 3.0, -0.0]
    expected = parts[0].astype(np.float32)
    for p in parts[1:]:  # ((p0 + p1) + p2) ..., each addition rounded to bf16
        expected = (expected + p.astype(np.float32)).astype(BF16).astype(np.float32)
    buf = parts[rank].copy()
    out = MpiComm(comm).all_reduce(buf)
    failures: list[str] = []
    if out is not buf:
        failures.append("all_reduce did not reduce in place")
    if not np.array_equal(buf.view(np.uint16), expected.astype(BF16).view(np.uint16)):
        failures.append(f"sum differs from the rank-order bf16 sum at {np.argwhere(buf != expected)[:3].tolist()}")
    # bf16 keeps 8 bits: 1 + 2^-8 and 256 + 1 are ties that round to even (1 and 256)
    if size == 2 and buf[0, :3].astype(np.float32).tolist() != [1.0, 256.0, 0.0]:
        failures.append(f"hand values: {buf[0, :3].tolist()}")
    same_on_all_ranks(comm, "all-reduce result", buf, failures)
    agreed(comm, failures)


@pytest.fixture(scope="module")
def weights():
    model = tiny_model()
    return model, random_weights(model, seed=17, bias_spread=0.05)


CASES = [(1, PathLevers()), (5, PathLevers()), (300, PathLevers()), (300, PathLevers(prefill_gemm=False))]


@pytest.mark.parametrize("tp,ep", [(2, 2), (1, 2), (2, 1)], ids=["tp2-ep2", "tp1-ep2", "tp2-ep1"])
@pytest.mark.parametrize("rows,levers", CASES, ids=["decode", "verify", "sorted", "row-groups"])
def test_multi_rank_sites_equal_the_one_rank_sites(weights, tp: int, ep: int, rows: int, levers) -> None:
    comm = _world()
    model, full = weights
    layout = RankLayout(comm.Get_size(), comm.Get_rank(), tp, ep)
    single = build_stack(full, model, levers=levers, max_rows=rows)
    multi = build_stack(full, model, layout, MpiComm(comm), levers=levers, max_rows=rows)
    x = random_x(1000 + rows, rows, model.hidden_size)
    failures: list[str] = []
    if multi.sites[1].experts.path_for(rows) != single.sites[1].experts.path_for(rows):
        failures.append("the two stacks chose different paths")
    for i in range(len(full)):
        y1 = single.site_output(i, x).copy()
        y2 = multi.site_output(i, x).copy()  # collective: every rank calls every site in order
        err = rel_l2(y2, y1)
        if not err < 1e-2:
            failures.append(f"site {i}: rel L2 {err:.3e} vs one rank")
        scale = float(np.sqrt(np.mean(y1.astype(np.float64) ** 2)))
        if not np.allclose(y2.astype(np.float64), y1.astype(np.float64), rtol=2 ** -6, atol=2e-2 * scale):
            failures.append(f"site {i}: not elementwise close to one rank")
        same_on_all_ranks(comm, f"site {i} output", y2, failures)
        if i in model.sparse_layers:
            ids1 = single.workspaces[i].view("ids", rows, model.num_experts_per_tok)
            ids2 = multi.workspaces[i].view("ids", rows, model.num_experts_per_tok).copy()
            same_on_all_ranks(comm, f"site {i} expert ids", ids2, failures)
            if not np.array_equal(ids1, ids2):
                failures.append(f"site {i}: expert ids differ from one rank")
    agreed(comm, failures)


def _zero_experts(w: MoeWeights, h: int, m: int) -> MoeWeights:
    zg, zd = quantize(np.zeros((m, h), np.float32)), quantize(np.zeros((h, m), np.float32))
    return MoeWeights(w.router, w.bias, 0, (ExpertWeights(zg, zg, zd),) * len(w.experts), w.shared)


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 1), (2, 2)])
def test_each_piece_is_counted_once(weights, tp: int, ep: int) -> None:
    """Pieces that are whole on one rank give the one-rank bytes exactly (a double count is 2x)."""
    comm = _world()
    model, full = weights
    h, m = model.hidden_size, model.moe_intermediate_size
    layout = RankLayout(comm.Get_size(), comm.Get_rank(), tp, ep)
    x = random_x(77, 6, h)
    failures: list[str] = []
    shared_only = [full[0], _zero_experts(full[1], h, m)]
    routed_only = [full[0], MoeWeights(full[1].router, full[1].bias, 0, full[1].experts, None)]
    model0 = tiny_model(num_hidden_layers=2, mlp_layer_types=["dense", "sparse"], n_shared_experts=0)
    model2 = tiny_model(num_hidden_layers=2, mlp_layer_types=["dense", "sparse"])
    for name, mdl, layers in (("shared expert", model2, shared_only), ("routed experts", model0, routed_only)):
        single = build_stack(layers, mdl, max_rows=8)
        multi = build_stack(layers, mdl, layout, MpiComm(comm), max_rows=8)
        for i, kind in enumerate(("dense FFN", name)):
            y1, y2 = single.site_output(i, x).copy(), multi.site_output(i, x).copy()
            whole = (kind == "dense FFN" and tp == 1) or (kind == "shared expert" and tp == 1) or (
                kind == "routed experts" and ep == 1)
            if whole and bf16_ulps(y2, y1).max() != 0:
                failures.append(f"{kind} at tp={tp} ep={ep}: not the one-rank bytes (rel L2 {rel_l2(y2, y1):.3e})")
            if not rel_l2(y2, y1) < 1e-2:
                failures.append(f"{kind} at tp={tp} ep={ep}: rel L2 {rel_l2(y2, y1):.3e}")
    agreed(comm, failures)


def test_chained_step_is_identical_on_every_rank_and_close_to_one_rank() -> None:
    comm = _world()
    model = tiny_model()
    full = random_weights(model, seed=9, out_gain=0.04, bias_spread=0.3)
    pool = random_x(400, 64, model.hidden_size)
    x = pool[route_margins64(ref64_layers(full), RefParams.of(model), pool) > 0.01][:12]
    failures: list[str] = []
    for tp, ep in ((2, 2), (1, 2), (2, 1)):
        layout = RankLayout(comm.Get_size(), comm.Get_rank(), tp, ep)
        multi = build_stack(full, model, layout, MpiComm(comm), max_rows=16)
        for rows in (1, 12):
            y2 = multi.step(x[:rows]).copy()
            y1 = build_stack(full, model, max_rows=16).step(x[:rows]).copy()
            same_on_all_ranks(comm, f"step tp={tp} ep={ep} rows={rows}", y2, failures)
            if not rel_l2(y2, y1) < 1e-2:
                failures.append(f"step tp={tp} ep={ep} rows={rows}: rel L2 {rel_l2(y2, y1):.3e}")
    agreed(comm, failures)


def test_nvfp4_dense_site_split_over_tp_matches_one_rank() -> None:
    """A dense FFN stored NVFP4, its down projection split by columns on block boundaries: the tp = 2
    partial sums, all-reduced, equal the one-rank site (and the multi-rank stack holds the same bits on
    every rank)."""
    comm = _world()
    model = tiny_model()
    full = random_weights(model, seed=21, dense_nvfp4=True)
    layer = model.mlp_layer_types.index("dense")
    world = comm.Get_size()
    failures: list[str] = []
    # 12 rows on the grouped GEMM, then with its projections dequantized to bf16 (each rank its own TP slices)
    for levers in (PathLevers(), PathLevers(nvfp4_dense_dequant_min_rows=12)):
        multi = build_stack(full, model, RankLayout(world, comm.Get_rank(), world, 1), MpiComm(comm), max_rows=16,
                            levers=levers)
        single = build_stack(full, model, max_rows=16)
        for rows in (1, 5, 12):
            x = random_x(70 + rows, rows, model.hidden_size)
            path = multi.sites[layer].nvfp4.path_for(rows)
            want = "dequant" if rows == 12 and levers.nvfp4_dense_dequant_min_rows == 12 else path
            if path != want:
                failures.append(f"dense nvfp4 site, {rows} rows: path {path}, expected {want}")
            y2, y1 = multi.site_output(layer, x).copy(), single.site_output(layer, x).copy()
            same_on_all_ranks(comm, f"dense nvfp4 site, {rows} rows ({path})", y2, failures)
            if not rel_l2(y2, y1) < 1e-2:
                failures.append(f"dense nvfp4 site, {rows} rows ({path}): rel L2 {rel_l2(y2, y1):.3e} vs one rank")
    agreed(comm, failures)


@pytest.mark.parametrize("dense", ["bf16", "nvfp4"])
@pytest.mark.parametrize("tp,ep", [(2, 2), (1, 2), (2, 1)], ids=["tp2-ep2", "tp1-ep2", "tp2-ep1"])
def test_loaded_runtime_matches_one_rank(request, tp: int, ep: int, dense: str) -> None:
    """The same through the product's loader: each rank reads only its share of the checkpoint. With the dense
    FFNs stored NVFP4 on their dequant path (9 rows), whose scratch every rank agrees on at load, also a rank that
    holds no dense FFN (tp = 1 of 2 ranks)."""
    from mpi4py import MPI

    from glm_ep.loader import load_runtime, open_checkpoint
    from glm_ep.parallel import Ranks
    from glm_ep.topology import Topology

    comm = _world()
    ckpt = request.getfixturevalue("tiny_checkpoint" if dense == "bf16" else "tiny_checkpoint_dense_nvfp4")
    levers = PathLevers(nvfp4_dense_dequant_min_rows=9)

    def load(topo: Topology, ranks: Ranks):
        return load_runtime(open_checkpoint(ckpt, topo, ranks), topo, ranks)

    single = load(Topology(world=1, levers=levers), Ranks(MPI.COMM_SELF))
    multi = load(Topology(world=comm.Get_size(), tp=tp, ep=ep, workspace_rows=16, levers=levers), Ranks(comm))
    x = random_x(55, 9, single.model.hidden_size)
    failures: list[str] = []
    bytes_each = comm.allgather(multi.weight_bytes)
    if not sum(bytes_each) < comm.Get_size() * single.weight_bytes:
        failures.append(f"ranks hold {bytes_each} bytes, one rank holds {single.weight_bytes}: nothing was split")
    mine = SiteConfig.for_rank(single.model, RankLayout(comm.Get_size(), comm.Get_rank(), tp, ep))
    for what, got, cfg in (("this rank", multi.weight_bytes, mine), ("one rank", single.weight_bytes, single.cfg)):
        # what the config says a rank of that layout holds
        want = rank_weight_bytes(single.model, cfg, dense_nvfp4=dense == "nvfp4")
        if got != want:
            failures.append(f"{what} holds {got} weight bytes, the footprint says {want}")
    for i in range(single.model.num_hidden_layers):
        y1 = single.stack.site_output(i, x).copy()
        y2 = multi.stack.site_output(i, x).copy()
        same_on_all_ranks(comm, f"site {i}", y2, failures)
        if not rel_l2(y2, y1) < 1e-2:
            failures.append(f"site {i}: rel L2 {rel_l2(y2, y1):.3e} vs one rank")
    agreed(comm, failures)

"""Multi-rank NumPy stacks against the one-rank result, in one MPI job.

    mpiexec -n 2 python -m pytest --with-mpi -m mpi -o timeout=120 -o timeout_method=thread tests/mpi/test_mpi.py

Every rank computes its checks, the ranks exchange their failure messages, and every rank
asserts on all of them: a failure on one rank never leaves the other waiting in a collective.
An exception on one rank is caught (``Job.attempt``) and agreed before the next collective, so it
fails the test on every rank. The tests' own gathers run on a duplicate of the world communicator,
so they never pair with the runtime's all-reduces; every wait on the other ranks (both kinds) is
bounded by a deadline far below pytest's timeout, so a rank that stops before its collective ends
the job, with this rank's failures printed, instead of leaving the next tests' collectives to pair
up with the wrong partners.
"""

from __future__ import annotations

import sys
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import pytest

from glm_ep.dist.comm import MpiComm
from glm_ep.config.model import RankLayout, SiteConfig
from glm_ep.dist.deadline import Deadline
from glm_ep.app.footprint import rank_weight_bytes
from glm_ep.checkpoint.nvfp4 import quantize
from glm_ep.config.topology import PathLevers
from glm_ep.checkpoint.weights import ExpertWeights, MoeWeights

from helpers import (BF16, RefParams, agreed, bf16_ulps, build_stack, elementwise_close, random_weights, random_x,
                     ref64_layers, rel_l2, route_margins64, tiny_model)

pytestmark = pytest.mark.mpi(min_size=2)

#: bound on every wait on the other ranks: far below the MPI runs' pytest timeout (120 s)
COLLECTIVE_TIMEOUT_S = 30.0


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@dataclass
class World:
    """What the module's tests share: the world communicator (the runtime's collectives), a duplicate of it (the
    tests' own gathers) and one deadline bounding the waits on both; ``current`` is the running test's Job."""

    comm: Any
    checks: Any
    deadline: Deadline
    current: list["Job"] = field(default_factory=list)


@pytest.fixture(scope="module")
def world(request) -> World:
    comm = _world()
    w = World(comm, comm.Dup(), Deadline(comm.Get_rank(), comm.Get_size(), COLLECTIVE_TIMEOUT_S, comm.Abort))
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def report() -> None:  # the deadline's expiry: pytest's capture would lose what the abort cuts short
        job = w.current[-1] if w.current else None
        what = f"{job.name}: {job.failures or 'no failures yet'}" if job else "no test running"
        with capture.global_and_fixture_disabled() if capture else nullcontext():
            print(f"[rank {comm.Get_rank()}] test_mpi: a wait on the other ranks outlived {COLLECTIVE_TIMEOUT_S:g} s "
                  f"in {what}", file=sys.stderr, flush=True)

    w.deadline.on_expiry(report)
    return w  # the duplicate lives as long as the job: freeing it is a collective of its own


class Job:
    """One test's view of the MPI job: its failures, and the deadline that bounds each of its waits on the other
    ranks (the MpiComm's all-reduces and the test's own gathers)."""

    def __init__(self, world: World, name: str):
        self.comm, self.deadline, self.name = world.comm, world.deadline, name
        self._checks = world.checks
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.failures: list[str] = []

    def mpi_comm(self) -> MpiComm:
        return MpiComm(self.comm, deadline=self.deadline)

    def allgather(self, what: str, value: Any) -> list[Any]:
        with self.deadline.guard(f"test: {what}"):
            return self._checks.allgather(value)

    @contextmanager
    def attempt(self, what: str) -> Iterator[None]:
        """Run the block; an exception in it is this rank's failure. Then, before any further collective, the
        ranks agree whether any of them raised: if one did, the test fails on every rank (with every rank's
        failures so far). A rank that raised before a collective of the block leaves the others waiting in it:
        the deadline then ends the job (``world``'s report names the failure)."""
        raised = None
        try:
            yield
        except Exception as e:  # noqa: BLE001 - agreed below, so the other ranks fail too instead of waiting
            where = traceback.extract_tb(e.__traceback__)[-1]
            raised = f"{what}: {type(e).__name__}: {e} (at {where.filename}:{where.lineno})"
            self.failures.append(raised)
        if any(r is not None for r in self.allgather(f"did '{what}' raise", raised)):
            self.agree()  # fails: some rank's failures hold its exception

    def same_on_all_ranks(self, name: str, a: np.ndarray) -> None:
        blobs = self.allgather(f"{name} bytes", np.ascontiguousarray(a).tobytes())
        if any(b != blobs[0] for b in blobs):
            self.failures.append(f"{name} differs between ranks")

    def agree(self) -> None:
        """Assert on every rank that no rank failed."""
        with self.deadline.guard("test: agreeing the failures"):
            agreed(self._checks, self.failures)


@pytest.fixture
def job(world: World, request) -> Iterator[Job]:
    world.current.append(Job(world, request.node.nodeid))
    yield world.current[-1]
    world.current.pop()


def test_all_reduce_is_the_rank_order_bf16_sum_on_every_rank(job: Job) -> None:
    rank, size = job.rank, job.size
    parts = [(np.random.default_rng((3, r)).standard_normal((7, 33)) * 4).astype(BF16) for r in range(size)]
    parts[0][0, :4] = [1.0, 256.0, -3.0, 0.0]
    parts[1][0, :4] = [2.0 ** -8, 1.0, 3.0, -0.0]
    expected = parts[0].astype(np.float32)
    for p in parts[1:]:  # ((p0 + p1) + p2) ..., each addition rounded to bf16
        expected = (expected + p.astype(np.float32)).astype(BF16).astype(np.float32)
    buf = parts[rank].copy()
    with job.attempt("all_reduce"):
        out = job.mpi_comm().all_reduce(buf)
    if out is not buf:
        job.failures.append("all_reduce did not reduce in place")
    if not np.array_equal(buf.view(np.uint16), expected.astype(BF16).view(np.uint16)):
        job.failures.append(f"sum differs from the rank-order bf16 sum at {np.argwhere(buf != expected)[:3].tolist()}")
    # bf16 keeps 8 bits: 1 + 2^-8 and 256 + 1 are ties that round to even (1 and 256)
    if size == 2 and buf[0, :3].astype(np.float32).tolist() != [1.0, 256.0, 0.0]:
        job.failures.append(f"hand values: {buf[0, :3].tolist()}")
    job.same_on_all_ranks("all-reduce result", buf)
    job.agree()


@pytest.fixture(scope="module")
def weights():
    model = tiny_model()
    return model, random_weights(model, seed=17, bias_spread=0.05)


CASES = [(1, PathLevers()), (5, PathLevers()), (300, PathLevers()), (300, PathLevers(prefill_gemm=False))]


@pytest.mark.parametrize("tp,ep", [(2, 2), (1, 2), (2, 1)], ids=["tp2-ep2", "tp1-ep2", "tp2-ep1"])
@pytest.mark.parametrize("rows,levers", CASES, ids=["decode", "verify", "sorted", "row-groups"])
def test_multi_rank_sites_equal_the_one_rank_sites(job: Job, weights, tp: int, ep: int, rows: int, levers) -> None:
    model, full = weights
    x = random_x(1000 + rows, rows, model.hidden_size)
    with job.attempt("the stacks and the one-rank sites"):  # no collective: one rank's error fails every rank here
        layout = RankLayout(job.size, job.rank, tp, ep)
        single = build_stack(full, model, levers=levers, max_rows=rows)
        multi = build_stack(full, model, layout, job.mpi_comm(), levers=levers, max_rows=rows)
        ys1, ids1 = [], {}
        for i in range(len(full)):
            ys1.append(single.site_output(i, x).copy())
            if i in model.sparse_layers:
                ids1[i] = single.workspaces[i].view("ids", rows, model.num_experts_per_tok).copy()
        if multi.sites[1].experts.path_for(rows) != single.sites[1].experts.path_for(rows):
            job.failures.append("the two stacks chose different paths")
    for i, y1 in enumerate(ys1):
        with job.attempt(f"site {i} on {job.size} ranks"):
            y2 = multi.site_output(i, x).copy()  # collective: every rank calls every site in order
            ids2 = multi.workspaces[i].view("ids", rows, model.num_experts_per_tok).copy() if i in ids1 else None
        err = rel_l2(y2, y1)
        if not err < 1e-2:
            job.failures.append(f"site {i}: rel L2 {err:.3e} vs one rank")
        if not elementwise_close(y2, y1):
            job.failures.append(f"site {i}: not elementwise close to one rank")
        job.same_on_all_ranks(f"site {i} output", y2)
        if ids2 is not None:
            job.same_on_all_ranks(f"site {i} expert ids", ids2)
            if not np.array_equal(ids1[i], ids2):
                job.failures.append(f"site {i}: expert ids differ from one rank")
    job.agree()


def _zero_experts(w: MoeWeights, h: int, m: int) -> MoeWeights:
    zg, zd = quantize(np.zeros((m, h), np.float32)), quantize(np.zeros((h, m), np.float32))
    return MoeWeights(w.router, w.bias, 0, (ExpertWeights(zg, zg, zd),) * len(w.experts), w.shared)


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 1), (2, 2)])
def test_each_piece_is_counted_once(job: Job, weights, tp: int, ep: int) -> None:
    """Pieces that are whole on one rank give the one-rank bytes exactly (a double count is 2x)."""
    model, full = weights
    h, m = model.hidden_size, model.moe_intermediate_size
    x = random_x(77, 6, h)
    with job.attempt("the weights"):
        layout = RankLayout(job.size, job.rank, tp, ep)
        shared_only = [full[0], _zero_experts(full[1], h, m)]
        routed_only = [full[0], MoeWeights(full[1].router, full[1].bias, 0, full[1].experts, None)]
        model0 = tiny_model(num_hidden_layers=2, mlp_layer_types=["dense", "sparse"], n_shared_experts=0)
        model2 = tiny_model(num_hidden_layers=2, mlp_layer_types=["dense", "sparse"])
    for name, mdl, layers in (("shared expert", model2, shared_only), ("routed experts", model0, routed_only)):
        with job.attempt(f"the {name} stacks and the one-rank sites"):
            single = build_stack(layers, mdl, max_rows=8)
            multi = build_stack(layers, mdl, layout, job.mpi_comm(), max_rows=8)
            ys1 = [single.site_output(i, x).copy() for i in range(2)]
        for i, kind in enumerate(("dense FFN", name)):
            with job.attempt(f"{kind} on {job.size} ranks"):
                y1, y2 = ys1[i], multi.site_output(i, x).copy()
            whole = (kind == "dense FFN" and tp == 1) or (kind == "shared expert" and tp == 1) or (
                kind == "routed experts" and ep == 1)
            if whole and bf16_ulps(y2, y1).max() != 0:
                job.failures.append(f"{kind} at tp={tp} ep={ep}: not the one-rank bytes (rel L2 {rel_l2(y2, y1):.3e})")
            if not rel_l2(y2, y1) < 1e-2:
                job.failures.append(f"{kind} at tp={tp} ep={ep}: rel L2 {rel_l2(y2, y1):.3e}")
    job.agree()


def test_chained_step_is_identical_on_every_rank_and_close_to_one_rank(job: Job) -> None:
    model = tiny_model()
    with job.attempt("the weights, the inputs and the one-rank steps"):
        full = random_weights(model, seed=9, out_gain=0.04, bias_spread=0.3)
        pool = random_x(400, 64, model.hidden_size)
        x = pool[route_margins64(ref64_layers(full), RefParams.of(model), pool) > 0.01][:12]
        single = build_stack(full, model, max_rows=16)
        ys1 = {rows: single.step(x[:rows]).copy() for rows in (1, 12)}
    for tp, ep in ((2, 2), (1, 2), (2, 1)):
        with job.attempt(f"the tp={tp} ep={ep} stack"):
            multi = build_stack(full, model, RankLayout(job.size, job.rank, tp, ep), job.mpi_comm(), max_rows=16)
        for rows, y1 in ys1.items():
            with job.attempt(f"step tp={tp} ep={ep} rows={rows}"):
                y2 = multi.step(x[:rows]).copy()
            job.same_on_all_ranks(f"step tp={tp} ep={ep} rows={rows}", y2)
            if not rel_l2(y2, y1) < 1e-2:
                job.failures.append(f"step tp={tp} ep={ep} rows={rows}: rel L2 {rel_l2(y2, y1):.3e}")
    job.agree()


def test_nvfp4_dense_site_split_over_tp_matches_one_rank(job: Job) -> None:
    """A dense FFN stored NVFP4, its down projection split by columns on block boundaries: the tp = 2
    partial sums, all-reduced, equal the one-rank site (and the multi-rank stack holds the same bits on
    every rank)."""
    model = tiny_model()
    layer = model.mlp_layer_types.index("dense")
    world = job.size
    with job.attempt("the weights and the one-rank sites"):
        full = random_weights(model, seed=21, dense_nvfp4=True)
        single = build_stack(full, model, max_rows=16)
        xs = {rows: random_x(70 + rows, rows, model.hidden_size) for rows in (1, 5, 12)}
        ys1 = {rows: single.site_output(layer, x).copy() for rows, x in xs.items()}
    # 12 rows on the grouped GEMM, then with its projections dequantized to bf16 (each rank its own TP slices)
    for levers in (PathLevers(), PathLevers(nvfp4_dense_dequant_min_rows=12)):
        with job.attempt(f"the tp = {world} stack, dequant from {levers.nvfp4_dense_dequant_min_rows} rows"):
            multi = build_stack(full, model, RankLayout(world, job.rank, world, 1), job.mpi_comm(), max_rows=16,
                                levers=levers)
        for rows, x in xs.items():
            y1 = ys1[rows]
            path = multi.sites[layer].dispatch.path_for(rows)
            want = "dequant" if rows == 12 and levers.nvfp4_dense_dequant_min_rows == 12 else path
            if path != want:
                job.failures.append(f"dense nvfp4 site, {rows} rows: path {path}, expected {want}")
            with job.attempt(f"dense nvfp4 site, {rows} rows ({path}) on {world} ranks"):
                y2 = multi.site_output(layer, x).copy()
            job.same_on_all_ranks(f"dense nvfp4 site, {rows} rows ({path})", y2)
            if not rel_l2(y2, y1) < 1e-2:
                job.failures.append(f"dense nvfp4 site, {rows} rows ({path}): rel L2 {rel_l2(y2, y1):.3e} vs one rank")
            if not elementwise_close(y2, y1):
                job.failures.append(f"dense nvfp4 site, {rows} rows ({path}): not elementwise close to one rank")
    job.agree()


@pytest.mark.parametrize("dense", ["bf16", "nvfp4"])
@pytest.mark.parametrize("tp,ep", [(2, 2), (1, 2), (2, 1)], ids=["tp2-ep2", "tp1-ep2", "tp2-ep1"])
def test_loaded_runtime_matches_one_rank(job: Job, request, tp: int, ep: int, dense: str) -> None:
    """The same through the product's loader: each rank reads only its share of the checkpoint. With the dense
    FFNs stored NVFP4 on their dequant path (9 rows), whose scratch every rank agrees on at load, also a rank that
    holds no dense FFN (tp = 1 of 2 ranks)."""
    from mpi4py import MPI

    from glm_ep.mlp.runtime import load_runtime, open_checkpoint
    from glm_ep.dist.ranks import Ranks
    from glm_ep.config.topology import Topology

    ckpt = request.getfixturevalue("tiny_checkpoint" if dense == "bf16" else "tiny_checkpoint_dense_nvfp4")
    levers = PathLevers(nvfp4_dense_dequant_min_rows=9)

    def load(topo: Topology, ranks: Ranks):
        return load_runtime(open_checkpoint(ckpt, topo, ranks), topo, ranks)

    with job.attempt("the one-rank load and sites"):
        single = load(Topology(world=1, levers=levers), Ranks(MPI.COMM_SELF))
        x = random_x(55, 9, single.model.hidden_size)
        ys1 = [single.stack.site_output(i, x).copy() for i in range(single.model.num_hidden_layers)]
    with job.attempt(f"the load on {job.size} ranks"):  # its errors are agreed: every rank raises alike
        topo = Topology(world=job.size, tp=tp, ep=ep, workspace_rows=16, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                        levers=levers)
        multi = load(topo, Ranks(job.comm, timeout_s=COLLECTIVE_TIMEOUT_S))
    bytes_each = job.allgather("weight bytes", multi.weight_bytes)
    if not sum(bytes_each) < job.size * single.weight_bytes:
        job.failures.append(f"ranks hold {bytes_each} bytes, one rank holds {single.weight_bytes}: nothing was split")
    with job.attempt("the footprint"):
        mine = SiteConfig.for_rank(single.model, RankLayout(job.size, job.rank, tp, ep))
        for what, got, cfg in (("this rank", multi.weight_bytes, mine), ("one rank", single.weight_bytes, single.cfg)):
            # what the config says a rank of that layout holds
            want = rank_weight_bytes(single.model, cfg, dense_nvfp4=dense == "nvfp4")
            if got != want:
                job.failures.append(f"{what} holds {got} weight bytes, the footprint says {want}")
    for i, y1 in enumerate(ys1):
        with job.attempt(f"site {i} on {job.size} ranks"):
            y2 = multi.stack.site_output(i, x).copy()
        job.same_on_all_ranks(f"site {i}", y2)
        if not rel_l2(y2, y1) < 1e-2:
            job.failures.append(f"site {i}: rel L2 {rel_l2(y2, y1):.3e} vs one rank")
        if not elementwise_close(y2, y1):
            job.failures.append(f"site {i}: not elementwise close to one rank")
    job.agree()

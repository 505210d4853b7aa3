"""Every dispatch path of the CUDA backend against the NumPy backend on the same weights.

decode (1 row), each verify width 2..8 (union), prefill at 20 (row groups of <= 8), 300 and 2000
rows (the grouped GEMM at or above the crossover lever, row groups below it), host dispatch, graph
replay of a 1-row and a 4-row stack step, two ranks on one GPU through the host-staged MPI communicator
(``mpiexec -n 2 python -m pytest -m "cuda and mpi" tests/cuda/test_cuda_paths.py``) and a 1-rank NCCL
all-reduce.

Routing must pick the same experts on both backends, so the site inputs and the router are
integer-valued (exact logits whatever the summation order) and the biases are spaced so that no
two choices come closer than the sigmoid's rounding could move them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from glm_ep.checkpoint import nvfp4
from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.dist.comm import MpiComm, SelfComm
from glm_ep.config.model import ModelConfig, RankLayout, SiteConfig
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.mlp.site import DenseSite, MoeSite, Nvfp4DenseSite
from glm_ep.mlp.stack import MlpStack
from glm_ep.config.topology import PathLevers, Topology
from glm_ep.checkpoint.weights import DenseWeights, ExpertWeights, MoeWeights

from _cuda import backend, dev, host, requires_cuda, spy_launches
from helpers import BF16, assert_close, rand_bf16

pytestmark = [pytest.mark.cuda, requires_cuda]

H, I, M, E, TOP_K = 256, 384, 128, 32, 8
MAX_ROWS = 300
BIAS_STEP = 0.0531  # keeps every two choices of distinct experts >= 1e-3 apart (checked below)
ROUTER_NNZ = 3  # router row nonzeros: logits are integers in [-6, 6] for inputs in {-2..2}


def model(layer_types=("dense", "sparse"), hidden=H, width=I, moe_width=M, experts=E, top_k=TOP_K) -> ModelConfig:
    return ModelConfig.from_dict({
        "hidden_size": hidden, "intermediate_size": width, "moe_intermediate_size": moe_width,
        "num_hidden_layers": len(layer_types), "n_shared_experts": 1, "n_routed_experts": experts,
        "num_experts_per_tok": top_k, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_group": 1,
        "topk_group": 1, "swiglu_limit": 2.0, "mlp_layer_types": list(layer_types),
        "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}})


def nvfp4_mlp(rng, hidden: int, width: int) -> ExpertWeights:
    """Random NVFP4 gate [width, hidden], up and down [hidden, width], rows of unit scale."""
    return ExpertWeights(*(nvfp4.quantize((rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32))
                           for s in ((width, hidden), (width, hidden), (hidden, width))))


def _dense(rng, width):
    return DenseWeights(rand_bf16(rng, (width, H), H ** -0.5), rand_bf16(rng, (width, H), H ** -0.5),
                        rand_bf16(rng, (H, width), width ** -0.5))


def _router(rng):
    w = np.zeros((E, H), np.float32)
    for e in range(E):
        w[e, rng.choice(H, ROUTER_NNZ, replace=False)] = rng.choice([-1.0, 1.0], ROUTER_NNZ)
    return w


def _bias(rng):
    bias = (7.0 + BIAS_STEP * rng.permutation(E)).astype(np.float32)
    s = (1.0 / (1.0 + np.exp(-np.arange(-2 * ROUTER_NNZ, 2 * ROUTER_NNZ + 1, dtype=np.float32)))).astype(np.float32)
    choice = (s[None, :] + bias[:, None]).astype(np.float32)  # [E, logit]
    gaps = np.abs(choice[:, None, :, None] - choice[None, :, None, :])
    gaps[np.arange(E), np.arange(E)] = np.inf
    assert gaps.min() > 1e-4, "bias spacing lets two choices come too close"
    return bias


def full_weights(seed, layer_types, router_dtype=np.float32):
    """World-1 weights of every layer, the same on every rank."""
    rng = np.random.default_rng(seed)
    out = []
    for kind in layer_types:
        if kind == "dense":
            out.append(_dense(rng, I))
            continue
        experts = tuple(nvfp4_mlp(rng, H, M) for _ in range(E))
        out.append(MoeWeights(_router(rng).astype(router_dtype), _bias(rng), 0, experts, _dense(rng, M)))
    return out


def shard(w, cfg: SiteConfig):
    """This rank's part: TP slices of the dense/shared MLPs, its EP range of experts."""
    def tp(d: DenseWeights, sparse: bool):
        if not cfg.tp_active(sparse):
            return None
        n = d.gate.shape[0] // cfg.tp
        sl = slice(cfg.tp_rank * n, (cfg.tp_rank + 1) * n)
        return DenseWeights(d.gate[sl], d.up[sl], np.ascontiguousarray(d.down[:, sl]))

    if isinstance(w, DenseWeights):
        return tp(w, False)
    start = cfg.expert_start
    experts = w.experts[start:start + cfg.local_experts] if cfg.ep_active() else ()
    return MoeWeights(w.router, w.bias, start, experts, tp(w.shared, True))


def site_mismatches(cuda: MlpStack, ref: MlpStack, widths, label: str) -> list[str]:
    """Each site of two stacks (sites 0 and 1) on the same integer rows of each width: what differs past
    ``assert_close``, one line each, collected so that every rank reaches the collectives after it."""
    failures = []
    for rows in widths:
        x = int_rows(np.random.default_rng(rows), rows)
        for site in (0, 1):
            try:
                assert_close(host(cuda.site_output(site, dev(x))), ref.site_output(site, x),
                             f"{label}: site {site}, {rows} rows")
            except AssertionError as e:
                failures.append(str(e))
    return failures


def build_stack(be, comm, cfg, weights, levers, max_rows=MAX_ROWS):
    sites = []
    for w in weights:
        if isinstance(w, MoeWeights):
            moe = be.upload_moe(w, cfg.swiglu_limit)
            sites.append(MoeSite(be, comm, cfg, moe, ExpertDispatch.routed(be, cfg, levers)))
        else:
            sites.append(DenseSite(be, comm, cfg, None if w is None else be.upload_dense(w)))
    return MlpStack(be, comm, cfg, sites, levers, max_rows)


def int_rows(rng, t):
    return rng.integers(-2, 3, (t, H)).astype(np.float32).astype(BF16)


def single_rank(levers=PathLevers(), layer_types=("dense", "sparse"), router_dtype=np.float32, seed=7,
                max_rows=MAX_ROWS):
    m = model(layer_types)
    cfg = SiteConfig.for_rank(m, RankLayout(1, 0, 1, 1))
    weights = full_weights(seed, layer_types, router_dtype)
    cuda = build_stack(backend(), SelfComm(), cfg, weights, levers, max_rows)
    ref = build_stack(NumpyBackend(), SelfComm(), cfg, weights, levers, max_rows)
    return cuda, ref


@pytest.fixture(scope="module")
def stacks():
    return single_rank()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 20, 300])
@pytest.mark.parametrize("site", [0, 1], ids=["dense", "sparse"])
def test_site_paths(stacks, rows, site):
    cuda, ref = stacks
    x = int_rows(np.random.default_rng(1000 + rows), rows)
    want = np.array(ref.site_output(site, x), copy=True)
    got = host(cuda.site_output(site, dev(x)))
    assert_close(got, want, f"site {site}, {rows} rows")


@pytest.mark.parametrize("rows,min_rows", [(20, 9), (300, 128), (2000, 128), (2000, 10**6)],
                         ids=["sorted-20", "sorted-300", "sorted-2000", "row-groups-2000"])
def test_prefill_paths(rows, min_rows):
    """Wide prefill through the grouped GEMM (sort by expert, one launch per projection, indexed
    combine) at and above the crossover lever, and through row groups below it."""
    levers = PathLevers(prefill_gemm_min_rows=min_rows)
    cuda, ref = single_rank(levers, layer_types=("sparse",), seed=rows, max_rows=rows)
    want_path = "sorted" if rows >= min_rows else "union"
    assert cuda.sites[0].experts.path_for(rows) == want_path
    x = int_rows(np.random.default_rng(rows), rows)
    want = np.array(ref.site_output(0, x), copy=True)
    assert_close(host(cuda.site_output(0, dev(x))), want, f"{rows} rows, {want_path} path")


@pytest.mark.parametrize("rows", [1, 3])
def test_host_dispatch(rows):
    cuda, ref = single_rank(PathLevers(host_dispatch=True), router_dtype=BF16)
    x = int_rows(np.random.default_rng(rows), rows)
    assert_close(host(cuda.site_output(1, dev(x))), ref.site_output(1, x), f"host dispatch, {rows} rows")


@pytest.mark.parametrize("rows", [1, 4])
def test_graph_replay(rows):
    """The captured step replays with new inputs and matches an eager NumPy stack."""
    cuda, ref = single_rank(layer_types=("dense", "sparse", "sparse"), seed=11)
    assert backend().capabilities.capture
    rng = np.random.default_rng(rows)
    for step in range(3):  # capture on the first, replay on the rest
        x = (int_rows(rng, rows).astype(np.float32) * 0.5).astype(BF16)
        want = np.array(ref.step(x), copy=True)
        got = host(cuda.step(dev(x)))
        assert_close(got, want, f"stack step {step}, {rows} rows")
    assert rows in cuda._graphs, "the step was not captured"


@pytest.mark.parametrize("rows", [1, 4])
def test_site_graph_replay(rows):
    """One-site calls (the library's ``site``) replay a graph per (site, rows) with new inputs and match an
    eager NumPy stack."""
    cuda, ref = single_rank(layer_types=("dense", "sparse", "sparse"), seed=17)
    rng = np.random.default_rng(100 + rows)
    for call in range(3):  # captured on the first call of each (site, rows), replayed after
        x = (int_rows(rng, rows).astype(np.float32) * 0.5).astype(BF16)
        for i in range(3):
            want = np.array(ref.site_output(i, x), copy=True)
            assert_close(host(cuda.site_output(i, dev(x))), want, f"site {i}, call {call}, {rows} rows")
    assert sorted(cuda._site_graphs) == [(i, rows) for i in range(3)]


@pytest.mark.parametrize("rows", [1, 4, 300])
def test_dependent_launches_change_no_bit(rows):
    """Every kernel launched as a programmatic dependent of the one before it (the default from
    sm_90 on) gives the bits plain launches give: a dense + 2 sparse stack, captured as a graph at
    1 and 4 rows and eager at 300, over fresh inputs, against the same stack on a backend with
    plain launches and against NumPy."""
    from glm_ep.backend.cuda import CudaBackend
    from glm_ep.backend.cuda.kernel_loader import compute_capability

    on = backend()
    assert on.pdl == (compute_capability(0) >= (9, 0))
    off = CudaBackend(0, on.ring, stream=on.stream, dependent_launch=False)
    assert not off.pdl
    layer_types = ("dense", "sparse", "sparse")
    cfg = SiteConfig.for_rank(model(layer_types), RankLayout(1, 0, 1, 1))
    weights = full_weights(13, layer_types)
    stacks = [build_stack(be, SelfComm(), cfg, weights, PathLevers(), max_rows=300) for be in (on, off)]
    ref = build_stack(NumpyBackend(), SelfComm(), cfg, weights, PathLevers(), max_rows=300)
    rng = np.random.default_rng(rows)
    for step in range(3):
        x = (int_rows(rng, rows).astype(np.float32) * 0.5).astype(BF16)
        got_on, got_off = (np.array(host(st.step(dev(x))), copy=True) for st in stacks)
        np.testing.assert_array_equal(got_on.view(np.uint16), got_off.view(np.uint16),
                                      err_msg=f"step {step}, {rows} rows: dependent vs plain launches")
        assert_close(got_on, np.array(ref.step(x), copy=True), f"step {step}, {rows} rows")
    assert (rows in stacks[0]._graphs) == (rows <= 8)


def _nvfp4_dense_stack(be, cfg: SiteConfig, w: ExpertWeights, levers: PathLevers = PathLevers()) -> MlpStack:
    mlp = be.upload_experts((w,), 0, cfg.swiglu_limit, what="dense mlp")
    site = Nvfp4DenseSite(be, SelfComm(), cfg, mlp, ExpertDispatch.nvfp4_dense(be, cfg, levers))
    return MlpStack(be, SelfComm(), cfg, [site], levers, MAX_ROWS)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 20, 40, 255, 256, 300])
@pytest.mark.parametrize("hidden,width", [(256, 384), (512, 1024)], ids=["block-kernels", "ring"])
def test_nvfp4_dense_site(rows, hidden, width):
    """A dense FFN stored NVFP4 (one expert that every row chooses) on every path of the CUDA backend
    against NumPy: the decode ring or block kernels (1 row; the ring needs K % 512), the union kernels
    (2..8), row groups (20, the crossover lever raised past it), the grouped GEMM (40, 255), its projections
    dequantized to bf16 for cuBLAS (256, 300: the default lever), and the 1..8-row step captured and replayed
    with fresh inputs."""
    cfg = SiteConfig.for_rank(model(("dense",), hidden, width), RankLayout(1, 0, 1, 1))
    rng = np.random.default_rng(rows * 7 + hidden)
    w = nvfp4_mlp(rng, hidden, width)
    levers = PathLevers(nvfp4_dense_gemm_min_rows=32)
    cuda, ref = _nvfp4_dense_stack(backend(), cfg, w, levers), _nvfp4_dense_stack(NumpyBackend(), cfg, w, levers)
    d = levers.nvfp4_dense_dequant_min_rows
    want_path = "decode" if rows == 1 else "dequant" if rows >= d else "sorted" if rows >= 32 else "union"
    assert cuda.sites[0].dispatch.path_for(rows) == want_path
    for step in range(3 if rows <= 8 else 1):  # 1..8 rows: captured on the first step, replayed after
        x = rand_bf16(rng, (rows, hidden), 1.0)
        assert_close(host(cuda.step(dev(x))), np.array(ref.step(x), copy=True), f"{rows} rows, step {step}")
    assert (rows in cuda._graphs) == (rows <= 8)


@pytest.mark.parametrize("rows", [9, 24, 64, 300])
@pytest.mark.parametrize("k_split", [True, False], ids=["k-split", "no-split"])
def test_nvfp4_dense_site_k_split(monkeypatch, rows, k_split):
    """The grouped GEMM of a dense FFN stored NVFP4 from 9 rows (the default crossover): with one expert
    its launches have few blocks, so K is split where it has enough stages (gate + up over 16 stages of 64 k,
    down over 32; at 9 rows the 128-k stages split only down's 16) into
    the workspace's a_gate and added by the reduce launches; equal to NumPy within bf16 rounding, and
    with the split lever off no reduce launch runs."""
    from glm_ep.backend.cuda import grouped

    hidden, width = 1024, 2048
    cfg = SiteConfig.for_rank(model(("dense",), hidden, width), RankLayout(1, 0, 1, 1))
    rng = np.random.default_rng(rows + 11 * k_split)
    w = nvfp4_mlp(rng, hidden, width)
    levers = PathLevers(prefill_k_split=k_split, nvfp4_dense_dequant_min_rows=0)
    cuda, ref = _nvfp4_dense_stack(backend(), cfg, w, levers), _nvfp4_dense_stack(NumpyBackend(), cfg, w, levers)
    assert cuda.sites[0].dispatch.path_for(rows) == "sorted"
    entries = spy_launches(monkeypatch, grouped)
    x = rand_bf16(rng, (rows, hidden), 1.0)
    assert_close(host(cuda.step(dev(x))), np.array(ref.step(x), copy=True), f"{rows} rows, k_split {k_split}")
    reduces = [e for e in entries if e.startswith("nvfp4_gemm_reduce")]
    if not k_split:
        assert not reduces, entries
    elif rows <= 16:  # the narrow 16-row tile's 128-k stages: gate + up's 8 over K = 1024 too few to split, down's 16
        assert reduces == ["nvfp4_gemm_reduce"], entries
    elif rows <= 24:  # gate + up (32 weight-row blocks) and down (16) both split
        assert reduces == ["nvfp4_gemm_reduce_glu", "nvfp4_gemm_reduce"], entries
    elif rows == 64:  # the down projection splits; gate's and up's partial sums of two splits pass a_gate
        assert reduces == ["nvfp4_gemm_reduce"], entries


def test_sparse_site_k_split_keeps_the_shared_expert(monkeypatch):
    """A sparse site whose grouped GEMMs split K (two experts, every row choosing both: 32 blocks a launch) while
    the shared expert's activations wait in a_act past the routed rows: the partial sums go to a_gate, which
    holds nothing live, so the site matches NumPy within bf16 rounding."""
    from glm_ep.backend.cuda import grouped

    hidden, width, rows = 2048, 1024, 40
    m = model(("sparse",), hidden, width, moe_width=width, experts=2, top_k=2)
    cfg = SiteConfig.for_rank(m, RankLayout(1, 0, 1, 1))
    rng = np.random.default_rng(41)
    experts = tuple(nvfp4_mlp(rng, hidden, width) for _ in range(2))
    shapes = ((width, hidden), (width, hidden), (hidden, width))
    shared = DenseWeights(*(rand_bf16(rng, s, s[1] ** -0.5) for s in shapes))
    w = MoeWeights(rng.standard_normal((2, hidden)).astype(np.float32) * 0.01, np.zeros(2, np.float32), 0, experts,
                   shared)
    levers = PathLevers(prefill_gemm_min_rows=9)
    cuda = build_stack(backend(), SelfComm(), cfg, [w], levers, max_rows=600)
    ref = build_stack(NumpyBackend(), SelfComm(), cfg, [w], levers, max_rows=600)
    entries = spy_launches(monkeypatch, grouped)
    x = rand_bf16(rng, (rows, hidden), 1.0)
    assert cuda.sites[0].experts.path_for(rows) == "sorted"
    assert_close(host(cuda.step(dev(x))), np.array(ref.step(x), copy=True), f"{rows} rows")
    assert [e for e in entries if e.startswith("nvfp4_gemm_reduce")] == ["nvfp4_gemm_reduce_glu",
                                                                          "nvfp4_gemm_reduce"], entries


def test_nccl_one_rank():
    from mpi4py import MPI

    from glm_ep.backend import make_comm
    from glm_ep.dist.nccl import NcclComm
    from glm_ep.dist.placement import discover

    be = backend()
    comm = make_comm(MPI.COMM_SELF, be, Topology(backend="cuda"), discover(MPI.COMM_SELF))
    assert isinstance(comm, NcclComm) and comm.capturable
    x = rand_bf16(np.random.default_rng(3), (4, H), 1.0)
    buf = dev(x)
    comm.all_reduce(buf)
    np.testing.assert_array_equal(host(buf).view(np.uint16), x.view(np.uint16))
    replay = be.capture(lambda: comm.all_reduce(buf))
    replay()
    np.testing.assert_array_equal(host(buf).view(np.uint16), x.view(np.uint16))


@pytest.mark.mpi(min_size=2)
def test_two_ranks_one_gpu():
    """world = tp = ep = 2 on ONE GPU: the ranks sum through the host-staged MPI communicator, and
    match two NumPy ranks on the same shards. Assertions are agreed across ranks."""
    from mpi4py import MPI

    from glm_ep.backend import make_comm
    from glm_ep.dist.placement import discover

    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        pytest.skip("run under mpiexec -n 2")
    layer_types = ("dense", "sparse")
    cfg = SiteConfig.for_rank(model(layer_types), RankLayout(2, world.Get_rank(), 2, 2))
    weights = [shard(w, cfg) for w in full_weights(5, layer_types)]
    be = backend()
    comm = make_comm(world, be, Topology(world=2, tp=2, ep=2, backend="cuda"), discover(world))
    failures = [] if isinstance(comm, MpiComm) else [f"rank {world.Get_rank()}: {type(comm).__name__}, expected "
                                                      "MpiComm (two ranks on one GPU)"]
    every = sum(world.allgather(failures), [])  # agreed before the first collective either rank would wait in
    if every:
        pytest.fail("\n".join(every))
    cuda = build_stack(be, comm, cfg, weights, PathLevers(), max_rows=20)
    ref = build_stack(NumpyBackend(), MpiComm(world), cfg, weights, PathLevers(), max_rows=20)
    failures += site_mismatches(cuda, ref, (1, 4, 20), f"rank {world.Get_rank()}")
    # back-to-back calls on fresh inputs: each all-reduce's host-staged copy back to the device must
    # have read its (temporary) host buffer before the next call reuses that memory
    rng = np.random.default_rng(11)
    for call in range(6):
        x = int_rows(rng, 20)
        try:
            assert_close(host(cuda.site_output(1, dev(x))), ref.site_output(1, x),
                         f"rank {world.Get_rank()}: site 1, back-to-back call {call}")
        except AssertionError as e:
            failures.append(str(e))
    failures = sum(world.allgather(failures), [])
    assert not failures, "\n".join(failures)



def test_make_backend_refuses_ring_levers_past_the_device_shared_memory(monkeypatch) -> None:
    """make_backend asks the device for its shared memory a block and refuses a ring lever set that passes it, by
    name (65536 bytes stood in, where the union ring's gate + up at slab 4, depth 2 and 8 rows needs 69632); the
    defaults build."""
    from glm_ep.backend import make_backend
    from glm_ep.backend.cuda import CudaBackend, kernel_loader as loader
    from glm_ep.errors import ConfigError
    from glm_ep.dist.placement import Placement

    here = Placement(rank=0, world=1, node=0, local_rank=0, local_size=1, host="here")
    cfg = SiteConfig.for_rank(model(), RankLayout(1, 0, 1, 1))
    monkeypatch.setattr(loader, "block_smem_limit", lambda: 65536)
    topo = Topology.from_dict({"backend": "cuda", "levers": {"ring_union_max_rows": 8, "ring_union_slab": [4, 4],
                                                             "ring_union_depth": [2, 2]}})
    with pytest.raises(ConfigError, match=r"levers.ring_union_slab = \[4, 4\], ring_union_depth = \[2, 2\]: .* "
                                          r"needs 69632 bytes .* allows 65536"):
        make_backend(topo, here, cfg)
    assert isinstance(make_backend(Topology.from_dict({"backend": "cuda"}), here, cfg), CudaBackend)
    monkeypatch.setattr(loader, "block_smem_limit", lambda: 101376)  # a GB10's
    # 1000 experts: the sort by expert of wide calls needs 132128 bytes a block, past the GB10's; refused unless wide
    # calls stay off the sort (or the workspace never reaches the grouped GEMM's rows)
    many = dataclasses.replace(cfg, num_experts=1000)
    with pytest.raises(ConfigError,
                       match=r"n_routed_experts = 1000: the sort by expert .* allows 101376 \(at most 767"):
        make_backend(Topology.from_dict({"backend": "cuda"}), here, many)
    for off in ({"levers": {"prefill_gemm": False}}, {"workspace_rows": 8}):
        assert isinstance(make_backend(Topology.from_dict({"backend": "cuda", **off}), here, many), CudaBackend)

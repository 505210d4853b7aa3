"""The library API (``glm_ep.load``, ``site``, ``step``) on the NumPy backend: NumPy arrays and torch
tensors (DLPack) in, fresh arrays of the same kind out, held against the tests' own float64 decoder;
the README's example; two ranks under ``mpiexec -n 2`` (tests marked mpi).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import glm_ep
from glm_ep import GlmEpError, InputError, Topology

from _cuda import cupy, requires_cuda
from ckpt_writer import read_f64
from cli_jobs import copy_checkpoint, mpiexec
from helpers import BF16, REPO, agreed, elementwise_close, random_x, rel_l2, site64

#: the MPI tests' bound on every wait on the other ranks, far below their pytest timeout (120 s)
COLLECTIVE_TIMEOUT_S = 30.0


def _self_comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


@pytest.fixture(scope="module")
def mlp(tiny_checkpoint):
    return glm_ep.load(tiny_checkpoint, comm=_self_comm())


def _across(n: int, **kw) -> Topology:
    """The default layout of ``n`` ranks (world = tp = ep = n) with the tests' collective timeout."""
    return Topology(**{"name": "across", "world": n, "tp": n, "ep": n, "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
                       **kw})


def _chain(mlp, x: np.ndarray) -> np.ndarray:
    """``h = bf16(h + site(h))`` through every layer, one API call per site."""
    h = x
    for i in range(mlp.num_layers):
        h = (h.astype(np.float32) + mlp.site(i, h).astype(np.float32)).astype(BF16)
    return h


def test_site_matches_float64_and_step_is_the_chain_of_sites(mlp, tiny_checkpoint) -> None:
    layers, p = read_f64(tiny_checkpoint)
    x = random_x(11, 5, mlp.hidden_size, gain=1.5)
    x_before = x.copy()
    assert mlp.num_layers == len(layers) and mlp.max_rows == 512 and mlp.weight_bytes > 0
    for i, layer in enumerate(layers):
        y = mlp.site(i, x)
        assert type(y) is np.ndarray and y.dtype == BF16 and y.shape == x.shape
        assert rel_l2(y, site64(layer, p, x)) < 1e-2, (i, rel_l2(y, site64(layer, p, x)))
    h = mlp.step(x)
    assert type(h) is np.ndarray and h.dtype == BF16
    assert np.array_equal(h.view(np.uint16), _chain(mlp, x).view(np.uint16))
    assert np.array_equal(x.view(np.uint16), x_before.view(np.uint16)), "the input was written to"


def test_results_are_fresh_arrays(mlp) -> None:
    x1, x2 = random_x(1, 3, mlp.hidden_size), random_x(2, 3, mlp.hidden_size)
    y1 = mlp.site(1, x1)
    kept = y1.copy()
    h1 = mlp.step(x1)
    y2, h2 = mlp.site(1, x2), mlp.step(x2)
    assert np.array_equal(y1.view(np.uint16), kept.view(np.uint16)), "a later call changed an earlier result"
    assert not np.array_equal(y1.view(np.uint16), y2.view(np.uint16))
    for a, b in ((y1, y2), (h1, h2), (y1, h1)):
        assert not np.shares_memory(a, b)
    y1[...] = 0  # the caller owns it: writing to it changes nothing the runtime holds
    assert np.array_equal(mlp.site(1, x1).view(np.uint16), kept.view(np.uint16))


def test_torch_tensors_in_and_out(mlp) -> None:
    torch = pytest.importorskip("torch")
    x = random_x(5, 6, mlp.hidden_size)
    want_site, want_step = mlp.site(2, x), mlp.step(x)
    t = torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    wide = torch.empty(mlp.hidden_size, 6, dtype=torch.bfloat16).t()  # strided, not contiguous
    wide.copy_(t)
    for inp in (t, wide, t.clone().requires_grad_(True)):
        for got, want in ((mlp.site(2, inp), want_site), (mlp.step(inp), want_step)):
            assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16 and got.device == inp.device
            assert tuple(got.shape) == x.shape
            assert np.array_equal(got.view(torch.int16).numpy(), want.view(np.int16))
            assert got.data_ptr() != inp.data_ptr()


def test_wide_inputs_run_in_workspace_sized_chunks(tiny_checkpoint, mlp) -> None:
    layers, p = read_f64(tiny_checkpoint)
    narrow = glm_ep.load(tiny_checkpoint, topology=Topology(name="narrow", workspace_rows=4), comm=_self_comm())
    assert narrow.max_rows == 4 and narrow.topology.name == "narrow"
    x = random_x(3, 11, mlp.hidden_size)
    y = narrow.site(3, x)
    parts = [narrow.site(3, x[r:r + 4]) for r in range(0, 11, 4)]
    assert y.shape == (11, mlp.hidden_size)
    assert np.array_equal(y.view(np.uint16), np.concatenate(parts).view(np.uint16))
    assert rel_l2(y, site64(layers[3], p, x)) < 1e-2
    h = narrow.step(x)
    steps = [narrow.step(x[r:r + 4]) for r in range(0, 11, 4)]
    assert np.array_equal(h.view(np.uint16), np.concatenate(steps).view(np.uint16))


@pytest.mark.parametrize("bad,message", [
    (np.zeros((5, 128), np.float32), r"input is float32 \[5, 128\], expected bfloat16 \[rows >= 1, 128\]"),
    (np.zeros((5, 64), BF16), r"input is bfloat16 \[5, 64\], expected bfloat16 \[rows >= 1, 128\]"),
    (np.zeros(128, BF16), r"input is bfloat16 \[128\], expected"),
    (np.zeros((0, 128), BF16), r"input is bfloat16 \[0, 128\], expected bfloat16 \[rows >= 1"),
    ([[0.0] * 128], r"input is a builtins.list; expected a NumPy or CuPy array or a torch tensor"),
])
def test_bad_inputs_name_what_was_expected(mlp, bad, message: str) -> None:
    with pytest.raises(InputError, match=message):
        mlp.step(bad)


@pytest.mark.parametrize("index", [4, -1, 1.0, True, "1"])
def test_bad_site_index(mlp, index) -> None:
    with pytest.raises(InputError, match=r"site index .* expected 0..3|the model has layers 0..3"):
        mlp.site(index, random_x(0, 1, mlp.hidden_size))


def test_bad_topology_or_model_is_a_clear_error(tiny_checkpoint, tmp_path) -> None:
    with pytest.raises(GlmEpError, match=r"topology = 3: expected None, a Topology, a shipped topology name"):
        glm_ep.load(tiny_checkpoint, topology=3, comm=_self_comm())
    with pytest.raises(GlmEpError, match="gb10-9: topology file not found"):
        glm_ep.load(tiny_checkpoint, topology="gb10-9", comm=_self_comm())
    with pytest.raises(GlmEpError, match=r"topology .cpu-2. is for 2 ranks \(world = 2\), but the MPI job has 1"):
        glm_ep.load(tiny_checkpoint, topology="cpu-2", comm=_self_comm())
    with pytest.raises(GlmEpError, match=re.escape(str(tmp_path / "none"))):
        glm_ep.load(tmp_path / "none", comm=_self_comm())
    for bad in (None, b"/models/glm", 3):  # a TypeError or AttributeError from deep inside before
        with pytest.raises(GlmEpError, match=r"model_dir = .*: expected the checkpoint folder's path"):
            glm_ep.load(bad, comm=_self_comm())
    with pytest.raises(GlmEpError, match=r"comm = 'world': expected an mpi4py communicator"):
        glm_ep.load(tiny_checkpoint, comm="world")
    typo = copy_checkpoint(tiny_checkpoint, tmp_path / "typo")  # a config that declares more than it holds
    cfg = json.loads((typo / "config.json").read_text())
    cfg.pop("mlp_layer_types", None)
    (typo / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=40, first_k_dense_replace=1)))
    with pytest.raises(GlmEpError, match=r"num_hidden_layers = 40, but .* holds MLP tensors for layers 0..3"):
        glm_ep.load(typo, comm=_self_comm())


def _readme_example() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Library API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


# appended to the README's example: this rank's input and results, and the chain of its sites (each layer's input
# and site output) that its step must be, as bits for the test to compare
_SAVE_RESULTS = """
from mpi4py import MPI
hs, ys = [x], []
for i in range(mlp.num_layers):
    ys.append(mlp.site(i, hs[-1]))
    hs.append((hs[-1].astype(np.float32) + ys[-1].astype(np.float32)).astype(ml_dtypes.bfloat16))
np.savez(f"result-{MPI.COMM_WORLD.Get_rank()}.npz", x=x.view(np.uint16), y=y.view(np.uint16), h=h.view(np.uint16),
         hs=np.stack(hs).view(np.uint16), ys=np.stack(ys).view(np.uint16))
"""


def test_the_readme_example_runs_on_two_ranks(tiny_checkpoint, mlp, tmp_path) -> None:
    """The example runs under ``mpiexec -n 2`` on the default topology (world = tp = ep = 2), and its numbers are
    one rank's: ``y`` is one rank's site of the same input within the bounds the multi-rank tests hold sites to
    (the ranks' partial sums round in another order), and ``h`` is the chain of its own sites, each of them within
    those bounds of one rank's site of the same input. (``h`` against one rank's step: the small differences grow
    through the chain, 3e-2 relative L2 here, and this input routes with margins under 2e-4.)"""
    pytest.importorskip("torch")  # the example ends with a torch tensor
    example = _readme_example()
    site_call = re.search(r"^y = mlp\.site\((\d+), x\)", example, re.M)
    assert site_call, f"the README's example no longer computes y = mlp.site(i, x):\n{example}"
    layer = int(site_call.group(1))
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "tiny").symlink_to(tiny_checkpoint)
    launch = re.search(r"^# (mpiexec -n 2 python .*example\.py)", example, re.M)
    assert launch, f"the README's example no longer says how to launch it:\n{example}"
    # every call of the example keeps the call contract: with check_calls the ranks agree each call's input bits
    loads = re.findall(r'^mlp = glm_ep\.load\("\.cache/tiny"\)', example, re.M)
    assert len(loads) == 1, example
    checked = example.replace('mlp = glm_ep.load(".cache/tiny")', 'mlp = glm_ep.load(".cache/tiny", topology='
                              'glm_ep.Topology(name="checked", world=2, tp=2, ep=2, check_calls=True))')
    (tmp_path / "example.py").write_text(checked + _SAVE_RESULTS)
    r = mpiexec(2, *launch.group(1).split()[4:], cwd=tmp_path)  # python's arguments as the README gives them
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(2):  # the two ranks' prints may interleave: each piece once per rank
        assert r.stdout.count(f"GlmMlp(4 layers, hidden 128; rank {rank} of 2, tp 2, ep 2, backend cpu)") == 1, r.stdout
    # print writes each argument on its own: the other rank's whole line can fall between the shape and the dtype
    assert r.stdout.count("(4, 128)") == 2 and r.stdout.count("bfloat16") == 2, r.stdout
    ranks = [np.load(tmp_path / f"result-{rank}.npz") for rank in range(2)]
    for name in ("x", "y", "h", "hs", "ys"):
        assert np.array_equal(ranks[0][name], ranks[1][name]), f"{name} differs between the ranks"
    x, y, h, hs, ys = (ranks[0][name].view(BF16) for name in ("x", "y", "h", "hs", "ys"))
    assert y.shape == h.shape == x.shape and hs.shape[0] == mlp.num_layers + 1
    assert np.array_equal(h.view(np.uint16), hs[-1].view(np.uint16)), "step(x) is not the chain of its sites"
    checks = [(f"site({layer}, x)", y, mlp.site(layer, x))]
    checks += [(f"site({i}, h{i}) in the chain", ys[i], mlp.site(i, hs[i])) for i in range(mlp.num_layers)]
    for what, got, want in checks:
        assert rel_l2(got, want) < 1e-2, f"{what}: rel L2 {rel_l2(got, want):.3e} vs one rank"
        assert elementwise_close(got, want), f"{what}: not elementwise close to one rank"


def test_a_rank_that_raises_under_python_m_mpi4py_ends_the_job_at_once(tiny_checkpoint, tmp_path) -> None:
    """The README's launch: rank 1 raises before a call that rank 0 makes and waits in. Run as ``python -m mpi4py``
    the job ends at once (exit 1, rank 1's traceback), not after rank 0's 300 s deadline (the timeout here is far
    below it)."""
    (tmp_path / "engine.py").write_text(f"""
import numpy as np, ml_dtypes, glm_ep
from mpi4py import MPI
mlp = glm_ep.load({str(tiny_checkpoint)!r})
if MPI.COMM_WORLD.Get_rank() == 1:
    raise RuntimeError("rank 1 gave up before its call")
mlp.site(1, np.zeros((2, mlp.hidden_size), ml_dtypes.bfloat16))
""")
    r = mpiexec(2, "-m", "mpi4py", "engine.py", cwd=tmp_path, timeout=60)
    assert r.returncode != 0 and "RuntimeError: rank 1 gave up before its call" in r.stderr, r.stderr[-3000:]
    assert "waited" not in r.stderr, r.stderr[-3000:]  # not the deadline's end


@pytest.mark.cuda
@requires_cuda
def test_cuda_backend_takes_and_gives_numpy_cupy_and_torch(tiny_checkpoint, mlp) -> None:
    gpu = glm_ep.load(tiny_checkpoint, topology=Topology(name="cuda-1", backend="cuda"), comm=_self_comm())
    x = random_x(9, 5, mlp.hidden_size)
    y = gpu.site(2, x)
    assert type(y) is np.ndarray and rel_l2(y, mlp.site(2, x)) < 1e-2
    y_cp = gpu.site(2, cupy.asarray(x))
    assert isinstance(y_cp, cupy.ndarray) and y_cp.device.id == 0
    assert np.array_equal(cupy.asnumpy(y_cp).view(np.uint16), y.view(np.uint16))
    h, h_cp = gpu.step(x), gpu.step(cupy.asarray(x))
    assert np.array_equal(cupy.asnumpy(h_cp).view(np.uint16), h.view(np.uint16))
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    t = torch.from_numpy(x.view(np.int16).copy()).cuda().view(torch.bfloat16)
    y_t = gpu.site(2, t)
    assert isinstance(y_t, torch.Tensor) and y_t.device == t.device and y_t.dtype == torch.bfloat16
    assert np.array_equal(y_t.view(torch.int16).cpu().numpy(), y.view(np.int16))


# ---- under mpiexec -n 2 ------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_two_ranks_agree_with_one(tiny_checkpoint) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    # COMM_WORLD by default; the default topology's layout, world = tp = ep = its size (the README example's test
    # loads the default itself), with a collective timeout below pytest's
    multi = glm_ep.load(tiny_checkpoint, _across(comm.Get_size()))
    single = glm_ep.load(tiny_checkpoint, comm=MPI.COMM_SELF)
    failures: list[str] = []
    x = random_x(21, 7, multi.hidden_size)
    for i in range(multi.num_layers):
        got, want = multi.site(i, x), single.site(i, x)
        blobs = comm.allgather(got.tobytes())
        if any(b != blobs[0] for b in blobs):
            failures.append(f"site {i} differs between ranks")
        if not rel_l2(got, want) < 1e-2:
            failures.append(f"site {i}: rel L2 {rel_l2(got, want):.3e} vs one rank")
        if not elementwise_close(got, want):
            failures.append(f"site {i}: not elementwise close to one rank")
    # chained, routing near-ties may part from the one-rank chain: hold the step to its own sites
    h = multi.step(x)
    if not np.array_equal(h.view(np.uint16), _chain(multi, x).view(np.uint16)):
        failures.append("step differs from the chain of its sites")
    agreed(comm, failures)


@pytest.mark.mpi(min_size=2)
def test_check_calls_refuses_ranks_that_break_the_call_contract(tiny_checkpoint, tiny_checkpoint_dense_nvfp4) -> None:
    """``check_calls = true``: a rank with another layer index, a site where another rank steps, other input bits,
    a call on another loaded model (a draft model's beside a target's: each rank's share of a different model was
    summed, even with the check), or a bad input or index on one rank, is an error on every rank at once (without
    it: a wrong sum, exit 0, or a wait for the deadline); calls that keep the contract give what they give without
    the check."""
    from mpi4py import MPI

    from glm_ep.dist.ranks import AgreedError

    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    checked = glm_ep.load(tiny_checkpoint, topology=Topology(name="checked", world=n, tp=n, ep=n, check_calls=True,
                                                             collective_timeout_s=COLLECTIVE_TIMEOUT_S))
    plain = glm_ep.load(tiny_checkpoint, _across(n, name="plain"))
    draft = glm_ep.load(tiny_checkpoint_dense_nvfp4, topology=Topology(
        name="checked", world=n, tp=n, ep=n, check_calls=True, collective_timeout_s=COLLECTIVE_TIMEOUT_S))
    x = random_x(5, 3, checked.hidden_size)
    failures: list[str] = []
    if not np.array_equal(checked.site(1, x).view(np.uint16), plain.site(1, x).view(np.uint16)):
        failures.append("a checked call gave another result")
    other = random_x(6, 3, checked.hidden_size)
    cases = {"layer": lambda: checked.site(1 if rank == 0 else 2, x),
             "input": lambda: checked.step(x if rank == 0 else other),
             "dtype": lambda: checked.site(0, x if rank == 0 else x.astype(np.float32)),
             "site-step": lambda: checked.site(1, x) if rank == 0 else checked.step(x),
             "index": lambda: checked.site(1 if rank == 0 else 99, x),
             "model": lambda: (checked if rank == 0 else draft).site(0, x)}
    needles = {"layer": "ranks hold different calls (differing: call)", "input": "(differing: input)",
               "dtype": "input is float32 [3, 128], expected bfloat16",
               "site-step": "ranks hold different calls (differing: call)", "index": "site index 99 is out of range",
               "model": "ranks hold different calls (differing: model); expected every rank to make the same call "
                        "with the same input on the same loaded model"}
    for case, call in cases.items():
        try:
            call()
            failures.append(f"{case}: no error on rank {rank}")
        except AgreedError as e:
            if needles[case] not in str(e):
                failures.append(f"{case}: {e}")
        except Exception as e:  # raised on this rank alone: the others would wait in the site's all-reduce
            failures.append(f"{case}: not agreed on rank {rank}: {type(e).__name__}: {e}")
    if not np.array_equal(checked.step(x).view(np.uint16), plain.step(x).view(np.uint16)):
        failures.append("the checked object no longer works after the refusals")
    agreed(comm, failures)


@pytest.mark.mpi(min_size=2)
def test_ranks_whose_calls_differ_at_an_all_reduce_are_refused_on_every_rank(tiny_checkpoint) -> None:
    """Without ``check_calls``: ranks that give a site different row counts (MPI truncated a message, a fatal error
    on one rank after another returned a wrong sum) or call different layers (partials of two sites added, silently)
    are told so on every rank, by the all-reduce's own exchange; the object still works after."""
    from mpi4py import MPI

    from glm_ep.dist.ranks import AgreedError

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    mlp = glm_ep.load(tiny_checkpoint, _across(comm.Get_size()))
    x = random_x(8, 5, mlp.hidden_size)
    want = mlp.site(1, x[:3])
    cases = {"rows": (lambda: mlp.site(1, x[:3 + rank]), ["rank 0: 'layer 1 all-reduce' with 3 rows (384 values)",
                                                           "rank 1: 'layer 1 all-reduce' with 4 rows (512 values)"]),
             "layer": (lambda: mlp.site(1 + rank, x[:3]), ["rank 0: 'layer 1 all-reduce' with 3 rows",
                                                           "rank 1: 'layer 2 all-reduce' with 3 rows"]),
             # chunks of the workspace's 512 rows: the first chunk already differs
             "wide": (lambda: mlp.step(np.concatenate([x] * 120)[:600 - 100 * rank]),
                      ["rank 0: 'layer 0 all-reduce' with 512 rows", "rank 1: 'layer 0 all-reduce' with 500 rows"])}
    failures: list[str] = []
    for case, (call, needles) in cases.items():
        try:
            call()
            failures.append(f"{case}: no error on rank {rank}")
        except AgreedError as e:
            failures += [f"{case}: {n!r} not in {e}" for n in needles + ["expected every rank to make the same call",
                                                                         "a call ahead of the others", "check_calls = true agrees"]
                         if n not in str(e)]
    if not np.array_equal(mlp.site(1, x[:3]).view(np.uint16), want.view(np.uint16)):
        failures.append("the object no longer works after the refusals")
    agreed(comm, failures)


@pytest.mark.mpi(min_size=2)
def test_ranks_of_one_host_share_its_free_memory_at_load(tiny_checkpoint, monkeypatch) -> None:
    """The load counts the ranks that allocate from one host's memory: free memory that holds one rank's
    workspace but not all of theirs is refused on every rank, naming the share; enough for all of them loads."""
    from mpi4py import MPI

    from glm_ep.mlp import runtime as loader
    from glm_ep.config.model import ModelConfig, RankLayout, SiteConfig
    from glm_ep.mlp.site import site_buffers
    from glm_ep.mlp.workspace import ws_total_bytes

    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    model = ModelConfig.from_file(tiny_checkpoint / "config.json")
    need = ws_total_bytes(site_buffers(SiteConfig.for_rank(model, RankLayout(n, comm.Get_rank(), n, n))), 512)
    failures: list[str] = []
    monkeypatch.setattr(loader, "free_memory_bytes", lambda xp: n * need - 1)
    try:
        glm_ep.load(tiny_checkpoint, _across(n))
        failures.append("loaded with less free memory than the ranks' workspaces")
    except GlmEpError as e:
        if f"is free for the {n} ranks that share it" not in str(e):
            failures.append(f"refused otherwise: {e}")
    monkeypatch.setattr(loader, "free_memory_bytes", lambda xp: n * need)
    try:
        glm_ep.load(tiny_checkpoint, _across(n))
    except GlmEpError as e:
        failures.append(f"refused with enough free memory: {e}")
    agreed(comm, failures)


@pytest.mark.mpi(min_size=2)
def test_a_bad_model_path_on_one_rank_is_an_error_on_every_rank(tiny_checkpoint) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    failures: list[str] = []
    try:
        glm_ep.load(tiny_checkpoint if comm.Get_rank() == 0 else None, _across(comm.Get_size()))
        failures.append("loaded")
    except GlmEpError as e:
        if "model_dir = None: expected the checkpoint folder's path" not in str(e):
            failures.append(str(e))
    agreed(comm, failures)


@pytest.mark.mpi(min_size=2)
def test_weights_that_do_not_fit_one_rank_stop_every_rank(tiny_checkpoint, monkeypatch) -> None:
    """A rank whose weights do not fit its device (here: rank 1's upload of a sparse layer runs out of memory) ends
    the load on every rank with the same error naming the layer and what to change, instead of leaving the other
    rank waiting in the next collective."""
    from mpi4py import MPI

    from glm_ep.backend.numpy_backend import NumpyBackend

    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 1:
        def no_memory(self, *args, **kwargs):
            raise MemoryError("Out of memory allocating 1,073,741,824 bytes")
        monkeypatch.setattr(NumpyBackend, "upload_moe", no_memory)
    failures: list[str] = []
    try:
        glm_ep.load(tiny_checkpoint, _across(2))
        failures.append("loaded")
    except GlmEpError as e:
        if not re.search(r"layer \d+: this rank's weights do not fit its device's memory \(Out of memory .*\); "
                         r"spread .* \(on rank 1\)", str(e)):
            failures.append(f"refused otherwise: {e}")
    agreed(comm, failures)

"""Memory a run cannot have: a check mode whose float64 estimate exceeds what each rank has left is refused before
the load (naming the estimate, what is available and the mode that fits), ``auto`` falls back, and a MemoryError
during the load or the check is one clear agreed error, never a traceback.

The large model here is hollow: its shards carry real headers and zeros (files made sparse by ``truncate``, so a
multi-GB checkpoint takes no disk), enough for every check that reads only headers."""

from __future__ import annotations

import json
import resource
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from glm_ep.check.plan import Available, memory_available, plan_check
from glm_ep.config.model import ModelConfig
from glm_ep.dist.ranks import AgreedError, Ranks, run_guarded
from glm_ep.errors import EXIT_USER, ConfigError

from cli_jobs import fails, loaded_weights, mpi_env, write_topology
from helpers import REPO, tiny_dict

GB = 10**9
#: a sparse layer is ~3.2 GB in float64 (256 experts x 3 x 512 x 1024 x 8 bytes), ~114 MB stored NVFP4
LARGE = tiny_dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, n_routed_experts=256,
                  mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
ADDRESS_SPACE = 3 * GB  # ulimit -v of the jobs: far below the full check's estimate, far above a rank's needs
LOAD_SPACE = 700 * 10**6  # ... and one that holds a rank's interpreter (~450 MB) but not its share of the weights


def _hollow_shard(path: Path, specs: dict[str, tuple[str, list[int]]]) -> None:
    size = {"BF16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}
    header, at = {}, 0
    for name, (dtype, shape) in specs.items():
        n = size[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + at)  # zeros, never written: a sparse file


def hollow_checkpoint(out: Path, config: dict) -> Path:
    """``config``'s every MLP tensor, one shard per layer, all zeros."""
    out.mkdir()
    model = ModelConfig.from_dict(config)
    h, m, e = model.hidden_size, model.moe_intermediate_size, model.n_routed_experts
    weight_map = {}
    for i, kind in enumerate(model.mlp_layer_types):
        p, specs = f"model.layers.{i}.mlp", {}
        if kind == "dense":
            n = model.intermediate_size
            specs = {f"{p}.gate_proj.weight": ("BF16", [n, h]), f"{p}.up_proj.weight": ("BF16", [n, h]),
                     f"{p}.down_proj.weight": ("BF16", [h, n])}
        else:
            specs = {f"{p}.gate.weight": ("BF16", [e, h]), f"{p}.gate.e_score_correction_bias": ("F32", [e])}
            s = model.shared_intermediate
            specs |= {f"{p}.shared_experts.gate_proj.weight": ("BF16", [s, h]),
                      f"{p}.shared_experts.up_proj.weight": ("BF16", [s, h]),
                      f"{p}.shared_experts.down_proj.weight": ("BF16", [h, s])}
            for x in range(e):
                for proj, (rows, cols) in (("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m))):
                    q = f"{p}.experts.{x}.{proj}"
                    specs |= {f"{q}.weight": ("U8", [rows, cols // 2]),
                              f"{q}.weight_scale": ("F8_E4M3", [rows, cols // 16]), f"{q}.weight_scale_2": ("F32", [])}
        name = f"model-{i + 1:05d}-of-{len(model.mlp_layer_types):05d}.safetensors"
        _hollow_shard(out / name, specs)
        weight_map |= {k: name for k in specs}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def large(tmp_path_factory) -> Path:
    return hollow_checkpoint(tmp_path_factory.mktemp("large") / "large", LARGE)


def _limited(*args: str, limit_bytes: int = ADDRESS_SPACE) -> subprocess.CompletedProcess:
    """``mpiexec -n 2 glm-ep ARGS`` with every process's address space limited to ``limit_bytes``."""
    local = Path(sys.executable).parent / "mpiexec"
    cmd = [str(local) if local.exists() else "mpiexec", "-n", "2", sys.executable, "-m", "glm_ep", *args]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    env = dict(mpi_env(), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")  # BLAS buffers per core: kept few
    r = subprocess.run(cmd, capture_output=True, timeout=180, env=env, cwd=REPO, preexec_fn=limit)
    # decoded as written: text mode would turn a carriage return into a newline
    return subprocess.CompletedProcess(cmd, r.returncode, r.stdout.decode(errors="replace"),
                                       r.stderr.decode(errors="replace"))


def test_full_check_past_the_memory_left_is_refused_before_the_load(large: Path) -> None:
    r = _limited("run", "--model", str(large), "--check", "full", "--prefill", "8", "--decode", "1", "--verify", "2")
    fails(r, "--check full: the full check's float64 memory estimate is ", " per rank, but ",
          " is available (the address-space limit (ulimit -v) of rank ", "expected --check sampled (its estimate: ")
    assert not loaded_weights(r)


def test_plan_refuses_a_mode_past_what_is_available_and_auto_falls_back() -> None:
    model = ModelConfig.from_dict(LARGE)
    calls = [64, 1, 4]
    full = plan_check(model, "full", calls, seed=0, world=2, budget_bytes=10**15)
    assert full.estimate_bytes > 6 * GB  # the rank holding two sparse layers
    room = Available(2 * GB, "the host's available memory over the 2 rank(s) on h")
    with pytest.raises(ConfigError, match=r"--check full: the full check's float64 memory estimate is 6\.\d+ GB per "
                                          r"rank, but 2\.000 GB is available \(the host's available memory over the 2 "
                                          r"rank\(s\) on h\); expected --check sampled \(its estimate: [\d.]+ MB\), "
                                          "or auto, which picks it"):
        plan_check(model, "full", calls, seed=0, world=2, budget_bytes=10**15, available=room)
    auto = plan_check(model, "auto", calls, seed=0, world=2, budget_bytes=10**15, available=room)
    assert auto.mode == "sampled" and auto.available_bytes == 2 * GB and "available 2.000 GB" in auto.estimate_line()
    assert plan_check(model, "full", calls, 0, 2, 10**15, Available(7 * GB, "x")).mode == "full"
    with pytest.raises(ConfigError, match=r"--check sampled: the sampled check's .* expected --check none"):
        plan_check(model, "sampled", calls, seed=0, world=2, budget_bytes=10**15, available=Available(10**6, "x"))


class _Gathering:
    """``Ranks`` as ``memory_available`` uses it: every rank's (host, host bounds, own limit, held bytes) given."""

    def __init__(self, every: list):
        self.every = every

    def allgather(self, site: str, value):
        return list(self.every)


def test_memory_available_is_the_tightest_bound_of_the_least_rank() -> None:
    every = [("a", [(40 * GB, "the host's available memory")], None, 1 * GB),
             ("a", [(40 * GB, "the host's available memory")], (9 * GB, "the data limit (ulimit -d)"), 0),
             ("b", [(24 * GB, "the host's available memory"), (12 * GB, "the cgroup's memory.max")], None, 2 * GB)]
    got = memory_available(_Gathering(every), 0)
    # rank 0: 40 / 2 - 1 = 19; rank 1: min(20, 9) = 9; rank 2: min(24, 12) - 2 = 10
    assert got == Available(9 * GB, "the data limit (ulimit -d) of rank 1")
    every[2] = ("b", [(24 * GB, "the host's available memory"), (12 * GB, "the cgroup's memory.max")], None, 4 * GB)
    assert memory_available(_Gathering(every), 0) == Available(
        8 * GB, "the cgroup's memory.max over the 1 rank(s) on b, less its load's 4.000 GB")


def test_a_memory_error_in_an_agreed_step_is_a_user_error_on_every_rank() -> None:
    from mpi4py import MPI

    def load() -> None:
        raise MemoryError("Unable to allocate 3.00 GiB for an array with shape (512, 786432) and data type float64")

    with pytest.raises(AgreedError, match=r"out of memory at 'load of layer 1': Unable to allocate 3\.00 GiB") as e:
        Ranks(MPI.COMM_SELF).agree("load of layer 1", load)
    assert not e.value.internal


def test_a_memory_error_anywhere_else_is_one_clear_line(capsys) -> None:
    def main() -> int:
        raise MemoryError()

    assert run_guarded(main, None) == EXIT_USER
    err = capsys.readouterr().err
    assert err.startswith("glm-ep: error: out of memory: MemoryError; expected more free memory per rank")
    assert "Traceback" not in err


def test_a_load_that_runs_out_of_memory_is_a_clear_error(large: Path, tmp_path: Path) -> None:
    """The hollow model's weights, loaded without the weight checks (its scales are zeros) in an address space
    too small for one rank's share of them: the load's MemoryError is an agreed error naming the layer."""
    topo = write_topology(tmp_path / "lax.toml", world=2, tp=2, ep=2, check_weights=False)
    r = _limited("run", "--model", str(large), "--topology", str(topo), "--check", "none", "--decode", "1",
                 limit_bytes=LOAD_SPACE)
    fails(r, "out of memory at 'load of layer ", "expected more free memory per rank")


def test_a_long_load_logs_lines_not_bar_frames(large: Path, tmp_path: Path) -> None:
    """A load of 256 MB and more reports its progress; stderr here is a pipe, not a terminal: no tqdm frames
    (carriage returns) go into it."""
    topo = write_topology(tmp_path / "lax.toml", world=2, tp=2, ep=2, check_weights=False)
    r = _limited("run", "--model", str(large), "--topology", str(topo), "--check", "none", "--prefill", "1",
                 "--decode", "1", "--verify", "1")
    assert r.returncode == 0 and "weights: rank 0 holds 352.33 MB" in r.stderr, r.stderr[-3000:]
    assert "\r" not in r.stderr, r.stderr[-3000:]


def test_run_inputs_past_the_memory_name_the_rows_once(tiny_checkpoint: Path) -> None:
    """``run --prefill`` of more rows than a rank's memory holds: each rank raised its own MemoryError (two error
    lines, an MPI abort, a hint about --check though the check was off), and without a ulimit the kernel killed
    the ranks. Now one agreed error, before anything is drawn, names the flags, the size and what is available;
    a --decode count whose row list alone would not fit is refused the same way, not attempted."""
    r = _limited("run", "--model", str(tiny_checkpoint), "--no-check", "--prefill", "50000000", "--decode", "1")
    fails(r, "--prefill 50000000, --decode 1, --verify 4: the calls take about 102.400 GB a rank (50000005 rows of "
             "hidden 128 kept as bf16, the widest call of 50000000 drawn in float64), but ", " is available (",
          "expected fewer rows")
    assert r.stderr.count("glm-ep: error:") == 1 and "MPI_Abort" not in r.stderr, r.stderr[-2000:]
    r = _limited("run", "--model", str(tiny_checkpoint), "--no-check", "--decode", str(10**11))
    fails(r, f"--decode {10**11}, --verify 4: the calls take about", "expected fewer rows")


def test_a_load_past_the_memory_is_named_not_blamed_on_the_check(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """workspace_rows far past what any rank holds: the check's refusal said "0.00 MB is available ... expected
    --check none", which only moved the failure to the load. The load itself is named, with the lever."""
    topo = write_topology(tmp_path / "wide.toml", world=2, tp=2, ep=2, workspace_rows=99_999_999_999)
    r = _limited("run", "--model", str(tiny_checkpoint), "--topology", str(topo), "--decode", "1")
    fails(r, "the load alone leaves no memory: ", "workspace_rows = 99999999999); expected fewer workspace_rows")
    assert not loaded_weights(r)

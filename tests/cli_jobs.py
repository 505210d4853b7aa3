"""The CLI as the tests run it: ``glm-ep`` (or any module) under ``mpiexec`` with a timeout, its inputs and
outputs as safetensors files, what a failed job must look like (``fails``), and the checkpoint and topology
files a test edits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from glm_ep.errors import EXIT_USER

from helpers import REPO

MPI_TIMEOUT_S = 120


# ---- subprocess MPI jobs -----------------------------------------------------------------------
def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def mpiexec(n: int, *args: str, timeout: float = MPI_TIMEOUT_S, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``mpiexec -n n python <args>`` with a timeout (``subprocess.TimeoutExpired`` fails the test)."""
    local = Path(sys.executable).parent / "mpiexec"  # the venv's MPICH, also when it is not on PATH
    cmd = [str(local) if local.exists() else "mpiexec", "-n", str(n), sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or mpi_env(),
                          cwd=cwd or REPO)


def glm_ep(n: int, *args: str, timeout: float = MPI_TIMEOUT_S, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return mpiexec(n, "-m", "glm_ep", *args, timeout=timeout, cwd=cwd)


def save_hidden(path: Path, x_TH: np.ndarray) -> Path:
    from safetensors.numpy import save_file

    save_file({"hidden_states": np.ascontiguousarray(x_TH)}, str(path))
    return path


def load_outputs(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def glm_ep_per_rank(*per_rank: Sequence[str], timeout: float = MPI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """One ``glm-ep`` argument list per rank, as one MPI job (``mpiexec -n 1 .. : -n 1 ..``)."""
    local = Path(sys.executable).parent / "mpiexec"
    cmd = [str(local) if local.exists() else "mpiexec"]
    for r, args in enumerate(per_rank):
        cmd += ([":"] if r else []) + ["-n", "1", sys.executable, "-m", "glm_ep", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpi_env(), cwd=REPO)


def fails(r: subprocess.CompletedProcess, *needles: str, agreed: bool = True, code: int = EXIT_USER) -> None:
    """The job ended with ``code`` and a clear message holding each needle, never a traceback. An
    agreed error (every rank raised it) is printed exactly once, by rank 0, whole: every needle
    sits in the one message."""
    assert r.returncode == code, (f"exit {r.returncode}, expected {code}; stdout:\n{r.stdout[-1500:]}\n"
                                  f"stderr:\n{r.stderr[-1500:]}")
    for needle in needles:
        assert needle in r.stderr, f"{needle!r} not in stderr:\n{r.stderr[-3000:]}"
    if agreed:
        assert r.stderr.count("glm-ep: error:") == 1, r.stderr[-3000:]
        at = r.stderr.index("glm-ep: error:")
        assert at == 0 or r.stderr[at - 1] == "\n", r.stderr[-3000:]  # its own line, no rank prefix
        message = r.stderr[at:]
        for needle in needles:
            assert needle in message, f"{needle!r} not in the error message:\n{message[:3000]}"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]  # a clear message, not a crash


def loaded_weights(r: subprocess.CompletedProcess) -> bool:
    """Whether the job got as far as reading weights (rank 0 reports what each rank holds)."""
    return "weights: rank 0 holds" in r.stderr


# ---- checkpoint and topology files -------------------------------------------------------------
def copy_checkpoint(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def shard_of(ckpt: Path, key: str) -> Path:
    return ckpt / json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][key]


def set_bits(ckpt: Path, key: str, index: tuple[int, ...], bits: int) -> Path:
    """Overwrite the raw bits of element ``index`` (``...`` slices allowed) of tensor ``key`` in place."""
    from ckpt_writer import read_safetensors, write_safetensors

    shard = shard_of(ckpt, key)
    tensors = read_safetensors(shard)
    dtype, shape, data = tensors[key]
    view = {"BF16": np.uint16, "F32": np.uint32, "F8_E4M3": np.uint8, "U8": np.uint8}[dtype]
    a = np.frombuffer(data, view).reshape(shape).copy()
    a[index] = bits
    tensors[key] = (dtype, shape, a.tobytes())
    write_safetensors(shard, tensors)
    return shard


def write_topology(path: Path, levers: dict[str, Any] | None = None, **values: Any) -> Path:
    """A topology TOML of plain values (json.dumps writes TOML strings, numbers and lists alike)."""
    def line(k: str, v: Any) -> str:
        return f"{k} = {str(v).lower() if isinstance(v, bool) else json.dumps(v)}"

    text = [line(k, v) for k, v in values.items()]
    if levers:
        text += ["[levers]"] + [line(k, v) for k, v in levers.items()]
    path.write_text("\n".join(text) + "\n")
    return path

"""The package as a user gets it: a wheel built from the tree, its contents and metadata, and
``glm-ep run`` from that wheel's files in a folder outside the tree. Also the topologies found by
name, and the error where no MPI library is installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from glm_ep.errors import ConfigError
from glm_ep.config.shipped import shipped_names, topology_path
from glm_ep.config.topology import Topology

from cli_jobs import mpi_env, mpiexec
from helpers import REPO

BUILD_INPUTS = ("setup.cfg", "pyproject.toml", "README.md", "LICENSE", "glm_ep", "configs")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    """(wheel file, the build's output): built by setuptools' PEP 517 backend from a copy of the tree."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, src / name)
    r = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_wheel({str(out)!r})"],
                       cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return next(out.glob("glm_ep-*.whl")), r.stdout + r.stderr


def _tree_files(pattern: str, under: str) -> set[str]:
    return {p.relative_to(REPO / under).as_posix() for p in (REPO / under).rglob(pattern) if "__pycache__" not in p.parts}


def test_wheel_builds_without_warnings(wheel) -> None:
    _, log = wheel
    assert "absent from the `packages` configuration" not in log
    assert not re.findall(r"\w+Warning\b.*", log), re.findall(r"\w+Warning\b.*", log)


def test_wheel_ships_every_module_kernel_topology_and_the_license(wheel) -> None:
    names = set(zipfile.ZipFile(wheel[0]).namelist())
    for pattern in ("*.py", "*.cu", "*.cuh"):
        missing = {f"glm_ep/{f}" for f in _tree_files(pattern, "glm_ep")} - names
        assert not missing, f"not in the wheel: {sorted(missing)}"
    topologies = {f"glm_ep/configs/{f}" for f in _tree_files("*.toml", "configs")}
    assert len(topologies) >= 6 and topologies <= names, sorted(topologies - names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_wheel_metadata_names_the_extras_and_the_command(wheel) -> None:
    z = zipfile.ZipFile(wheel[0])
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in ('Requires-Dist: mpich; extra == "mpi"',
                 'Requires-Dist: cupy-cuda12x[ctk]>=14; extra == "cuda12"',
                 'Requires-Dist: cupy-cuda13x[ctk]>=14; extra == "cuda13"',
                 "License: Apache-2.0"):
        assert line in meta.splitlines(), line
    assert "Requires-Dist: mpich\n" not in meta  # MPI is an extra, not forced over a system MPI
    entry = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "glm-ep = glm_ep.app.cli:main" in entry


def test_run_from_the_wheel_outside_the_tree(wheel, tmp_path) -> None:
    """The wheel's files (a pure wheel installs by unpacking) alone on the path, run from another
    folder: the package, its kernels and ``--topology cpu-2`` come from the wheel, not the tree."""
    site, work = tmp_path / "site", tmp_path / "work"
    zipfile.ZipFile(wheel[0]).extractall(site)
    work.mkdir()
    env = {**mpi_env(), "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import glm_ep.config.shipped as t; print(t.shipped_dir())"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip() == str(site / "glm_ep" / "configs"), where.stderr[-2000:]
    r = mpiexec(2, "-m", "glm_ep", "run", "--topology", "cpu-2", "--prefill", "8", "--decode", "2",
                "--verify", "2", cwd=work, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.rstrip().endswith("PASS"), r.stdout[-2000:]
    assert (work / ".cache" / "tiny" / "config.json").is_file()


def test_topologies_by_name_from_any_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert {"single", "cpu-2", "gb10-2", "h100-1", "h200-1", "h200-2", "h200-1x2"} <= set(shipped_names())
    assert topology_path("gb10-2") == topology_path("gb10-2.toml") == REPO / "configs" / "gb10-2.toml"
    assert Topology.load("gb10-2") == Topology.load(REPO / "configs" / "gb10-2.toml")
    own = tmp_path / "gb10-2.toml"  # a file of one's own wins over the shipped one
    own.write_text('name = "mine"\nworld = 4\ntp = 2\nep = 4\n')
    assert Topology.load("gb10-2.toml").name == "mine"
    with pytest.raises(ConfigError, match=r"gb10-3: topology file not found, and no shipped topology has that "
                                          r"name \(shipped: .*gb10-2"):
        Topology.load("gb10-3")
    with pytest.raises(ConfigError, match="topology file not found"):  # a path is never read as a name
        Topology.load("elsewhere/cpu-2")


def test_no_mpi_library_is_one_clear_error(tmp_path) -> None:
    env = {**mpi_env(), "MPI4PY_LIBMPI": str(tmp_path / "libmpi.so")}
    env.pop("MPI4PY_MPIABI", None)
    r = subprocess.run([sys.executable, "-m", "glm_ep", "run"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("glm-ep: error: no MPI library found (mpi4py: cannot load MPI library)")
    assert "pip install '.[mpi]' from the glm_ep checkout" in err[0]
    assert not (tmp_path / ".cache").exists()

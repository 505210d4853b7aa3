"""Shared fixtures."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest

from glm_ep.config.presets import preset
from glm_ep.checkpoint.synth import write_synthetic


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny`` preset, seed 0, in several shards. Read-only: copy it before changing files."""
    return write_synthetic(tmp_path_factory.mktemp("ckpt") / "tiny", preset("tiny"), seed=0,
                           shard_bytes=256 * 1024)


@pytest.fixture(scope="session")
def tiny_checkpoint_dense_nvfp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same with the dense FFNs stored NVFP4 (ModelOpt's nvfp4_experts_dense_mlp recipe). Read-only."""
    return write_synthetic(tmp_path_factory.mktemp("ckpt") / "tiny-dense-nvfp4", preset("tiny"), seed=0,
                           shard_bytes=256 * 1024, dense="nvfp4")


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator seeded from the test's name: fresh inputs per test, the same on every run."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-mpi skips a test without ``--with-mpi`` where "mpi" is among its keywords, and a test's keywords hold
    the names of the folders it sits in: every test of ``tests/mpi/`` was skipped, the single-rank ones too. Only a
    test marked ``mpi`` waits for ``--with-mpi``."""
    for item in items:
        if item.get_closest_marker("mpi") is None:
            item.own_markers = [m for m in item.own_markers
                                if not (m.name == "skip" and m.kwargs.get("reason") == "need --with-mpi option to run")]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Where a collected test reads the kernel builds (``tests/cuda/test_kernels_build.py``), start them now, at a low
    priority: they run on what the tests before them leave idle instead of all at once when the first one asks."""
    import _kernel_builds

    if (_kernel_builds.HAVE_NVCC and not session.config.option.collectonly
            and any(_kernel_builds.FIXTURE in getattr(item, "fixturenames", ()) for item in session.items)):
        _kernel_builds.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    import _kernel_builds

    _kernel_builds.close()


@pytest.fixture(params=["shipped", "gemv"])
def small_weight_engine(request, monkeypatch):
    """Weights of the shared expert's size at 5..8 rows on the shipped engine (the warp-streaming GEMM), or with
    it off (``WSTREAM_SMALL_MIN_ROWS = 0``: the batch-M GEMV kernels, which K off the 32-k steps still takes)."""
    from glm_ep.backend.cuda import dense

    if request.param == "gemv":
        monkeypatch.setattr(dense, "WSTREAM_SMALL_MIN_ROWS", 0)
    return request.param

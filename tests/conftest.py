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

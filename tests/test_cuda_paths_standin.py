"""The CUDA path tests' own logic on CPU: ``test_cuda_paths``' stack-level tests (their model configs, weights,
expected paths, graph expectations and comparisons) run with a NumPy backend that captures as the CUDA one does
(``CapturingNumpy``, the CUDA capabilities) in place of the GPU. A CUDA test whose own set-up is wrong (a model
config the loader refuses, a path it does not expect) then fails here, in CI, instead of on the next device run.
The kernels themselves are only tested on a GPU; the tests that need one (programmatic dependent launch, NCCL,
two ranks, the device's shared memory) are not repeated here.
"""

from __future__ import annotations

import numpy as np
import pytest

import test_cuda_paths as T
from helpers import CapturingNumpy


@pytest.fixture
def standin(monkeypatch):
    """``backend``, ``dev`` and ``host`` of ``test_cuda_paths`` on a capturing NumPy backend (one per test)."""
    be = CapturingNumpy()
    monkeypatch.setattr(T, "backend", lambda: be)
    monkeypatch.setattr(T, "dev", lambda a: np.array(a, copy=True))
    monkeypatch.setattr(T, "host", lambda a: np.array(a, copy=True))
    return be


@pytest.mark.parametrize("rows", [1, 4, 8, 20, 300])
@pytest.mark.parametrize("site", [0, 1], ids=["dense", "sparse"])
def test_site_paths(standin, rows, site):
    T.test_site_paths(T.single_rank(), rows, site)


@pytest.mark.parametrize("rows,min_rows", [(20, 9), (300, 128), (2000, 10**6)])
def test_prefill_paths(standin, rows, min_rows):
    T.test_prefill_paths(rows, min_rows)


def test_host_dispatch(standin):
    T.test_host_dispatch(3)


@pytest.mark.parametrize("rows", [1, 4])
def test_graph_replay(standin, rows):
    T.test_graph_replay(rows)
    assert standin.captured == 1


@pytest.mark.parametrize("rows", [1, 4])
def test_site_graph_replay(standin, rows):
    T.test_site_graph_replay(rows)
    assert standin.captured == 3


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 20, 40, 300])
@pytest.mark.parametrize("hidden,width", [(256, 384), (512, 1024)], ids=["block-kernels", "ring"])
def test_nvfp4_dense_site(standin, rows, hidden, width):
    T.test_nvfp4_dense_site(rows, hidden, width)
    assert standin.captured == (1 if rows <= 8 else 0)

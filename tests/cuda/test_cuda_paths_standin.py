"""The CUDA path tests' own logic on CPU: ``test_cuda_paths``' stack-level tests (their model configs, weights,
expected paths, graph expectations and comparisons) run with a NumPy backend that captures as the CUDA one does
(``CapturingNumpy``, the CUDA capabilities) in place of the GPU. A CUDA test whose own set-up is wrong (a model
config the loader refuses, a path it does not expect) then fails here, in CI, instead of on the next device run.
The kernels themselves are only tested on a GPU; the tests that need one (programmatic dependent launch, NCCL,
two ranks, the device's shared memory) are not repeated here.

On the GPU those tests hold the CUDA stack against a NumPy stack on the same weights. Here the "CUDA" side IS a
NumPy stack, so that comparison would hold the code against itself; the stand-in swaps the oracle for the tests'
own float64 model (``helpers.site64``, shares no code with the backends) on the same full weights, at the
relative-L2 tolerance the float64 comparisons use elsewhere (``assert_close``'s 1e-2, as in ``test_paths``).
"""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.dist.comm import SelfComm
from glm_ep.config.model import RankLayout, SiteConfig

import test_cuda_paths as T
from helpers import CapturingNumpy, RefParams, ref64_layers, site64, step64


class Float64Stack:
    """The oracle the shared test bodies compare with, in place of their NumPy stack: ``site_output`` is the float64
    site (``site64``), ``step`` the float64 chain ``h = h + site(h)`` (``step64``), on the same full weights."""

    def __init__(self, full, model):
        self.layers, self.params = ref64_layers(full), RefParams.of(model)

    def site_output(self, i: int, x: np.ndarray) -> np.ndarray:
        return site64(self.layers[i], self.params, x)

    def step(self, x: np.ndarray) -> np.ndarray:
        return step64(self.layers, self.params, x)


class _NoNumpyOracle:
    """``test_cuda_paths.NumpyBackend`` here: a marker the stand-in's oracle builders take for "the oracle"; a
    shared body that still computed with it (its NumPy twin, the stand-in compared with itself) fails instead."""

    def __getattr__(self, name):
        pytest.fail(f"a test_cuda_paths body used its NumpyBackend oracle ({name}); the stand-in compares with "
                    "float64")


@pytest.fixture
def standin(monkeypatch):
    """``backend``, ``dev`` and ``host`` of ``test_cuda_paths`` on a capturing NumPy backend (one per test), and
    their NumPy oracle stacks replaced by ``Float64Stack`` on the same full weights."""
    be = CapturingNumpy()
    monkeypatch.setattr(T, "backend", lambda: be)
    monkeypatch.setattr(T, "dev", lambda a: np.array(a, copy=True))
    monkeypatch.setattr(T, "host", lambda a: np.array(a, copy=True))

    def single_rank(levers=T.PathLevers(), layer_types=("dense", "sparse"), router_dtype=np.float32, seed=7,
                    max_rows=T.MAX_ROWS):
        m = T.model(layer_types)
        cfg = SiteConfig.for_rank(m, RankLayout(1, 0, 1, 1))
        weights = T.full_weights(seed, layer_types, router_dtype)
        return T.build_stack(be, SelfComm(), cfg, weights, levers, max_rows), Float64Stack(weights, m)

    real_nvfp4_dense_stack = T._nvfp4_dense_stack

    def nvfp4_dense_stack(backend, cfg, w, levers=T.PathLevers()):
        if backend is be:
            return real_nvfp4_dense_stack(backend, cfg, w, levers)
        assert isinstance(backend, _NoNumpyOracle), backend
        return Float64Stack([w], T.model(("dense",), cfg.hidden, cfg.local_dense_intermediate))  # tp = 1

    monkeypatch.setattr(T, "single_rank", single_rank)
    monkeypatch.setattr(T, "_nvfp4_dense_stack", nvfp4_dense_stack)
    monkeypatch.setattr(T, "NumpyBackend", _NoNumpyOracle)
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

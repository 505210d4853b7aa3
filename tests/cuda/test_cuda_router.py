"""The router on CUDA against its NumPy twin: the logits GEMV, the top-k, and the two fused in one
launch (1..8 rows), which must give the separate ops' logits, ids and weights bit for bit, launch
after launch and replay after replay of a captured graph (its block counter resets itself); and the
same launch carrying the shared expert's gate + up + SwiGLU, equal to ``route`` then ``gate_up_act``.
"""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.mlp import routing
from glm_ep.backend.cuda import route_kernels as route
from glm_ep.backend.cuda import dense
from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.mlp.routing import RouteParams
from glm_ep.checkpoint.weights import DenseWeights

from _cuda import assert_written, backend, cupy, dev, host, poisoned, requires_cuda, spy_launches
from helpers import BF16, assert_close, assert_ulps, rand_bf16

pytestmark = [pytest.mark.cuda, requires_cuda]

NP = NumpyBackend()


# ---- router -------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [1, 3, 8, 20, 64, 100])
@pytest.mark.parametrize("router_dtype", [np.float32, BF16])
@pytest.mark.parametrize("h", [256, 4096])
def test_router_logits(rng, t, router_dtype, h):
    e = 288
    x = rand_bf16(rng, (t, h))
    router = (rng.standard_normal((e, h)) / np.sqrt(h)).astype(router_dtype)
    ref = np.empty((t, e), np.float32)
    NP.router_logits(x, router, ref)
    out = poisoned((t, e), np.float32)
    backend().router_logits(dev(x), dev(router), out)
    got = host(out)
    assert_written(got, "logits")
    assert_close(got, ref, "router logits", tol=1e-5)


def _topk_inputs(rng, t, e):
    logits = rng.standard_normal((t, e)).astype(np.float32)
    bias = (7.0 + 0.01 * rng.standard_normal(e)).astype(np.float32)
    bias[1::7] = bias[0]  # exact bias ties
    logits[0] = 0.25  # a row of exact ties: every choice equal up to the bias ties
    logits[1, 3:e:2] = logits[1, 2]
    logits[2, [0, 5, 7, 11]] = np.nan  # NaN choices rank below every number
    logits[3] = np.nan  # all NaN: the lowest ids, NaN weights
    logits[4, :] = -np.inf
    logits[5, 9] = np.inf
    return logits, bias


@pytest.mark.parametrize("top_k", [1, 8, 16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("ladder", [False, True])
@pytest.mark.parametrize("e", [32, 288])
def test_router_topk(rng, top_k, renormalize, ladder, e):
    t = 12
    logits, bias = _topk_inputs(rng, t, e)
    p = RouteParams(top_k, 2.5, renormalize, ladder)
    ref_ids, ref_wts = routing.router_topk(logits, bias, p)
    ids, wts = poisoned((t, top_k), np.int32), poisoned((t, top_k), np.float32)
    backend().router_topk(dev(logits), dev(bias), p, ids, wts)
    got_ids, got_wts = host(ids), host(wts)
    np.testing.assert_array_equal(got_ids, ref_ids)
    assert ((got_ids >= 0) & (got_ids < e)).all()
    assert all(len(set(r)) == top_k for r in got_ids.tolist()), "duplicate ids in a row"
    if ladder:
        assert_ulps(got_wts, ref_wts, "ladder weights")
    else:
        np.testing.assert_allclose(got_wts, ref_wts, rtol=1e-5, equal_nan=True)


# ---- the router GEMV and its top-k in one launch --------------------------------------------------
def _router(rng, e, h, dtype):
    """A router with exact ties: every 7th row repeats row 0, so their logits tie exactly."""
    w = (rng.standard_normal((e, h)) / np.sqrt(h)).astype(dtype)
    w[7::7] = w[0]
    bias = (7.0 + 0.01 * rng.standard_normal(e)).astype(np.float32)
    bias[7::7] = bias[0]  # the tied rows tie on the choice too: the lower id wins
    return w, bias


def _route_both(x, router, bias, p, t, e):
    """(fused, separate): each (logits, ids, wts) on the host, from poisoned outputs."""
    be, out = backend(), []
    for fused in (True, False):
        logits, ids, wts = poisoned((t, e), np.float32), poisoned((t, p.top_k), np.int32), \
            poisoned((t, p.top_k), np.float32)
        if fused:
            be.route(x, router, bias, p, logits, ids, wts)
        else:
            be.router_logits(x, router, logits)
            be.router_topk(logits, bias, p, ids, wts)
        out.append(tuple(host(a) for a in (logits, ids, wts)))
    return out


def _assert_same(fused, separate, what):
    for name, a, b in zip(("logits", "ids", "weights"), fused, separate):
        assert_written(a, f"{what}: {name}")
        np.testing.assert_array_equal(a.view(np.uint32) if a.dtype != np.int32 else a,
                                      b.view(np.uint32) if b.dtype != np.int32 else b, err_msg=f"{what}: {name}")


@pytest.mark.parametrize("t", [1, 2, 5, 8])
@pytest.mark.parametrize("router_dtype", [np.float32, BF16])
@pytest.mark.parametrize("e,h,top_k", [(32, 256, 8), (288, 4096, 8), (288, 256, 16)])
@pytest.mark.parametrize("ladder", [False, True])
def test_route_fused(rng, t, router_dtype, e, h, top_k, ladder):
    router, bias = _router(rng, e, h, router_dtype)
    p = RouteParams(top_k, 2.5, True, ladder)
    x = rand_bf16(rng, (t, h))
    if t > 1:
        x[t - 1] = 0  # a row of all-zero logits: every choice ties up to the bias
    fused, separate = _route_both(dev(x), dev(router), dev(bias), p, t, e)
    _assert_same(fused, separate, f"{t} rows")
    ref_ids, ref_wts = routing.router_topk(fused[0], bias, p)  # the twin on the same logits
    np.testing.assert_array_equal(fused[1], ref_ids)
    if ladder:
        assert_ulps(fused[2], ref_wts, "ladder weights")
    else:
        np.testing.assert_allclose(fused[2], ref_wts, rtol=1e-5)
    logits = np.empty((t, e), np.float32)
    NP.router_logits(x, router, logits)
    assert_close(fused[0], logits, "fused logits", tol=1e-5)


def test_route_fused_back_to_back_and_replayed(rng):
    """The block counter: 6 launches in a row on fresh inputs, then a captured launch replayed on
    new inputs copied into its buffers, each equal to the separate ops."""
    e, h, t = 288, 4096, 3
    be = backend()
    router, bias = _router(rng, e, h, np.float32)
    router, bias = dev(router), dev(bias)
    p = RouteParams(8, 2.5, True, False)
    for i in range(6):
        fused, separate = _route_both(dev(rand_bf16(rng, (t, h))), router, bias, p, t, e)
        _assert_same(fused, separate, f"launch {i}")
    x = dev(rand_bf16(rng, (t, h)))
    logits, ids, wts = cupy.empty((t, e), np.float32), cupy.empty((t, 8), np.int32), cupy.empty((t, 8), np.float32)
    replay = be.capture(lambda: be.route(x, router, bias, p, logits, ids, wts))
    for i in range(4):
        xi = rand_bf16(rng, (t, h))
        be.from_host(x, xi)
        replay()
        got = tuple(host(a) for a in (logits, ids, wts))
        _, separate = _route_both(dev(xi), router, bias, p, t, e)
        _assert_same(got, separate, f"replay {i}")


# ---- the router and the shared expert's gate + up in one launch ----------------------------------
def _route_glu_both(x, router, bias, p, shared, t, e, limit=7.0):
    """(fused, separate): (logits, ids, wts, gate, up, act) on the host, from poisoned outputs; the
    fused call must take the one-launch kernel, unless the warp-streaming GEMM takes the GLU (then the fused
    router alone, and that GEMM)."""
    be, n, out = backend(), shared.gate.shape[0], []
    for fused in (True, False):
        logits, ids, wts = poisoned((t, e), np.float32), poisoned((t, p.top_k), np.int32), \
            poisoned((t, p.top_k), np.float32)
        gate, up, act = (poisoned((t, n), BF16) for _ in range(3))
        if fused:
            with pytest.MonkeyPatch.context() as mp:
                launches = spy_launches(mp, route)  # the router's kernels (not the warp-streaming GEMM's)
                be.route_and_gate_up_act(x, router, bias, p, logits, ids, wts, shared, limit, gate, up, act)
            wtag = "f32w" if router.dtype == np.float32 else "bf16w"
            want = f"router_topk_{wtag}_r{t}" if dense.wstream_takes(x, shared.gate, glu=True) else \
                f"router_topk_glu_{wtag}_r{t}"
            assert launches == [want], f"route_and_gate_up_act launched {launches}, expected [{want}]"
        else:
            be.route(x, router, bias, p, logits, ids, wts)
            be.gate_up_act(x, shared, limit, gate, up, act)
        out.append(tuple(host(a) for a in (logits, ids, wts, gate, up, act)))
    return out


def _assert_same_glu(fused, separate, what):
    _assert_same(fused[:3], separate[:3], what)
    for name, a, b in zip(("gate", "up", "act"), fused[3:], separate[3:]):
        assert_written(a, f"{what}: {name}")
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=f"{what}: {name}")


def _shared(rng, n, h):
    """A shared expert on the device whose gate/up outputs reach the SwiGLU clamp (limit 7) now and then."""
    g = 4 * h ** -0.5
    return backend().upload_dense(DenseWeights(rand_bf16(rng, (n, h), g), rand_bf16(rng, (n, h), g),
                                               rand_bf16(rng, (h, n), n ** -0.5)))


@pytest.mark.parametrize("t", [1, 3, 4, 5, 8])
@pytest.mark.parametrize("router_dtype", [np.float32, BF16])
@pytest.mark.parametrize("e,h,n", [(32, 256, 128), (288, 4096, 2048)])
def test_route_and_glu_fused(rng, t, router_dtype, e, h, n, small_weight_engine):
    router, bias = _router(rng, e, h, router_dtype)
    p = RouteParams(8, 2.5, True, False)
    x = rand_bf16(rng, (t, h))
    shared = _shared(rng, n, h)
    fused, separate = _route_glu_both(dev(x), dev(router), dev(bias), p, shared, t, e)
    _assert_same_glu(fused, separate, f"{t} rows")
    gate, up, act = (np.empty((t, n), BF16) for _ in range(3))  # the GLU against its NumPy twin
    NP.gate_up_act(x, NP.upload_dense(DenseWeights(host(shared.gate), host(shared.up), host(shared.down))), 7.0,
                   gate, up, act)
    assert_close(fused[5], act, "fused act", tol=1e-2)


def test_route_and_glu_fused_back_to_back_and_replayed(rng):
    """The fused router's block counter shared by both fused launches: alternating launches, then
    a captured pair replayed on new inputs, each equal to the separate ops."""
    e, h, t, n = 288, 4096, 2, 2048
    be = backend()
    router, bias = _router(rng, e, h, BF16)
    router, bias = dev(router), dev(bias)
    shared = _shared(rng, n, h)
    p = RouteParams(8, 2.5, True, False)
    for i in range(3):
        x = dev(rand_bf16(rng, (t, h)))
        fused, separate = _route_glu_both(x, router, bias, p, shared, t, e)
        _assert_same_glu(fused, separate, f"launch {i}")
        fused, separate = _route_both(x, router, bias, p, t, e)
        _assert_same(fused, separate, f"router launch {i}")
    x = dev(rand_bf16(rng, (t, h)))
    outs = [(cupy.empty((t, e), np.float32), cupy.empty((t, 8), np.int32), cupy.empty((t, 8), np.float32))
            for _ in range(2)]  # the fused launch's router outputs, then the plain router's
    gate, up, act = (cupy.empty((t, n), BF16) for _ in range(3))

    def pair():
        be.route_and_gate_up_act(x, router, bias, p, *outs[0], shared, 7.0, gate, up, act)
        be.route(x, router, bias, p, *outs[1])

    replay = be.capture(pair)
    for i in range(3):
        xi = rand_bf16(rng, (t, h))
        be.from_host(x, xi)
        replay()
        got = tuple(host(a) for a in (*outs[0], gate, up, act))
        _, separate = _route_glu_both(dev(xi), router, bias, p, shared, t, e)
        _assert_same_glu(got, separate, f"replay {i}")
        _assert_same(tuple(host(a) for a in outs[1]), separate[:3], f"replay {i}, plain router")


def test_route_wide_rows(rng):
    """Past the GEMV tiers ``route`` is the two separate ops (cuBLAS's fp32 logits, then the top-k)."""
    e, h, t = 32, 256, 20
    router, bias = _router(rng, e, h, BF16)
    p = RouteParams(8, 2.5, True, False)
    x = rand_bf16(rng, (t, h))
    logits, ids, wts = poisoned((t, e), np.float32), poisoned((t, 8), np.int32), poisoned((t, 8), np.float32)
    backend().route(dev(x), dev(router), dev(bias), p, logits, ids, wts)
    got_logits, got_ids, got_wts = host(logits), host(ids), host(wts)
    ref = np.empty((t, e), np.float32)
    NP.router_logits(x, router, ref)
    assert_close(got_logits, ref, "logits", tol=1e-5)
    ref_ids, ref_wts = routing.router_topk(got_logits, bias, p)
    np.testing.assert_array_equal(got_ids, ref_ids)
    np.testing.assert_allclose(got_wts, ref_wts, rtol=1e-5)

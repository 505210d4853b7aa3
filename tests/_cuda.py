"""The CUDA tests' device side: the skip logic (CuPy and a visible device, or skip with the reason),
one backend per process, copies to and from it, and poisoned outputs that catch unwritten elements.
The comparisons against the NumPy twins (``assert_close``, ``assert_ulps``) are in ``helpers``;
the random NVFP4 expert tables the kernel tests share (``moe_weights``) are here."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from glm_ep.checkpoint import nvfp4
from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.checkpoint.weights import DenseWeights, ExpertWeights, MoeWeights

from helpers import BF16, assert_close, rand_bf16, tiny_model

#: the kernel tests' shape: hidden, moe width, experts, top-k (plus GLM-5.3-Flash's where named)
H, M, E, TOP_K = 256, 128, 32, 8


def _probe():
    try:
        import cupy
    except Exception as e:  # not installed, or built for another CUDA
        return None, f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return None, f"no CUDA device ({type(e).__name__}: {e})"
    return (cupy, "") if n > 0 else (None, "no CUDA device")


cupy, _REASON = _probe()
#: apply as ``pytestmark = [pytest.mark.cuda, requires_cuda]``
requires_cuda = pytest.mark.skipif(cupy is None, reason=_REASON or "CUDA available")


@functools.cache
def backend():
    """One CudaBackend per process (its ops queue on its own stream, never CuPy's current one). Its ring takes
    any launch the kernels are built for (``min_items_per_sm = 0``), so the tests' small shapes run on it; its
    kernels' scratch is bound for the kernel tests' shape (``bind_scratch``; a stack built on it binds its own)."""
    from glm_ep.backend.cuda import CudaBackend, RingConfig

    be = CudaBackend(0, RingConfig(min_items_per_sm=0))
    bind_scratch(be)
    return be


def bind_scratch(be, hidden: int = H, moe_width: int = M, shared_width: int = M, experts: int = E) -> dict:
    """Hand ``be`` the scratch its kernels need for sites of this shape, made as the workspace makes it at load
    (``workspace_pool`` binds it; a test that calls the backend's ops directly binds here), for calls from the
    grouped GEMM's first rows (``prefill_gemm_min_rows``: the multi-block sort's counts included); by name."""
    from glm_ep.config.model import RankLayout, SiteConfig
    from glm_ep.config.topology import PathLevers
    from glm_ep.mlp.workspace import made

    model = tiny_model(hidden_size=hidden, moe_intermediate_size=moe_width, n_routed_experts=experts)
    cfg = SiteConfig.for_rank(model, RankLayout(1, 0, 1, 1))
    cfg = dataclasses.replace(cfg, local_shared_intermediate=shared_width)
    levers = PathLevers()
    scratch = made(be, be.buffers(cfg, levers), levers.prefill_gemm_min_rows)
    be.bind(scratch)
    return scratch


def spy_launches(monkeypatch, module) -> list[str]:
    """The entry names ``module.launch`` is called with from now on, in order (each launch still runs)."""
    entries: list[str] = []
    real = module.launch

    def spy(file, entry, *args, **kwargs):
        entries.append(entry)
        return real(file, entry, *args, **kwargs)

    monkeypatch.setattr(module, "launch", spy)
    return entries


def dev(a: np.ndarray):
    return backend().asarray(a)


def host(a) -> np.ndarray:
    return backend().to_host(a)


def both(w: MoeWeights, be=None, limit: float = 10.0):
    """The routed-expert tables of ``w`` on the CUDA backend (``be``, default the shared one; the
    ring's operand forms chosen for ``swiglu_limit = limit``) and on NumPy: (cuda, numpy)."""
    return (be or backend()).upload_moe(w, limit).experts, NumpyBackend().upload_moe(w, limit).experts


def claims_pair(ring: dict, hidden: int, moe_width: int):
    """Two backends on the shared backend's stream with the ring levers ``ring``, each with its scratch bound: one
    whose ring launches claim their items (``ring_claims``), one at a fixed stride; and the first's scratch."""
    from glm_ep.backend.cuda import CudaBackend, RingConfig

    claimed = CudaBackend(0, RingConfig(**ring), stream=backend().stream)
    scratch = bind_scratch(claimed, hidden=hidden, moe_width=moe_width)
    fixed = CudaBackend(0, RingConfig(**ring, claims=False), stream=backend().stream)
    bind_scratch(fixed, hidden=hidden, moe_width=moe_width)
    assert claimed._claims() is not None and fixed._claims() is None
    return claimed, fixed, scratch


def assert_claims_match(claimed, fixed, run, outs, claims, claiming: bool, what: str, rows: dict | None = None) -> None:
    """``run(be)`` (the ops under test, writing gate, up, act and down into ``outs[be]``) once at the fixed stride,
    then on ``claimed``: launched, launched again and replayed from a graph, its outputs poisoned before each. Every
    output is bit for bit the fixed stride's (``rows``: the rows compared, by output name) and the claim counter
    ``claims`` is zero after each. Then the counter is read where the launches claim (``claiming``) and only there:
    set to 1 before a launch, it hands out one item fewer (an output is left poisoned) and is zero after; where the
    launches take the fixed stride, the outputs are the same and the counter is untouched."""
    names = ("gate", "up", "act", "down")

    def compared(arrays) -> list:  # the outputs' bits, the rows compared of each
        return [host(o).view(np.uint16)[(rows or {}).get(name, slice(None))] for name, o in zip(names, arrays)]

    def launch(replay=None) -> list:
        for o in outs[claimed]:
            cupy.cuda.runtime.memsetAsync(o.data.ptr, 0xFF, o.nbytes, claimed.stream.ptr)
        replay() if replay is not None else run(claimed)
        return compared(outs[claimed])

    run(fixed)
    want = compared(outs[fixed])
    run(claimed)  # loads the kernels outside the capture
    replay = claimed.capture(lambda: run(claimed))
    for label in ("launch", "launch again", "replay", "replay again"):
        got = launch(replay if label.startswith("replay") else None)
        for name, g, ref in zip(names, got, want):
            np.testing.assert_array_equal(g, ref, err_msg=f"{what}, {label}: {name}")
        assert not host(claims).any(), f"{what}, {label}: the claim counter was left non-zero"
    with claimed.stream:
        claims[:1].fill(1)
    got = launch()  # the counter at 1
    same = all(np.array_equal(g, ref) for g, ref in zip(got, want))
    if claiming:
        assert not same, f"{what}: a launch that claims handed out every item from a counter at 1"
        assert not host(claims).any(), f"{what}: the claim counter was left non-zero"
    else:
        assert same, f"{what}: a fixed-stride launch read the claim counter"
        assert host(claims)[0] == 1, f"{what}: a fixed-stride launch touched the claim counter"
        with claimed.stream:
            claims.fill(0)


def poisoned(shape, dtype):
    """A device buffer whose every byte is 0xFF (NaN for bf16/fp32) or, for int32, 0x7B7B7B7B:
    a value no kernel writes, so an element left unwritten is caught."""
    a = cupy.empty(shape, dtype=dtype)
    byte = 0x7B if np.dtype(dtype) == np.int32 else 0xFF
    cupy.cuda.runtime.memsetAsync(a.data.ptr, byte, a.nbytes, backend().stream.ptr)  # in order with the ops
    return a


def unwritten(a: np.ndarray) -> np.ndarray:
    """Mask of elements still holding the poison."""
    if a.dtype == np.int32:
        return a == 0x7B7B7B7B
    bits = a.view(np.uint16 if a.dtype == BF16 else np.uint32)
    return bits == (0xFFFF if a.dtype == BF16 else 0xFFFFFFFF)


def assert_written(a: np.ndarray, what: str) -> None:
    bad = unwritten(a)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {a.size} elements left unwritten"


def quant(rng, n, k):
    return nvfp4.quantize((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))


def moe_weights(rng, h=H, m=M, start=0, count=E, num_experts=E, router_dtype=np.float32):
    experts = tuple(ExpertWeights(quant(rng, m, h), quant(rng, m, h), quant(rng, h, m)) for _ in range(count))
    shared = DenseWeights(rand_bf16(rng, (m, h), h ** -0.5), rand_bf16(rng, (m, h), h ** -0.5),
                          rand_bf16(rng, (h, m), m ** -0.5))
    router = (rng.standard_normal((num_experts, h)) / np.sqrt(h)).astype(router_dtype)
    bias = (7.0 + 0.01 * rng.standard_normal(num_experts)).astype(np.float32)
    return MoeWeights(router, bias, start, experts, shared)


# ---- the decode checks the kernel and ring tests share ----------------------------------------------
def check_moe_gemv(rng, cu, nu, proj, per_slot, ids, local, label, be=None):
    """One decode moe_gemv against NumPy: local slots within bf16 rounding, remote rows untouched."""
    pc, pn = getattr(cu, proj), getattr(nu, proj)
    kin, n = pn.weights[0].shape[1], pn.weights[0].shape[0]
    x = rand_bf16(rng, (TOP_K if per_slot else 1, kin))
    ref = np.zeros((TOP_K, n), BF16)
    NumpyBackend().moe_gemv(x, pn, ids, ref, per_slot)
    out = poisoned((TOP_K, n), BF16)
    (be or backend()).moe_gemv(dev(x), pc, dev(ids), out, per_slot)
    got = host(out)
    assert unwritten(got[~local]).all(), f"{label}: a remote slot's output was written"
    assert_written(got[local], label)
    assert_close(got[local], ref[local], label)


def check_moe_gate_up_act(rng, cu, nu, ids, local, h, m, label, be=None):
    """Decode gate + up + SwiGLU against NumPy; act rows of remote slots are unspecified."""
    x = rand_bf16(rng, (1, h), 3.0)
    refs = [np.zeros((TOP_K, m), BF16) for _ in range(3)]
    NumpyBackend().moe_gate_up_act(x, nu, ids, 1.0, *refs)
    outs = [poisoned((TOP_K, m), BF16) for _ in range(3)]
    (be or backend()).moe_gate_up_act(dev(x), cu, dev(ids), 1.0, *outs)
    for name, o, r in zip(("gate", "up", "act"), outs, refs):
        got = host(o)
        if name != "act":
            assert unwritten(got[~local]).all(), f"{label} {name}: a remote slot was written"
        assert_written(got[local], name)
        assert_close(got[local], r[local], f"{label} {name}")

"""The routed experts' kernels outside the ring and the grouped GEMM: the block-per-tile NVFP4 GEMVs of one row
(gemv_nvfp4.cu), the sort by expert (moe_route.cu) and the sorted path, against their NumPy twins
(NumpyBackend.moe_gemv, moe_gate_up_act, sort_by_expert, moe_gemm_sorted, expert_linear) on fresh random
inputs: outputs poisoned before each run, ids and the sort exact, values within bf16 rounding. Shapes: H=256,
moe_inter=128, E=32, top_k=8, and GLM-5.3-Flash's (H=4096, moe_inter=2048) for the decode GEMV."""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.checkpoint import nvfp4
from glm_ep.mlp import routing
from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.errors import ConfigError

from _cuda import (E, H, M, TOP_K, assert_written, backend, bind_scratch, both, check_moe_gate_up_act, check_moe_gemv,
                   dev, host, moe_weights, poisoned, requires_cuda, spy_launches, unwritten)
from helpers import BF16, assert_close, rand_bf16, tiny_model

pytestmark = [pytest.mark.cuda, requires_cuda]

NP = NumpyBackend()


# ---- routed experts ------------------------------------------------------------------------------
@pytest.mark.parametrize("proj,per_slot", [("gate", False), ("down", True)])
def test_moe_gemv_decode(rng, proj, per_slot):
    start, count = 8, 16  # ids outside [8, 24) belong to another rank
    cu, nu = both(moe_weights(rng, start=start, count=count))
    ids = np.array([8, 30, 23, 0, 12, 17, 5, 9], dtype=np.int32)
    local = (ids >= start) & (ids < start + count)
    check_moe_gemv(rng, cu, nu, proj, per_slot, ids, local, f"moe_gemv {proj}")


def test_moe_gate_up_act_decode(rng):
    cu, nu = both(moe_weights(rng, start=0, count=24))
    ids = rng.permutation(E)[:TOP_K].astype(np.int32)
    check_moe_gate_up_act(rng, cu, nu, ids, ids < 24, H, M, "moe_gate_up_act")


def test_moe_decode_glm_shape(rng):
    """The decode GEMV at GLM-5.3-Flash's shape: hidden 4096, moe_inter 2048 (two local experts
    and one remote, three slots)."""
    h, m, k = 4096, 2048, 3
    cu, nu = both(moe_weights(rng, h=h, m=m, start=0, count=2, num_experts=3))
    ids = np.array([1, 2, 0], dtype=np.int32)  # expert 2 is remote
    x = rand_bf16(rng, (1, h))
    refs = [np.zeros((k, m), BF16) for _ in range(3)]
    NP.moe_gate_up_act(x, nu, ids, 10.0, *refs)
    outs = [poisoned((k, m), BF16) for _ in range(3)]
    backend().moe_gate_up_act(dev(x), cu, dev(ids), 10.0, *outs)
    act = host(outs[2])
    for name, o, r in zip(("gate", "up", "act"), outs, refs):
        got = host(o)
        if name != "act":
            assert unwritten(got[1]).all()
        assert_close(got[[0, 2]], r[[0, 2]], f"glm-shape {name}")
    ref_down = np.zeros((k, h), BF16)
    NP.moe_gemv(act, nu.down, ids, ref_down, True)
    down = poisoned((k, h), BF16)
    backend().moe_gemv(dev(act), cu.down, dev(ids), down, True)
    got = host(down)
    assert unwritten(got[1]).all()
    assert_close(got[[0, 2]], ref_down[[0, 2]], "glm-shape down")


@pytest.mark.parametrize("t,e,sms", [(1, E, None), (37, E, None), (700, E, None), (1023, E, None), (1024, E, None),
                                     (1025, E, None), (4096, E, None), (37, 33, None), (700, 1500, None),
                                     (1100, 1500, None), (4097, 257, None), (4096, E, 3), (1100, 1500, 5)])
def test_sort_by_expert(rng, t, e, sms, monkeypatch):
    """Stable and exact at every width, in both forms: one block (one warp's segment of slots, several, ragged
    ends), and the multi-block sort the backend runs from SORT_MULTI_MIN_SLOTS slots in ceil(S / B) slot chunks
    (B = one block per SORT_CHUNK slots, at most one an SM: 8 chunks of 1024 at 1024 rows, 9 of 912 and a last
    of 904 at 1025, 33 at 4097; ``sms`` caps B lower, so chunks pass SORT_CHUNK: 3 of 10923 / 10923 / 10922
    slots); expert counts that are not a multiple of 32 or span two 1024-wide scan chunks (then a row may name
    an expert twice). Every output poisoned first."""
    from glm_ep.backend.cuda import cuda_backend
    from glm_ep.backend.cuda import route_kernels as route
    from glm_ep.backend.cuda.kernel_loader import block_smem_limit

    if route.sort_smem(e) + route.SORT_STATIC_SMEM > block_smem_limit():  # 1500 experts on a GB10 (99 KB a block)
        with pytest.raises(ConfigError, match="the sort by expert of wide calls needs"):
            route.check_sort_fits(e, block_smem_limit(), "this device")
        return
    if sms is not None:
        for module in (route, cuda_backend):
            monkeypatch.setattr(module, "sm_count", lambda: sms)
    if e == E:
        ids = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(t)]).astype(np.int32)
    else:
        ids = rng.integers(0, e, (t, TOP_K), dtype=np.int32)
    ids[: t // 2, 0] = 5  # one expert far more popular than the rest
    ref = routing.sort_by_expert(ids, e)
    s = t * TOP_K
    bind_scratch(backend(), experts=e)  # (a stack's workspace does this for its router's experts)
    names = ("sorted_token_ids", "sorted_expert_ids", "expert_offsets", "token_to_perm")
    launched = spy_launches(monkeypatch, route)
    for form in ("backend", "one block"):
        bufs = [poisoned((s,), np.int32), poisoned((s,), np.int32), poisoned((e + 1,), np.int32),
                poisoned((t, TOP_K), np.int32)]
        launched.clear()
        if form == "backend":
            backend().sort_by_expert(dev(ids), e, *bufs)
            blocks = route.sort_blocks(s, route.sm_count())
            assert launched == (["moe_sort_count", "moe_sort_place"] if blocks > 1 else ["moe_sort_by_expert"])
            assert (blocks > 1) == (s >= route.SORT_MULTI_MIN_SLOTS)
        else:
            with backend().stream:
                route.sort_by_expert(dev(ids), e, *bufs)
            assert launched == ["moe_sort_by_expert"]
        for got, want, name in zip(bufs, (ref.sorted_token_ids, ref.sorted_expert_ids, ref.expert_offsets,
                                          ref.token_to_perm), names):
            np.testing.assert_array_equal(host(got), want, err_msg=f"{form}: {name}")


def test_the_workspace_makes_the_sort_scratch():
    """A stack's workspace makes the multi-block sort's count scratch for its router's experts and hands it to the
    backend, so a wide call never allocates."""
    from glm_ep.backend.cuda import CudaBackend
    from glm_ep.backend.cuda import route_kernels as route
    from glm_ep.config.model import RankLayout, SiteConfig
    from glm_ep.config.topology import PathLevers
    from glm_ep.mlp.site import site_buffers
    from glm_ep.mlp.workspace import workspace_pool

    be = CudaBackend(0, stream=backend().stream)
    cfg = SiteConfig.for_rank(tiny_model(n_routed_experts=E), RankLayout(1, 0, 1, 1))
    pool = workspace_pool(be, (*site_buffers(cfg), *be.buffers(cfg, PathLevers())), 512, 2, False)
    assert be._sort_counts is not None and be._sort_counts.size >= route.sm_count() * E
    assert all(np.shares_memory(ws.view("sort_counts", E), be._sort_counts) for ws in pool)


def test_moe_gemm_sorted(rng):
    t, start, count = 13, 16, 16
    cu, nu = both(moe_weights(rng, start=start, count=count))
    ids = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(t)]).astype(np.int32)
    srt = routing.sort_by_expert(ids, E)
    local = (srt.sorted_expert_ids >= start) & (srt.sorted_expert_ids < start + count)
    tok, offsets = dev(srt.sorted_token_ids), dev(srt.expert_offsets)
    for proj, gather, a in (("gate", True, rand_bf16(rng, (t, H))), ("down", False, rand_bf16(rng, (t * TOP_K, M)))):
        n = getattr(nu, proj).weights[0].shape[0]
        ref = np.zeros((t * TOP_K, n), BF16)
        NP.moe_gemm_sorted(a, getattr(nu, proj), srt.sorted_token_ids, srt.expert_offsets, ref, gather)
        out = poisoned((t * TOP_K, n), BF16)
        backend().moe_gemm_sorted(dev(a), getattr(cu, proj), tok, offsets, out, gather)
        got = host(out)
        assert unwritten(got[~local]).all()
        assert_written(got[local], proj)
        assert_close(got[local], ref[local], f"sorted {proj}")


@pytest.mark.parametrize("n,k", [(40, 352), (24, 96), (2048, 4096)])
def test_nvfp4_gemv_shapes(rng, n, k):
    """Row and K tails: N not a multiple of a block's rows, K not a multiple of a 128-k step."""
    from glm_ep.backend.cuda import routed as kernels

    w_nk = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    w_nk[0, :16] = 0.0  # an all-zero block (scale 0)
    w_nk[1, :16] *= 1e-4  # a block whose E4M3 scale is subnormal
    w = nvfp4.quantize(w_nk)
    x = rand_bf16(rng, (1, k))
    ref = (x.astype(np.float32) @ nvfp4.dequantize(w).T).astype(BF16)
    out = poisoned((1, n), BF16)
    with backend().stream:
        kernels.nvfp4_gemv(dev(x), dev(w.packed), dev(w.scale.view(np.uint8)), w.scale_2, out)
    got = host(out)
    assert_written(got, "nvfp4_gemv")
    assert_close(got, ref, f"nvfp4_gemv {n}x{k}")


def test_expert_linear(rng):
    cu, nu = both(moe_weights(rng, start=4, count=3))
    for proj, kin, n in (("gate", H, M), ("down", M, H)):
        a = rand_bf16(rng, (1, kin))
        ref = np.empty((1, n), BF16)
        NP.expert_linear(a, getattr(nu, proj), 2, ref)
        out = poisoned((1, n), BF16)
        backend().expert_linear(dev(a), getattr(cu, proj), 2, out)
        got = host(out)
        assert_written(got, proj)
        assert_close(got, ref, f"expert_linear {proj}")

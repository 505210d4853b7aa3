"""The grouped NVFP4 prefill GEMM (``gemm_nvfp4.cu``) against its NumPy twin.

Fresh random inputs, poisoned outputs: every row of a local expert must be written, every row of
a remote expert left untouched. Expert row counts are ragged on purpose (0, 1, 17, 300 rows and a
random rest), the projection shapes are gate/up ``[M, H]`` and down ``[H, M]`` (the GLM-5.3-Flash
shape too), and EP > 1 is a ``start``/``count`` window of the expert table. The dequantization is
held bit-exact on one-hot rows over every nibble and E4M3 scale byte (zero and subnormal included).
"""

from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

from glm_ep.mlp import routing
from glm_ep.backend.cuda import grouped
from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.checkpoint.nvfp4 import Nvfp4Weight
from glm_ep.checkpoint.weights import ExpertWeights, MoeWeights

from _cuda import assert_written, backend, both, dev, host, poisoned, requires_cuda, unwritten
from helpers import BF16, assert_close, rand_bf16

pytestmark = [pytest.mark.cuda, requires_cuda]

H, M, E, TOP_K = 256, 128, 32, 8
NP = NumpyBackend()
RAGGED = {3: 300, 11: 17, 20: 1, 27: 0}  # expert -> rows that choose it
E4M3 = ml_dtypes.float8_e4m3fn


def random_nvfp4(rng, n, k):
    """Random nibbles, E4M3 block scales in [2^-4, 2) (never NaN), scale_2 ~ 1/k."""
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = rng.integers(0x28, 0x40, (n, k // 16), dtype=np.uint8)
    return Nvfp4Weight(packed, scale.view(E4M3), float(rng.uniform(0.5, 2.0) / k))


def weights(rng, h=H, m=M, start=0, count=E):
    experts = tuple(ExpertWeights(random_nvfp4(rng, m, h), random_nvfp4(rng, m, h), random_nvfp4(rng, h, m))
                    for _ in range(count))
    return MoeWeights(np.zeros((E, h), np.float32), np.zeros(E, np.float32), start, experts, None)


def ragged_ids(rng, t=320):
    """[t, TOP_K] distinct ids per row where expert e is chosen by exactly RAGGED[e] rows."""
    rest = np.array([e for e in range(E) if e not in RAGGED])
    rows = []
    for r in range(t):
        fixed = [e for e, n in RAGGED.items() if r < n]
        fill = rng.choice(rest, TOP_K - len(fixed), replace=False)
        rows.append(rng.permutation(np.concatenate([fixed, fill])))
    ids = np.array(rows, dtype=np.int32)
    counts = np.bincount(ids.ravel(), minlength=E)
    assert all(counts[e] == n for e, n in RAGGED.items())
    return ids


def sorted_route(ids):
    srt = routing.sort_by_expert(ids, E)
    return srt, dev(srt.sorted_token_ids), dev(srt.expert_offsets)


def check_rows(got, ref, local, what):
    assert unwritten(got[~local]).all(), f"{what}: a row of a remote expert was written"
    assert_written(got[local], what)
    assert_close(got[local], ref[local], what)


@pytest.mark.parametrize("start,count", [(0, E), (8, 16), (0, 4)], ids=["ep1", "ep-window", "ep-head"])
@pytest.mark.parametrize("proj", ["gate", "up", "down"])
def test_gemm_sorted_ragged(rng, start, count, proj):
    cu, nu = both(weights(rng, start=start, count=count))
    ids = ragged_ids(rng)
    t, s = ids.shape[0], ids.size
    srt, tok, offsets = sorted_route(ids)
    local = (srt.sorted_expert_ids >= start) & (srt.sorted_expert_ids < start + count)
    gather = proj != "down"
    a = rand_bf16(rng, (t, H)) if gather else rand_bf16(rng, (s, M))
    n = getattr(nu, proj).weights[0].shape[0]
    ref = np.zeros((s, n), BF16)
    NP.moe_gemm_sorted(a, getattr(nu, proj), srt.sorted_token_ids, srt.expert_offsets, ref, gather)
    out = poisoned((s, n), BF16)
    backend().moe_gemm_sorted(dev(a), getattr(cu, proj), tok, offsets, out, gather)
    check_rows(host(out), ref, local, f"grouped {proj} [{start}, {start + count})")


@pytest.mark.parametrize("start,count", [(0, E), (8, 16)], ids=["ep1", "ep-window"])
def test_gemm_sorted_glu(rng, start, count):
    cu, nu = both(weights(rng, start=start, count=count))
    ids = ragged_ids(rng)
    t, s = ids.shape[0], ids.size
    srt, tok, offsets = sorted_route(ids)
    local = (srt.sorted_expert_ids >= start) & (srt.sorted_expert_ids < start + count)
    x = rand_bf16(rng, (t, H), 4.0)  # large enough that the swiglu limit clamps some values
    gate, up, ref = (np.zeros((s, M), BF16) for _ in range(3))
    NP.moe_gate_up_act_sorted(x, nu, srt.sorted_token_ids, srt.expert_offsets, 2.0, gate, up, ref)
    act = poisoned((s, M), BF16)
    scratch = [poisoned((s, M), BF16) for _ in range(2)]
    backend().moe_gate_up_act_sorted(dev(x), cu, tok, offsets, 2.0, *scratch, act)
    check_rows(host(act), ref, local, "grouped gate + up + SwiGLU")


@pytest.mark.parametrize("variant", [None, *grouped.GEMM_VARIANTS],
                         ids=lambda v: "default" if v is None else grouped.GemmGeometry.of(v).suffix)
def test_gemm_dequant_bit_exact(rng, variant):
    """One-hot rows pick single weights: out[i, n] must equal the NumPy dequantization of w[n, i]
    rounded to bf16, bit for bit, over all 16 nibbles and all non-NaN E4M3 scale bytes; through the
    default launch and every variant (the engines dequantize on paths of their own)."""
    if variant is not None:
        runs_here(variant)
    n, k = 128, 256
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = rng.choice(np.setdiff1d(np.arange(256), [0x7F, 0xFF]), (n, k // 16)).astype(np.uint8)
    scale[:, :4] = np.arange(4 * n).reshape(n, 4) % 0x7F  # every positive byte: 0, subnormals, normals
    w = Nvfp4Weight(packed, scale.view(E4M3), 3.0e-3)
    table = MoeWeights(np.zeros((1, k), np.float32), np.zeros(1, np.float32), 0, (ExpertWeights(w, w, w),), None)
    cu, nu = both(table)
    x = np.eye(k, dtype=np.float32).astype(BF16)  # sorted row i = e_i
    tok = np.arange(k, dtype=np.int32)
    offsets = np.array([0, k], dtype=np.int32)
    ref = np.zeros((k, n), BF16)
    NP.moe_gemm_sorted(x, nu.gate, tok, offsets, ref, False)
    out = poisoned((k, n), BF16)
    if variant is None:
        backend().moe_gemm_sorted(dev(x), cu.gate, dev(tok), dev(offsets), out, False)
    else:
        xv, kw = as_read(variant, dev(x))
        with backend().stream:
            grouped.nvfp4_gemm_sorted(xv, False, dev(tok), dev(offsets), 1, cu.gate, out, variant=variant, **kw)
    got = host(out)
    assert_written(got, "one-hot rows")
    bad = got.view(np.uint16) != ref.view(np.uint16)
    assert not bad.any(), f"{int(bad.sum())} of {bad.size} dequantized weights differ (first at {np.argwhere(bad)[0]})"


def test_dequant_bf16_bit_exact_and_dequant_linear(rng):
    """``nvfp4_dequant_bf16`` writes every weight as bf16 e2m1 * e4m3 bit for bit as the NumPy backend's
    ``dequant_linear`` does, over all 16 nibbles and every non-NaN E4M3 scale byte, into a NaN-poisoned scratch;
    ``dequant_linear`` (cuBLAS, scale_2 as its alpha) equals NumPy's within bf16 rounding at 300 rows, poisoned
    output fully written. The scratch is a slice of a larger buffer, as the dispatch lends it."""
    n, k, t = 384, 512, 300
    cu, nu = _one_expert(_every_byte_nvfp4(rng, n, k))
    x = rand_bf16(rng, (t, k), 1.0)
    w_ref, out_ref = np.zeros((n, k), BF16), np.zeros((t, n), BF16)
    NP.dequant_linear(x, nu.gate, 0, w_ref, out_ref)
    scratch, out = poisoned((n * k + 4096,), BF16), poisoned((t, n), BF16)
    backend().dequant_linear(dev(x), cu.gate, 0, scratch[:n * k].reshape(n, k), out)
    got_w = host(scratch)
    bad = got_w[:n * k].reshape(n, k).view(np.uint16) != w_ref.view(np.uint16)
    assert not bad.any(), f"{int(bad.sum())} of {bad.size} dequantized weights differ (first at {np.argwhere(bad)[0]})"
    assert unwritten(got_w[n * k:]).all(), "the scratch past the projection was written"
    got = host(out)
    assert_written(got, "dequant_linear")
    assert_close(got, out_ref, "dequant_linear at 300 rows", tol=2e-3)


@pytest.mark.parametrize("n,k,blocks_per_sm", [(33, 32, 8), (384, 4096, 1)], ids=["ragged", "two-rounds"])
def test_dequant_bf16_ragged_and_grid_stride(monkeypatch, rng, n, k, blocks_per_sm):
    """The dequant kernel where a warp's last round is partial (33 x 32: 132 words, a warp sweeps 128 a round) and
    where the grid-stride loop takes more than one round (one block an SM), bit for bit NumPy's, into a NaN-poisoned
    buffer with nothing written past the projection."""
    monkeypatch.setattr(grouped, "DEQUANT_BLOCKS_PER_SM", blocks_per_sm)
    cu, nu = _one_expert(_every_byte_nvfp4(rng, n, k))
    w_ref = np.zeros((n, k), BF16)
    NP.dequant_linear(np.zeros((1, k), BF16), nu.gate, 0, w_ref, np.zeros((1, n), BF16))
    buf = poisoned((n * k + 256,), BF16)
    with backend().stream:
        grouped.nvfp4_dequant_bf16(cu.gate.weights, 0, buf[:n * k].reshape(n, k))
    got = host(buf)
    bad = got[:n * k].reshape(n, k).view(np.uint16) != w_ref.view(np.uint16)
    assert not bad.any(), f"{int(bad.sum())} of {bad.size} weights differ (first {np.argwhere(bad)[0]})"
    assert unwritten(got[n * k:]).all(), "written past the projection"


def _every_byte_nvfp4(rng, n, k):
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = rng.choice(np.setdiff1d(np.arange(256), [0x7F, 0xFF]), (n, k // 16)).astype(np.uint8)
    scale[:, :2] = np.arange(2 * n).reshape(n, 2) % 0x7F  # positive bytes: 0, subnormals, normals
    return Nvfp4Weight(packed, scale.view(E4M3), 3.0e-3)


def _one_expert(w):
    return both(MoeWeights(np.zeros((1, w.shape[1]), np.float32), np.zeros(1, np.float32), 0, (ExpertWeights(w, w, w),),
                           None))


def test_gemm_sorted_glm_shape(rng):
    """The GLM-5.3-Flash projections (gate/up [2048, 4096], down [4096, 2048]): a few experts with
    1, 70 and 0 rows, K past several pipeline wraps and N past many blocks."""
    h, m, t = 4096, 2048, 71
    cu, nu = both(weights(rng, h=h, m=m, start=0, count=3))
    ids = np.full((t, TOP_K), 31, dtype=np.int32)  # expert 31: remote
    ids[:70, 0] = 1
    ids[70, 1] = 0
    srt, tok, offsets = sorted_route(ids)
    local = srt.sorted_expert_ids < 3
    s = ids.size
    x = rand_bf16(rng, (t, h))
    gate, up, act_ref = (np.zeros((s, m), BF16) for _ in range(3))
    NP.moe_gate_up_act_sorted(x, nu, srt.sorted_token_ids, srt.expert_offsets, 7.0, gate, up, act_ref)
    act = poisoned((s, m), BF16)
    backend().moe_gate_up_act_sorted(dev(x), cu, tok, offsets, 7.0, poisoned((s, m), BF16),
                                     poisoned((s, m), BF16), act)
    check_rows(host(act), act_ref, local, "GLM-shape gate + up + SwiGLU")
    ref = np.zeros((s, h), BF16)
    NP.moe_gemm_sorted(act_ref, nu.down, srt.sorted_token_ids, srt.expert_offsets, ref, False)
    out = poisoned((s, h), BF16)
    backend().moe_gemm_sorted(dev(act_ref), cu.down, tok, offsets, out, False)
    check_rows(host(out), ref, local, "GLM-shape down")


def runs_here(variant) -> None:
    if why := grouped.why_not_here(variant):
        pytest.skip(why)


def as_read(variant, x):
    """``x`` (a device array) as ``variant`` reads it, and the keywords that say so: in the staged k order
    (``stage_k``) for the wgmma variant, as it is for the others."""
    if not grouped.GemmGeometry.of(variant).staged:
        return x, {}
    out = poisoned(x.shape, BF16)
    with backend().stream:
        grouped.stage_k(x, out)
    return out, {"x_staged": True}


#: the shipped variants and the stage sweep's (``bench --prefill --gemm-stages``, a build of their own)
EVERY_VARIANT = grouped.GEMM_VARIANTS + grouped.GEMM_SWEEP_VARIANTS


def check_variant(variant, x, a, cu, nu, route, what, splits: int = 1):
    """``variant``'s gate + up + SwiGLU on token rows ``x`` and its down projection on sorted rows
    ``a`` (None: NumPy's act), each against NumPy into poisoned outputs; K split ``splits`` ways where
    the projection has that many stages of k (the partial sums in a poisoned scratch)."""
    srt, tok, offsets, local = route
    s, m, h = srt.sorted_token_ids.size, cu.gate.weights.n, cu.down.weights.n
    bk = grouped.GemmGeometry.of(variant).bk
    scratch = poisoned((4 * splits * s * max(m, h),), BF16).view(np.float32) if splits > 1 else None
    gate, up, act_ref = (np.zeros((s, m), BF16) for _ in range(3))
    NP.moe_gate_up_act_sorted(x, nu, srt.sorted_token_ids, srt.expert_offsets, 2.0, gate, up, act_ref)
    act = poisoned((s, m), BF16)
    xv, kw = as_read(variant, dev(x))
    with backend().stream:
        grouped.nvfp4_gemm_sorted_glu(xv, tok, offsets, E, cu, 2.0, act, variant=variant, scratch=scratch,
                                      splits=min(splits, cu.gate.weights.k // bk), **kw)
    check_rows(host(act), act_ref, local, f"glu {what}")
    a = act_ref if a is None else a
    ref = np.zeros((s, h), BF16)
    NP.moe_gemm_sorted(a, nu.down, srt.sorted_token_ids, srt.expert_offsets, ref, False)
    out = poisoned((s, h), BF16)
    av, kw = as_read(variant, dev(a))
    with backend().stream:
        grouped.nvfp4_gemm_sorted(av, False, tok, offsets, E, cu.down, out, variant=variant, scratch=scratch,
                                  splits=min(splits, cu.down.weights.k // bk), **kw)
    check_rows(host(out), ref, local, f"down {what}")


def ragged_route(rng, start, count):
    """Ragged routing (``ragged_ids``) sorted on both sides, and which sorted rows are local."""
    ids = ragged_ids(rng)
    srt, tok, offsets = sorted_route(ids)
    local = (srt.sorted_expert_ids >= start) & (srt.sorted_expert_ids < start + count)
    return ids.shape[0], (srt, tok, offsets, local)


@pytest.mark.parametrize("variant", EVERY_VARIANT, ids=lambda v: grouped.GemmGeometry.of(v).suffix)
def test_gemm_variants(rng, variant):
    """Every (rows per tile, warps) variant, whatever width would pick it: gate/up/SwiGLU fused and
    down, ragged experts, an EP window."""
    runs_here(variant)
    start, count = 4, 24
    cu, nu = both(weights(rng, start=start, count=count))
    t, route = ragged_route(rng, start, count)
    check_variant(variant, rand_bf16(rng, (t, H), 4.0), None, cu, nu, route, str(variant))


@pytest.fixture(scope="module")
def split_case():
    """K of 1024 (16 stages of 64 k) for both projections, ragged experts, an EP window; NumPy's
    results computed once for every variant."""
    rng = np.random.default_rng(2024)
    h, m, start, count = 1024, 1024, 4, 24
    t, (srt, tok, offsets, local) = ragged_route(rng, start, count)
    s = t * TOP_K
    cu, nu = both(weights(rng, h=h, m=m, start=start, count=count))
    x = rand_bf16(rng, (t, h), 4.0)
    gate, up, act_ref = (np.zeros((s, m), BF16) for _ in range(3))
    NP.moe_gate_up_act_sorted(x, nu, srt.sorted_token_ids, srt.expert_offsets, 2.0, gate, up, act_ref)
    down_ref = np.zeros((s, h), BF16)
    NP.moe_gemm_sorted(act_ref, nu.down, srt.sorted_token_ids, srt.expert_offsets, down_ref, False)
    return cu, dev(x), tok, offsets, local, act_ref, down_ref


@pytest.mark.parametrize("variant", grouped.GEMM_VARIANTS, ids=lambda v: grouped.GemmGeometry.of(v).suffix)
def test_gemm_k_split(split_case, variant):
    """K split over 2, 3 (uneven over 16 stages of 64 k) and 8 blocks, on every variant: gate + up +
    SwiGLU and down against NumPy into poisoned outputs, with a poisoned scratch (NaN as fp32: a partial
    sum read before it is written shows), ragged experts and an EP window (the reduce writes the local
    experts' rows only)."""
    runs_here(variant)
    geo = grouped.GemmGeometry.of(variant)
    cu, x, tok, offsets, local, act_ref, down_ref = split_case
    (s, m), h = act_ref.shape, down_ref.shape[1]
    xv, kw = as_read(variant, x)
    av, _ = as_read(variant, dev(act_ref))
    for splits in (2, 3, 8):
        scratch = poisoned((4 * splits * s * max(h, m),), BF16).view(np.float32)
        act, out = poisoned((s, m), BF16), poisoned((s, h), BF16)
        with backend().stream:
            grouped.nvfp4_gemm_sorted_glu(xv, tok, offsets, E, cu, 2.0, act, variant=variant, scratch=scratch,
                                          splits=splits, **kw)
            grouped.nvfp4_gemm_sorted(av, False, tok, offsets, E, cu.down, out, variant=variant,
                                      scratch=scratch, splits=splits, **kw)
        check_rows(host(act), act_ref, local, f"glu {geo.suffix}, {splits} K splits")
        check_rows(host(out), down_ref, local, f"down {geo.suffix}, {splits} K splits")


def test_stage_k_is_the_staged_order(rng):
    """``stage_k`` writes x in ``staged_order`` bit for bit, into a poisoned output (one 64-k block, a few, and
    the hidden width over rows that leave the grid-stride loop a partial round); a width that is not a multiple
    of 64 is refused."""
    for t, k in ((1, 64), (5, 192), (37, 4096)):
        x = rand_bf16(rng, (t, k), 4.0)
        out = poisoned((t, k), BF16)
        with backend().stream:
            grouped.stage_k(dev(x), out)
        got = host(out)
        assert (got.view(np.uint16) == x[:, grouped.staged_order(k)].view(np.uint16)).all(), f"{t} x {k}"
    with pytest.raises(ValueError, match=r"expected \[rows, a multiple of 64\]"):
        grouped.stage_k(dev(rand_bf16(rng, (2, 96))), poisoned((2, 96), BF16))


@pytest.mark.parametrize("start,count", [(0, E), (4, 24)], ids=["ep1", "ep-window"])
def test_experts_sorted(rng, start, count):
    """The backend's routed experts of sorted rows (``moe_experts_sorted``: gate + up + SwiGLU, then down) against
    NumPy's, ragged experts (300, 17, 1 and 0 rows), an EP window, poisoned outputs. At 80 rows an expert, on sm_90a
    that is the wgmma variant: x staged into ``up``, act written in the staged k order and read so by down."""
    cu, nu = both(weights(rng, start=start, count=count))
    t, (srt, tok, offsets, local) = ragged_route(rng, start, count)
    s = t * TOP_K
    x = rand_bf16(rng, (t, H), 4.0)
    gate, up, act_ref = (np.zeros((s, M), BF16) for _ in range(3))
    NP.moe_gate_up_act_sorted(x, nu, srt.sorted_token_ids, srt.expert_offsets, 2.0, gate, up, act_ref)
    ref = np.zeros((s, H), BF16)
    NP.moe_gemm_sorted(act_ref, nu.down, srt.sorted_token_ids, srt.expert_offsets, ref, False)
    act, out = poisoned((s, M), BF16), poisoned((s, H), BF16)
    backend().moe_experts_sorted(dev(x), cu, tok, offsets, 2.0, poisoned((s, M), BF16), poisoned((s, M), BF16), act,
                                 out)
    glu, down = grouped.experts_geometry(dev(x), s, E, cu, poisoned((t, H), BF16))
    assert glu.staged == down.staged == grouped.wgmma_here()
    check_rows(host(act), act_ref[:, grouped.staged_order(M)] if glu.staged else act_ref, local,
               f"act ({glu.suffix})")
    check_rows(host(out), ref, local, f"routed experts ({glu.suffix} / {down.suffix})")


def test_staged_x_is_said(rng):
    """The wgmma variant reads x only in the staged k order and the others only in the natural one; an x_staged
    or act_staged that does not match the variant is a clear error before any launch."""
    wg = grouped.GEMM_WGMMA
    runs_here(wg)
    cu, _ = both(weights(rng, start=0, count=E))
    t, (srt, tok, offsets, _) = ragged_route(rng, 0, E)
    s = t * TOP_K
    x, a, act, out = dev(rand_bf16(rng, (t, H))), dev(rand_bf16(rng, (s, M))), poisoned((s, M), BF16), \
        poisoned((s, H), BF16)
    with pytest.raises(ValueError, match=r"m128wg8k64 reads x in the staged k order"):
        grouped.nvfp4_gemm_sorted(a, False, tok, offsets, E, cu.down, out, variant=wg)
    with pytest.raises(ValueError, match=r"m128wg8k64 reads x in the staged k order"):
        grouped.nvfp4_gemm_sorted_glu(x, tok, offsets, E, cu, 2.0, act, variant=wg)
    with pytest.raises(ValueError, match=r"reads x in the natural k order"):
        grouped.nvfp4_gemm_sorted(a, False, tok, offsets, E, cu.down, out, variant=grouped.GEMM_DEFAULT[64],
                                  x_staged=True)
    with pytest.raises(ValueError, match=r"act_staged is for the wgmma variant"):
        grouped.nvfp4_gemm_sorted_glu(x, tok, offsets, E, cu, 2.0, act, variant=grouped.GEMM_DEFAULT[64],
                                      act_staged=True)
    with pytest.raises(ValueError, match=r"natural k order"):  # a staged x with too few rows an expert for wgmma
        grouped.nvfp4_gemm_sorted(a[:64], False, tok[:64], dev(np.array([0] + [64] * E, np.int32)), E, cu.down,
                                  out[:64], x_staged=True)
    assert unwritten(host(act)).all() and unwritten(host(out)).all()


def test_gemm_k_split_needs_its_scratch(rng):
    """A forced split past the scratch, or past the stages of k, is a clear error before any launch."""
    cu, _ = both(weights(rng, start=0, count=E))
    t, (srt, tok, offsets, _) = ragged_route(rng, 0, E)
    s = t * TOP_K
    out = poisoned((s, H), BF16)
    one = poisoned((2 * s * H,), BF16).view(np.float32)  # one split's partial sums
    a = dev(rand_bf16(rng, (s, M)))
    with pytest.raises(ValueError, match=r"2 K splits need a float32 scratch of \d+ elements, got \d+"):
        grouped.nvfp4_gemm_sorted(a, False, tok, offsets, E, cu.down, out, splits=2, scratch=one)
    with pytest.raises(ValueError, match=r"3 K splits, expected 1\.\.2"):  # K = 128: two stages of 64
        grouped.nvfp4_gemm_sorted(a, False, tok, offsets, E, cu.down, out, splits=3, scratch=one)
    assert unwritten(host(out)).all()


@pytest.mark.parametrize("stages", [3, 7], ids=["k3", "k7"])
@pytest.mark.parametrize("variant", EVERY_VARIANT, ids=lambda v: grouped.GemmGeometry.of(v).suffix)
def test_gemm_variants_partial_tiles(rng, variant, stages):
    """The edges of every variant: a K of 1 and `stages` pipeline stages (down at width BK, gate/up at that many BK
    hidden: 3 is fewer than any pipeline's depth, 7 ends one stage into the wgmma engine's second round of six
    slots), an out width that ends inside a block (gate/up 224 wide, down `stages` BK), ragged experts, an EP
    window."""
    runs_here(variant)
    geo = grouped.GemmGeometry.of(variant)
    dk, start, count = geo.bk, 2, 28
    h = stages * dk
    t, route = ragged_route(rng, start, count)
    s = t * TOP_K
    cu, nu = both(weights(rng, h=h, m=224, start=start, count=count))  # gate/up: N = 224, K = stages BK
    cud, nud = both(weights(rng, h=h, m=dk, start=start, count=count))  # down: N = stages BK, K = BK
    cu, nu = replace(cu, down=cud.down), replace(nu, down=nud.down)
    check_variant(variant, rand_bf16(rng, (t, h), 4.0), rand_bf16(rng, (s, dk)), cu, nu, route,
                  f"{geo.suffix}, gate/up N 224 K {h}, down N {h} K {dk}")
    # gate + up split 3 ways over its stages of k, their out width ending inside a block
    check_variant(variant, rand_bf16(rng, (t, h), 4.0), rand_bf16(rng, (s, dk)), cu, nu, route,
                  f"{geo.suffix}, gate/up N 224 K {h} in 3 K splits", splits=3)

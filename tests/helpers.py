"""Shared test helpers: small random in-memory weights, NumPy stacks for any rank layout, a float64
reference that shares no code with ``glm_ep.check.reference`` or the backends, and the comparisons every
test makes (relative L2, bf16 steps). The CUDA tests' device side is in ``_cuda``; the CLI run as an MPI job,
and the checkpoint and topology files it reads, in ``cli_jobs``.

Shape suffixes: T rows, H hidden, I a projection width, E experts, K top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import ml_dtypes
import numpy as np

from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.dist.comm import Communicator, SelfComm
from glm_ep.config.model import ModelConfig, RankLayout, SiteConfig
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.checkpoint.nvfp4 import Nvfp4Weight, quantize
from glm_ep.config.presets import preset
from glm_ep.mlp.site import DenseSite, MoeSite, Nvfp4DenseSite, site_buffers
from glm_ep.mlp.stack import MlpStack
from glm_ep.mlp.workspace import Workspace, workspace_pool
from glm_ep.config.topology import PathLevers
from glm_ep.checkpoint.weights import DenseWeights, ExpertWeights, MoeWeights

BF16 = ml_dtypes.bfloat16
REPO = Path(__file__).resolve().parents[1]


# ---- configs -----------------------------------------------------------------------------------
def tiny_dict(**overrides: Any) -> dict[str, Any]:
    """The ``tiny`` preset's config dict with ``overrides`` applied."""
    d = preset("tiny")
    d.update(overrides)
    return d


def tiny_model(**overrides: Any) -> ModelConfig:
    return ModelConfig.from_dict(tiny_dict(**overrides), source="test config")


# ---- random weights ----------------------------------------------------------------------------
def _normal(rng: np.random.Generator, n: int, k: int, gain: float = 1.0, heavy: bool = False) -> np.ndarray:
    w = rng.standard_normal((n, k)).astype(np.float32) * np.float32(gain / math.sqrt(k))
    if heavy:  # a few large output rows, so the SwiGLU clamp fires on the tails
        w[rng.random(n) < 0.125] *= np.float32(8.0)
    return w


def random_dense(rng: np.random.Generator, width: int, hidden: int, out_gain: float = 1.0) -> DenseWeights:
    return DenseWeights(gate=_normal(rng, width, hidden, heavy=True).astype(BF16),
                        up=_normal(rng, width, hidden, heavy=True).astype(BF16),
                        down=_normal(rng, hidden, width, out_gain).astype(BF16))


def random_nvfp4_mlp(rng: np.random.Generator, width: int, hidden: int, out_gain: float = 1.0) -> ExpertWeights:
    return ExpertWeights(gate=quantize(_normal(rng, width, hidden, heavy=True)),
                         up=quantize(_normal(rng, width, hidden, heavy=True)),
                         down=quantize(_normal(rng, hidden, width, out_gain)))


def random_weights(model: ModelConfig, seed: int, out_gain: float = 1.0, router_gain: float = 3.0,
                   bias_spread: float = 0.02, router_f32: bool = False,
                   dense_nvfp4: bool = False) -> list[DenseWeights | ExpertWeights | MoeWeights]:
    """Whole (unsharded) weights of every site: bf16 dense/shared, NVFP4 experts (``nvfp4.quantize``),
    a bf16 (or fp32) router and an fp32 bias ``7 + bias_spread * N(0, 1)``. ``out_gain`` scales every
    down projection (small values make the chained stack contractive); ``dense_nvfp4`` stores the dense
    FFNs NVFP4 too (``ExpertWeights``)."""
    rng = np.random.default_rng(seed)
    h, m, e = model.hidden_size, model.moe_intermediate_size, model.n_routed_experts
    layers: list[DenseWeights | ExpertWeights | MoeWeights] = []
    for kind in model.mlp_layer_types:
        if kind == "dense":
            make = random_nvfp4_mlp if dense_nvfp4 else random_dense
            layers.append(make(rng, model.intermediate_size, h, out_gain))
            continue
        router = _normal(rng, e, h, router_gain)
        bias = (7.0 + bias_spread * rng.standard_normal(e)).astype(np.float32)
        experts = tuple(random_nvfp4_mlp(rng, m, h, out_gain) for _ in range(e))
        shared = random_dense(rng, model.shared_intermediate, h, out_gain) if model.n_shared_experts else None
        layers.append(MoeWeights(router=router if router_f32 else router.astype(BF16), bias=bias,
                                 expert_start=0, experts=experts, shared=shared))
    return layers


def rand_bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(BF16)


def random_x(seed: int, rows: int, hidden: int, gain: float = 1.0) -> np.ndarray:
    return rand_bf16(np.random.default_rng(seed), (rows, hidden), gain)


# ---- sharding (DESIGN §2, stated independently of SiteConfig / checkpoint.load_layer) ----------
def _tp_slice(w: DenseWeights, tp: int, tp_rank: int) -> DenseWeights:
    n = w.gate.shape[0] // tp
    rows = slice(tp_rank * n, (tp_rank + 1) * n)
    return DenseWeights(gate=np.ascontiguousarray(w.gate[rows]), up=np.ascontiguousarray(w.up[rows]),
                        down=np.ascontiguousarray(w.down[:, rows]))


def _tp_slice_nvfp4(w: ExpertWeights, tp: int, tp_rank: int) -> ExpertWeights:
    """As ``_tp_slice``, on the NVFP4 bytes: a column range of K is packed K / 2 and scaled K / 16."""
    n = w.gate.shape[0] // tp
    lo, hi = tp_rank * n, (tp_rank + 1) * n

    def rows(q: Nvfp4Weight) -> Nvfp4Weight:
        return Nvfp4Weight(np.ascontiguousarray(q.packed[lo:hi]), np.ascontiguousarray(q.scale[lo:hi]), q.scale_2)

    def cols(q: Nvfp4Weight) -> Nvfp4Weight:
        return Nvfp4Weight(np.ascontiguousarray(q.packed[:, lo // 2:hi // 2]),
                           np.ascontiguousarray(q.scale[:, lo // 16:hi // 16]), q.scale_2)

    return ExpertWeights(gate=rows(w.gate), up=rows(w.up), down=cols(w.down))


def shard_layer(w: DenseWeights | ExpertWeights | MoeWeights,
                layout: RankLayout) -> DenseWeights | ExpertWeights | MoeWeights | None:
    """One rank's share: column-parallel gate/up and row-parallel down for TP, a contiguous expert
    range for EP over groups of moe_tp consecutive ranks, and within a group slice ``rank % moe_tp`` of
    each expert's width (cut as TP cuts an MLP); when the site reduces, a replicated piece is held only by
    its first replica (ranks < tp, ranks < ep * moe_tp)."""
    tp, ep, moe_tp, rank = layout.tp, layout.ep, layout.moe_tp, layout.rank
    sparse = isinstance(w, MoeWeights)
    reduces = tp > 1 or (sparse and ep * moe_tp > 1)
    tp_on = not reduces or rank < tp
    ep_on = not reduces or rank < ep * moe_tp
    if not sparse:
        cut = _tp_slice_nvfp4 if isinstance(w, ExpertWeights) else _tp_slice
        return cut(w, tp, rank % tp) if tp_on else None
    per = len(w.experts) // ep
    start = (rank // moe_tp % ep) * per
    mine = tuple(_tp_slice_nvfp4(e, moe_tp, rank % moe_tp) for e in w.experts[start:start + per])
    return MoeWeights(router=w.router, bias=w.bias, expert_start=start, experts=mine if ep_on else (),
                      shared=_tp_slice(w.shared, tp, rank % tp) if tp_on and w.shared is not None else None)


def build_stack(full: Sequence[DenseWeights | ExpertWeights | MoeWeights], model: ModelConfig,
                layout: RankLayout | None = None,
                comm: Communicator | None = None, levers: PathLevers | None = None,
                max_rows: int = 64, shared_workspace: bool = True, be: NumpyBackend | None = None) -> MlpStack:
    """A NumPy ``MlpStack`` of this rank's share of ``full`` (on ``be``, a ``NumpyBackend`` by default)."""
    layout = layout or RankLayout(1, 0, 1, 1)
    levers = levers or PathLevers()
    be, comm = be or NumpyBackend(), comm or SelfComm()
    cfg = SiteConfig.for_rank(model, layout)
    dispatch = ExpertDispatch.routed(be, cfg, levers)
    sites: list[Any] = []
    for w in full:
        mine = shard_layer(w, layout)
        if isinstance(w, MoeWeights):
            sites.append(MoeSite(be, comm, cfg, be.upload_moe(mine, cfg.swiglu_limit), dispatch))
        elif isinstance(w, ExpertWeights):  # a dense FFN stored NVFP4
            mlp = be.upload_experts((mine,), 0, cfg.swiglu_limit) if mine is not None else None
            sites.append(Nvfp4DenseSite(be, comm, cfg, mlp, ExpertDispatch.nvfp4_dense(be, cfg, levers)))
        else:
            sites.append(DenseSite(be, comm, cfg, be.upload_dense(mine) if mine is not None else None))
    return MlpStack(be, comm, cfg, sites, levers, max_rows, shared_workspace)


def workspace(cfg: SiteConfig, rows: int, levers: PathLevers | None = None, nvfp4_dense: bool = False,
              be: NumpyBackend | None = None) -> Workspace:
    """One workspace of ``rows`` rows (on ``be``, a ``NumpyBackend`` by default) with the buffers the sites of ``cfg``
    and the backend declare, as the loader makes it; ``nvfp4_dense``: a dense FFN stored NVFP4's too."""
    be, levers = be or NumpyBackend(), levers or PathLevers()
    return workspace_pool(be, (*site_buffers(cfg, levers, nvfp4_dense), *be.buffers(cfg, levers)), rows, 1, True)[0]


class CapturingNumpy(NumpyBackend):
    """A NumPy backend that "captures" as the CUDA one does, for the stack's graph logic on CPU: ``capture``
    records the call and replays it by calling it again (counted in ``captured``); ``inside`` stands for a
    caller's own capture around ours (``capturing``). Its capabilities are the CUDA backend's."""

    capabilities = replace(NumpyBackend.capabilities, capture=True)

    def __init__(self) -> None:
        self.captured, self.inside = 0, False

    def capture(self, fn):
        assert not self.inside, "a capture begun inside the caller's own"
        self.captured += 1
        return fn

    def capturing(self) -> bool:
        return self.inside


# ---- float64 reference (no glm_ep arithmetic) --------------------------------------------------
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e4m3_to_f64(bits: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bit patterns -> float64 (bias 7, no infinities, 0x7F/0xFF NaN)."""
    b = np.asarray(bits, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1.0 + m / 8.0) * 2.0 ** (e - 7.0))
    return np.where((e == 15) & (m == 7), np.nan, sign * mag)


def nvfp4_to_f64(packed: np.ndarray, scale_bits: np.ndarray, scale_2: float) -> np.ndarray:
    """ModelOpt NVFP4 ``[N, K/2]`` bytes + E4M3 ``[N, K/16]`` bits + scale_2 -> float64 ``[N, K]``."""
    p = np.asarray(packed, dtype=np.uint8)
    nib = np.stack([p & 0xF, p >> 4], axis=-1).reshape(p.shape[0], -1)  # even k in the low nibble
    vals = np.where(nib & 0x8, -1.0, 1.0) * E2M1[nib & 0x7]
    return vals * np.repeat(e4m3_to_f64(scale_bits), 16, axis=1) * float(scale_2)


def f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


@dataclass
class Ref64Layer:
    """One site in float64: ``kind`` 'dense' or 'sparse'; ``mlp`` the dense FFN or the shared expert
    (gate, up, down; None without one); ``experts[e]`` = (gate, up, down) of routed expert e."""

    kind: str
    mlp: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    router: np.ndarray | None = None
    bias: np.ndarray | None = None
    experts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None


@dataclass(frozen=True)
class RefParams:
    top_k: int
    routed_scale: float
    renormalize: bool
    limit: float

    @classmethod
    def of(cls, model: ModelConfig) -> "RefParams":
        return cls(model.num_experts_per_tok, model.routed_scaling_factor, model.norm_topk_prob,
                   model.swiglu_limit)


def ref64_layers(full: Sequence[DenseWeights | ExpertWeights | MoeWeights]) -> list[Ref64Layer]:
    """float64 copies of in-memory weights (NVFP4 decoded with this module's own tables)."""
    def dense(w: DenseWeights) -> tuple[np.ndarray, ...]:
        return f64(w.gate), f64(w.up), f64(w.down)

    def nv(q: Nvfp4Weight) -> np.ndarray:
        return nvfp4_to_f64(q.packed, q.scale.view(np.uint8), q.scale_2)

    out = []
    for w in full:
        if isinstance(w, DenseWeights):
            out.append(Ref64Layer("dense", dense(w)))
        elif isinstance(w, ExpertWeights):
            out.append(Ref64Layer("dense", (nv(w.gate), nv(w.up), nv(w.down))))
        else:
            out.append(Ref64Layer("sparse", dense(w.shared) if w.shared is not None else None, f64(w.router),
                                  f64(w.bias), [(nv(e.gate), nv(e.up), nv(e.down)) for e in w.experts]))
    return out


def mlp64(w: tuple[np.ndarray, np.ndarray, np.ndarray], limit: float, x: np.ndarray) -> np.ndarray:
    gate, up, down = w
    g = np.minimum(x @ gate.T, limit)  # gate: clamped from above only, before the silu
    u = np.clip(x @ up.T, -limit, limit)  # up: both ways
    with np.errstate(over="ignore"):
        return (g / (1.0 + np.exp(-g)) * u) @ down.T


def route64(layer: Ref64Layer, p: RefParams, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(over="ignore"):
        scores = 1.0 / (1.0 + np.exp(-(x @ layer.router.T)))
    choice = scores + layer.bias[None, :]
    ids = np.argsort(-choice, axis=1, kind="stable")[:, : p.top_k]  # ties: lower id first
    wts = np.take_along_axis(scores, ids, axis=1)  # UNBIASED
    if p.renormalize:
        wts = wts / (wts.sum(axis=1, keepdims=True) + 1e-20)
    return ids, wts * p.routed_scale


def site64(layer: Ref64Layer, p: RefParams, x_TH: np.ndarray) -> np.ndarray:
    x = f64(x_TH)
    if layer.kind == "dense":
        return mlp64(layer.mlp, p.limit, x)
    ids, wts = route64(layer, p, x)
    out = mlp64(layer.mlp, p.limit, x) if layer.mlp is not None else np.zeros_like(x)  # NOT scaled
    for t in range(x.shape[0]):
        for k in range(p.top_k):
            out[t] += wts[t, k] * mlp64(layer.experts[ids[t, k]], p.limit, x[t:t + 1])[0]
    return out


def step64(layers: Sequence[Ref64Layer], p: RefParams, x_TH: np.ndarray) -> np.ndarray:
    """The chained stack ``h = h + site(h)`` in float64."""
    h = f64(x_TH)
    for layer in layers:
        h = h + site64(layer, p, h)
    return h


def route_margins64(layers: Sequence[Ref64Layer], p: RefParams, x_TH: np.ndarray) -> np.ndarray:
    """Per row, the smallest gap between the k-th and (k+1)-th choice over the sparse sites of the
    float64 chain. Top-k is discontinuous: a row whose gap is below the pipeline's bf16
    perturbation may pick other experts, so chained comparisons use well-separated rows."""
    h = f64(x_TH)
    gap = np.full(h.shape[0], np.inf)
    for layer in layers:
        if layer.kind == "sparse":
            with np.errstate(over="ignore"):
                scores = 1.0 / (1.0 + np.exp(-(h @ layer.router.T)))
            choice = np.sort(scores + layer.bias[None, :], axis=1)
            gap = np.minimum(gap, choice[:, -p.top_k] - choice[:, -p.top_k - 1])
        h = h + site64(layer, p, h)
    return gap


# ---- comparisons -------------------------------------------------------------------------------
def rel_l2(y: np.ndarray, ref: np.ndarray) -> float:
    """``|y - ref| / |ref|`` in float64; not finite where either holds a NaN or Inf (so ``< tol`` fails)."""
    y, ref = f64(y), f64(ref)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-300))


def bf16_ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise distance in bf16 steps, both sides rounded to bf16 first: how many steps along the
    ordered bf16 values lead from one to the other. 0 for equal values (+0 and -0 alike) and where
    both are NaN, 2**20 where only one is. Never less than the gap in ulps of the larger magnitude;
    more where the pair straddles a power of two or zero."""
    def ordered(x: np.ndarray) -> np.ndarray:
        u = x.astype(BF16).view(np.uint16).astype(np.int32)
        return np.where(u & 0x8000, 0x8000 - u, u)  # -0 and +0 both map to 0

    a, b = np.asarray(a), np.asarray(b)
    d = np.abs(ordered(a) - ordered(b))
    na, nb = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    return np.where(na & nb, 0, np.where(na | nb, 1 << 20, d))


def assert_close(got: np.ndarray, ref: np.ndarray, what: str, tol: float = 1e-2) -> None:
    assert np.isfinite(np.asarray(got, np.float32)).all(), f"{what}: non-finite values"
    err = rel_l2(got, ref)
    assert err < tol, f"{what}: relative L2 error {err:.3e} >= {tol}"


def assert_ulps(got: np.ndarray, ref: np.ndarray, what: str, ulps: int = 1) -> None:
    d = bf16_ulps(got, ref)
    assert d.max() <= ulps, (f"{what}: {int((d > ulps).sum())} elements more than {ulps} bf16 ulp apart "
                             f"(max {int(d.max())})")


# ---- multi-rank assertions ---------------------------------------------------------------------
def agreed(comm: Any, failures: list[str]) -> None:
    """Assert on every rank that no rank failed (one failing rank never leaves another waiting)."""
    every = comm.allgather(failures)
    msgs = [f"rank {r}: {m}" for r, fs in enumerate(every) for m in fs]
    assert not msgs, "\n".join(msgs)


def elementwise_close(got: np.ndarray, want: np.ndarray) -> bool:
    """Every element of a multi-rank output within 2^-6 relative, or 2 % of the one-rank output's RMS, of the
    one-rank output: a relative L2 bound alone lets a few elements be far off while the rest match."""
    scale = float(np.sqrt(np.mean(want.astype(np.float64) ** 2)))
    return bool(np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=2 ** -6, atol=2e-2 * scale))

"""Wrappers of the bf16 projection kernels, one path per row count: the batch-M GEMV tiers for
1..8 rows (``gemv_bf16.cu``: plain, gate + up + SwiGLU fused, the router's fp32 logits), the warp-streaming
tensor-core GEMM for the dense FFN's weights at 5..16 rows and the shared expert's at 5..8 (``mma_bf16.cu``)
and cuBLAS GemmEx past those.

Shape suffixes: T rows, R rows of one call, N/K a projection's out/in width, E experts.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from glm_ep.backend.cuda.kernel_loader import (BF16, F32, GEMV_MAX_ROWS, GEMV_ROWS_PER_WARP, GEMV_WARPS,
                                        ROUTER_MAX_TOP_K, U32, WSTREAM_DEPTH, WSTREAM_STAGE_K, WSTREAM_TIERS,
                                        WSTREAM_WARPS, cdiv, check, check_shape, i32, i64, launch, sm_count,
                                        smem_per_sm)

GEMV_CHUNK = 8  # k per 16-byte bf16 chunk: K must be a multiple


# ---- cuBLAS GEMM (wider than the GEMV tiers) ---------------------------------------------------------
_CUDA_R_32F, _CUDA_R_16BF = 0, 14  # cudaDataType_t
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)  # host alpha / beta (pointer mode host)
_ONE_PTR, _ZERO_PTR = _ONE.ctypes.data, _ZERO.ctypes.data  # (each .ctypes access builds an object)


@functools.cache
def _cublas() -> Any:
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:  # older CuPy layouts
        from cupy.cuda import cublas
    return cublas


def _cublas_on_stream() -> tuple[Any, int]:
    """CuPy's cuBLAS module and its shared handle, bound to the current stream: the handle keeps whatever
    stream was last set on it (at first the legacy default stream, which does not order against the
    backend's non-blocking stream)."""
    import cupy

    cb = _cublas()
    handle = cupy.cuda.device.get_cublas_handle()
    cb.setStream(handle, cupy.cuda.get_current_stream().ptr)
    return cb, handle


def gemm_bf16(x_TK: Any, w_NK: Any, out_TN: Any, alpha: float = 1.0) -> None:
    """``out = alpha * (x @ w^T)`` in ONE cuBLAS GemmEx call: bf16 operands (products exact in fp32), fp32
    accumulation, ``alpha`` applied to the fp32 sums (an NVFP4 projection's ``scale_2``), ``out`` bf16 (rounded
    once) or fp32 (the router's logits), on the current stream.
    Row-major as column-major: ``out^T [N, T] = w [N, K] @ x^T [K, T]``."""
    t, k = x_TK.shape
    n = w_NK.shape[0]
    check("x", x_TK, BF16, 2), check("w", w_NK, BF16, 2), check_shape("w", w_NK, (n, k))
    if out_TN.dtype not in (BF16, F32):
        raise TypeError(f"out: dtype {out_TN.dtype}, expected bfloat16 or float32")
    check("out", out_TN, out_TN.dtype, 2), check_shape("out", out_TN, (t, n))
    if t == 0:
        return
    cb, handle = _cublas_on_stream()
    scale = None if alpha == 1.0 else np.full(1, alpha, np.float32)  # host pointer mode: read before gemmEx returns
    cb.gemmEx(handle, cb.CUBLAS_OP_T, cb.CUBLAS_OP_N, n, t, k,
              _ONE_PTR if scale is None else scale.ctypes.data, w_NK.data.ptr, _CUDA_R_16BF, k,
              x_TK.data.ptr, _CUDA_R_16BF, k,
              _ZERO_PTR, out_TN.data.ptr, _CUDA_R_16BF if out_TN.dtype == BF16 else _CUDA_R_32F, n,
              cb.CUBLAS_COMPUTE_32F, cb.CUBLAS_GEMM_DEFAULT)


def gemm_bf16_pair(x_TK: Any, w0_NK: Any, w1_NK: Any, out0_TN: Any, out1_TN: Any) -> None:
    """``out0 = x @ w0^T`` and ``out1 = x @ w1^T`` (gate and up) as ``gemm_bf16`` computes each, in ONE cuBLAS
    strided-batched GemmEx where ``w1`` and ``out1`` lie past ``w0`` and ``out0`` (the batch stride is the
    distance between them: stacked weights, adjacent workspace buffers), else two calls. One launch of both
    projections fills the device where one of them alone leaves SMs idle or takes a kernel of another shape."""
    t, k = x_TK.shape
    n = w0_NK.shape[0]
    check("x", x_TK, BF16, 2)
    for name, w in (("w0", w0_NK), ("w1", w1_NK)):
        check(name, w, BF16, 2), check_shape(name, w, (n, k))
    for name, o in (("out0", out0_TN), ("out1", out1_TN)):
        check(name, o, BF16, 2), check_shape(name, o, (t, n))
    stride_w, stride_o = w1_NK.data.ptr - w0_NK.data.ptr, out1_TN.data.ptr - out0_TN.data.ptr
    if stride_w < w0_NK.nbytes or stride_o < out0_TN.nbytes:  # up before gate, or overlapping it
        gemm_bf16(x_TK, w0_NK, out0_TN)
        gemm_bf16(x_TK, w1_NK, out1_TN)
        return
    if t == 0:
        return
    cb, handle = _cublas_on_stream()
    cb.gemmStridedBatchedEx(handle, cb.CUBLAS_OP_T, cb.CUBLAS_OP_N, n, t, k,
                            _ONE_PTR, w0_NK.data.ptr, _CUDA_R_16BF, k, stride_w // 2,
                            x_TK.data.ptr, _CUDA_R_16BF, k, 0,
                            _ZERO_PTR, out0_TN.data.ptr, _CUDA_R_16BF, n, stride_o // 2,
                            2, cb.CUBLAS_COMPUTE_32F, cb.CUBLAS_GEMM_DEFAULT)


# ---- warp-streaming tensor-core GEMM: the dense FFN's weights at 5..16 rows, the shared expert's at 5..8 ------
# (mma_bf16.cu, bf16_wstream_*)
_WSTREAM = "mma_bf16.cu"
WSTREAM_K_STEP = 32  # k of one step of a warp (two m16n8k16 mma): K must be a multiple
# elements of one weight matrix: up to here a weight takes the shared expert's engines (the warp-streaming GEMM from
# WSTREAM_SMALL_MIN_ROWS to 8 rows, gate + up past 8 rows in one batched cuBLAS call), past it the dense FFN's
SMALL_WEIGHT_MAX = 2048 * 4096
WSTREAM_MIN_ROWS = 5  # below: the batch-M GEMV
WSTREAM_MAX_ROWS = WSTREAM_TIERS[-1]  # gate + up + SwiGLU
WSTREAM_PLAIN_MAX_ROWS = 8  # a plain projection (the down): past 8 rows cuBLAS, faster there and never captured
WSTREAM_SMEM = WSTREAM_WARPS * WSTREAM_DEPTH * 16 * WSTREAM_STAGE_K * 2  # a block's rings
# weights of at most SMALL_WEIGHT_MAX elements (the shared expert's): from this many rows to GEMV_MAX_ROWS, both
# its gate + up and its down (0: never, the batch-M GEMV). H100 (docs/perf/runs/2026-12-07-h100-shared/), streamed,
# as graphs, GEMV / warp-streaming µs: gate + up [2048, 4096] 4 rows 16.8 / 18.9, 5 rows 21.1 / 18.9, 8 rows
# 27.0 / 19.1; down [4096, 2048] 4 rows 10.6 / 12.6, 5 rows 13.5 / 12.6, 8 rows 17.3 / 12.6
WSTREAM_SMALL_MIN_ROWS = 5


def _check_glu(wg_NK: Any, wu_NK: Any, gate_RN: Any, up_RN: Any, act_RN: Any, r: int, k: int) -> int:
    """The gate and up weights ([N, K] bf16) and the gate, up and act outputs ([R, N] bf16) of a fused gate +
    up + SwiGLU launch; returns N."""
    n = wg_NK.shape[0]
    for name, w in (("gate weight", wg_NK), ("up weight", wu_NK)):
        check(name, w, BF16), check_shape(name, w, (n, k))
    for name, a in (("gate", gate_RN), ("up", up_RN), ("act", act_RN)):
        check(name, a, BF16, 2), check_shape(name, a, (r, n))
    return n


def wstream_takes(x_RK: Any, w_NK: Any, glu: bool) -> bool:
    """Whether the warp-streaming GEMM serves this call: K in whole 32-k steps, and for a weight past
    SMALL_WEIGHT_MAX elements (the dense FFN's) WSTREAM_MIN_ROWS..WSTREAM_MAX_ROWS rows for gate + up + SwiGLU
    and ..WSTREAM_PLAIN_MAX_ROWS for a plain projection; for a smaller one (the shared expert's)
    WSTREAM_SMALL_MIN_ROWS..GEMV_MAX_ROWS rows, 0 never. Measured (``glm-ep bench --sweep dense``;
    docs/perf/DESIGN-NOTES.md): on the [12288, 4096] gate + up it is the fastest engine at 5..16 rows; on the
    [4096, 12288] down it beats the GEMV at 5..8 rows but not cuBLAS, which the captured 1..8-row steps cannot
    call."""
    r, k = x_RK.shape
    if k % WSTREAM_K_STEP:
        return False
    if w_NK.size > SMALL_WEIGHT_MAX:
        return WSTREAM_MIN_ROWS <= r <= (WSTREAM_MAX_ROWS if glu else WSTREAM_PLAIN_MAX_ROWS)
    return 0 < WSTREAM_SMALL_MIN_ROWS <= r <= min(GEMV_MAX_ROWS, WSTREAM_PLAIN_MAX_ROWS)


def wstream_resident_blocks() -> int:
    """Blocks of the warp-streaming GEMM the device holds at once, as shared memory allows (3 an SM on sm_90;
    registers allow 3 too while a thread keeps to 168: 157 at the 16-row tier). A launch past it stays correct:
    no block waits on another."""
    total, reserved = smem_per_sm()
    return sm_count() * max(1, total // (WSTREAM_SMEM + reserved))


def wstream_geometry(n: int, k: int, glu: bool, ksplit: int | None = None) -> tuple[int, int]:
    """(grid.x, K slices S): row blocks of 16 rows a warp (glu: 8 gate + 8 up), each split into S K slices while
    every block of the launch is resident at once and K holds two stages a slice. A slice is whole stages (the
    kernel's ``wstream_slice``: ceil(stages / S) each, the last one short), and S is then cut to the slices that
    hold any, so no block streams nothing. ``ksplit`` fixes S as given (tests, tools: its last slices may be
    empty, adding zeros)."""
    blocks = cdiv(n, WSTREAM_WARPS * (8 if glu else 16))
    if ksplit is None:
        resident, stages, ksplit = wstream_resident_blocks(), cdiv(k, WSTREAM_STAGE_K), 1
        while blocks * ksplit * 2 <= resident and stages >= 4 * ksplit:
            ksplit *= 2
        ksplit = cdiv(stages, cdiv(stages, ksplit))
    if ksplit < 1:
        raise ValueError(f"K slices: {ksplit}, expected at least 1")
    return blocks * ksplit, ksplit


def wstream_scratch_sizes() -> tuple[int, int]:
    """(fp32 partial sums, arrival counters) that serve any warp-streaming launch that splits K (all its blocks
    resident, each with 4 x 2 partial sums per thread at the widest tier)."""
    resident = wstream_resident_blocks()
    return resident * (WSTREAM_MAX_ROWS // 8) * 4 * WSTREAM_WARPS * 32, resident


def wstream_scratch_need(grid_x: int, ksplit: int, tier: int) -> tuple[int, int]:
    """(fp32 partial sums, arrival counters) a launch of ``grid_x`` blocks in ``ksplit`` K slices at ``tier`` rows
    reads: none with one slice (the kernel never touches them, and its grid may pass what the device holds)."""
    if ksplit == 1:
        return 0, 0
    return grid_x * (tier // 8) * 4 * WSTREAM_WARPS * 32, grid_x // ksplit


def _wstream_plan(x_RK: Any, n: int, glu: bool, partials: Any, arrived: Any, ksplit: int | None,
                  what: str) -> tuple[int, int, int, int, int, Any, Any]:
    """A warp-streaming launch's checked shape: (rows, in width, tier, grid.x, K slices, scratch arguments)."""
    r, k = x_RK.shape
    if not 1 <= r <= WSTREAM_TIERS[-1]:
        raise ValueError(f"{what}: {r} rows; its tensor-core tiers cover 1..{WSTREAM_TIERS[-1]} (wider goes elsewhere)")
    if k % WSTREAM_K_STEP:
        raise ValueError(f"{what}: in width {k} is not a multiple of {WSTREAM_K_STEP} (one tensor-core step)")
    check("x", x_RK, BF16)
    tier = next(t for t in WSTREAM_TIERS if r <= t)
    grid_x, ks = wstream_geometry(n, k, glu, ksplit)
    check("partials", partials, F32, 4), check("arrived", arrived, U32, 4)
    need, counters = wstream_scratch_need(grid_x, ks, tier)
    if partials.size < need or arrived.size < counters:
        raise ValueError(f"{what}: scratch of {partials.size} partial sums and {arrived.size} counters, expected at "
                         f"least {need} and {counters}")
    return r, k, tier, grid_x, ks, partials, arrived


def wstream_gemm_bf16(x_RK: Any, w_NK: Any, out_RN: Any, partials: Any, arrived: Any,
                      ksplit: int | None = None) -> None:
    """``out = bf16(x @ w^T)`` for R <= 16 rows, every weight read once, each warp streaming its own rows.
    ``partials`` / ``arrived``: the split-K scratch (``wstream_scratch_sizes``; counters zero between launches,
    as every launch leaves them)."""
    n = w_NK.shape[0]
    r, k, tier, grid_x, ks, partials, arrived = _wstream_plan(x_RK, n, False, partials, arrived, ksplit,
                                                              "wstream_gemm_bf16")
    check("w", w_NK, BF16), check_shape("w", w_NK, (n, k))
    check("out", out_RN, BF16, 2), check_shape("out", out_RN, (r, n))
    launch(_WSTREAM, f"bf16_wstream_gemm_t{tier}", (grid_x, 1, 1), (WSTREAM_WARPS * 32, 1, 1),
           (x_RK, i64(k), w_NK, out_RN, i64(n), i32(r), i32(n), i32(k), i32(ks), partials, arrived),
           smem=WSTREAM_SMEM)


def wstream_glu_bf16(x_RK: Any, wg_NK: Any, wu_NK: Any, limit: float, gate_RN: Any, up_RN: Any, act_RN: Any,
                     partials: Any, arrived: Any, ksplit: int | None = None) -> None:
    """gate, up and the clamped SwiGLU of a bf16 MLP for R <= 16 rows in ONE warp-streaming launch."""
    n = wg_NK.shape[0]
    r, k, tier, grid_x, ks, partials, arrived = _wstream_plan(x_RK, n, True, partials, arrived, ksplit,
                                                              "wstream_glu_bf16")
    _check_glu(wg_NK, wu_NK, gate_RN, up_RN, act_RN, r, k)
    launch(_WSTREAM, f"bf16_wstream_glu_t{tier}", (grid_x, 1, 1), (WSTREAM_WARPS * 32, 1, 1),
           (x_RK, i64(k), wg_NK, wu_NK, gate_RN, up_RN, act_RN, i64(n), i32(r), i32(n), i32(k), i32(ks),
            np.float32(limit), partials, arrived), smem=WSTREAM_SMEM)


# ---- bf16 GEMV (1..8 rows) -----------------------------------------------------------------------
GEMV = "gemv_bf16.cu"
GEMV_BLOCK = (GEMV_WARPS * 32, 1, 1)


def gemv_geometry(n_groups: int, k: int) -> tuple[int, int]:
    """(grid.x, ksplit): split K over 1, 2, 4 or 8 warps of a block until the grid fills the
    device (4 blocks per SM), keeping at least 64 chunks per warp slice."""
    sms = sm_count()
    ksplit = 1
    while (ksplit < GEMV_WARPS and cdiv(n_groups, GEMV_WARPS // ksplit) < 4 * sms
           and k // GEMV_CHUNK >= 64 * 2 * ksplit):
        ksplit *= 2
    return cdiv(n_groups, GEMV_WARPS // ksplit), ksplit


def gemv_rows(x_RK: Any, what: str) -> tuple[int, int]:
    r, k = x_RK.shape
    if not 1 <= r <= GEMV_MAX_ROWS:
        raise ValueError(f"{what}: {r} rows; the GEMV tiers cover 1..{GEMV_MAX_ROWS} (wider goes to cuBLAS)")
    if k % GEMV_CHUNK:
        raise ValueError(f"{what}: in width {k} is not a multiple of {GEMV_CHUNK}")
    check("x", x_RK, BF16)
    return r, k


def gemv_bf16(x_RK: Any, w_NK: Any, out_RN: Any) -> None:
    """``out = bf16(x @ w^T)`` for R = 1..8 rows, one weight read for all rows."""
    r, k = gemv_rows(x_RK, "gemv_bf16")
    n = w_NK.shape[0]
    check("w", w_NK, BF16), check_shape("w", w_NK, (n, k))
    check("out", out_RN, BF16, 2), check_shape("out", out_RN, (r, n))
    grid_x, ksplit = gemv_geometry(cdiv(n, GEMV_ROWS_PER_WARP), k)
    launch(GEMV, f"bf16_gemv_r{r}", (grid_x, 1, 1), GEMV_BLOCK,
           (x_RK, i64(k), w_NK, out_RN, i64(n), i32(n), i32(k), i32(ksplit)))


def gemv_combine_bf16(x_RK: Any, w_NK: Any, routed_SN: Any, wts_RK: Any, out_RN: Any) -> None:
    """``out = combine(routed, wts, bf16(x @ w^T))`` for R = 1..8 rows in ONE launch: the shared
    expert's down projection with the site's combine in its epilogue (``elementwise.combine``'s
    numerics on ``gemv_bf16``'s output); routed slots in ``(row, slot)`` order."""
    r, k = gemv_rows(x_RK, "gemv_combine_bf16")
    n = w_NK.shape[0]
    top_k = wts_RK.shape[1] if wts_RK.ndim == 2 else 0
    if top_k > ROUTER_MAX_TOP_K:  # the kernel holds a row's weighted slots in registers
        raise ValueError(f"gemv_combine_bf16: {top_k} slots a row, expected at most {ROUTER_MAX_TOP_K}")
    check("w", w_NK, BF16), check_shape("w", w_NK, (n, k))
    check("wts", wts_RK, F32, 4), check_shape("wts", wts_RK, (r, top_k))
    check("routed", routed_SN, BF16, 2), check_shape("routed", routed_SN, (r * top_k, n))
    check("out", out_RN, BF16, 2), check_shape("out", out_RN, (r, n))
    grid_x, ksplit = gemv_geometry(cdiv(n, GEMV_ROWS_PER_WARP), k)
    launch(GEMV, f"bf16_gemv_combine_r{r}", (grid_x, 1, 1), GEMV_BLOCK,
           (x_RK, i64(k), w_NK, routed_SN, wts_RK, out_RN, i32(n), i32(k), i32(ksplit), i32(top_k)))


def glu_geometry(x_RK: Any, wg_NK: Any, wu_NK: Any, gate_RN: Any, up_RN: Any, act_RN: Any,
                 what: str) -> tuple[int, int, int, int, int]:
    """The fused gate + up GEMV's checked shape and launch: (rows, in width, out width, grid.x, ksplit)."""
    r, k = gemv_rows(x_RK, what)
    n = _check_glu(wg_NK, wu_NK, gate_RN, up_RN, act_RN, r, k)
    return (r, k, n, *gemv_geometry(n, k))


def glu_bf16(x_RK: Any, wg_NK: Any, wu_NK: Any, limit: float, gate_RN: Any, up_RN: Any, act_RN: Any) -> None:
    """gate, up and the clamped SwiGLU of a bf16 MLP for R = 1..8 rows in ONE launch."""
    r, k, n, grid_x, ksplit = glu_geometry(x_RK, wg_NK, wu_NK, gate_RN, up_RN, act_RN, "glu_bf16")
    launch(GEMV, f"bf16_glu_r{r}", (grid_x, 1, 1), GEMV_BLOCK,
           (x_RK, i64(k), wg_NK, wu_NK, gate_RN, up_RN, act_RN, i64(n), i32(n), i32(k), i32(ksplit),
            np.float32(limit)))


def router_geometry(x_RH: Any, router_EH: Any, logits_RE: Any, what: str) -> tuple[int, int, int, int, int, str]:
    """The router GEMV's checked shape and launch: (rows, in width, experts, grid.x, ksplit, the
    entry's weight tag ``bf16w`` / ``f32w``)."""
    r, k = gemv_rows(x_RH, what)
    e = router_EH.shape[0]
    if router_EH.dtype not in (BF16, F32):
        raise TypeError(f"router: dtype {router_EH.dtype}, expected bfloat16 or float32")
    check("router", router_EH, router_EH.dtype), check_shape("router", router_EH, (e, k))
    check("logits", logits_RE, F32, 4), check_shape("logits", logits_RE, (r, e))
    grid_x, ksplit = gemv_geometry(cdiv(e, GEMV_ROWS_PER_WARP), k)
    return r, k, e, grid_x, ksplit, "f32w" if router_EH.dtype == F32 else "bf16w"


def router_gemv(x_RH: Any, router_EH: Any, out_RE: Any) -> None:
    """fp32 logits ``x @ router^T`` for R = 1..8 rows; the router is bf16 or fp32 as stored."""
    r, k, e, grid_x, ksplit, wtag = router_geometry(x_RH, router_EH, out_RE, "router_gemv")
    launch(GEMV, f"router_gemv_{wtag}_r{r}", (grid_x, 1, 1), GEMV_BLOCK,
           (x_RH, i64(k), router_EH, out_RE, i64(e), i32(e), i32(k), i32(ksplit)))

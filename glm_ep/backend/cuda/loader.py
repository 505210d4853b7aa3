"""The CUDA kernels of glm_ep: ONE cached loader and thin typed wrappers (bf16 GEMV, router,
elementwise, routing tables; the NVFP4 expert kernels' wrappers are in ``nvfp4``).

Every kernel lives in ``glm_ep/kernels/*.cu`` and is compiled by NVRTC (``cupy.RawModule``) for
the device's own arch, once per (file, device); a ``#line`` marker in front of every inlined piece
makes compiler errors name the ``.cu`` file and line. The constants that couple a kernel to its
launch geometry are defined HERE, passed to every file as ``-D``, and used by the grid arithmetic
next to them. Wrappers check dtype, contiguity and 16-byte alignment, pass scalars as
``np.int32`` / ``np.int64`` / ``np.float32``, and launch on the current CuPy stream (the backend
makes its own stream current around every op).

Shape suffixes: T rows, R rows of one group, H hidden, N/K a projection's out/in width, E experts,
S slots, U union entries.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from glm_ep.config import KERNEL_MAX_TOP_K
from glm_ep.routing import RouteParams

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"

# ---- compile-time constants (-D) and the geometry they fix ------------------------------------
NVFP4_WARPS = 8  # warps per NVFP4 GEMV block
RING_WARPS = 2  # warps per block of the persistent decode kernels (gemv_nvfp4_ring.cu)
GEMV_WARPS = 8  # warps per bf16 GEMV block
GEMV_ROWS_PER_WARP = 2  # rows per warp-group of a bf16 GEMV
GEMV_CHUNK = 8  # k per 16-byte bf16 chunk: K must be a multiple
GEMV_MAX_ROWS = 8  # widest batch-M tier (bf16_gemv_r1 .. r8)
MMA_GEMM_WARPS = 8  # warps per block of the 9..64-row tensor-core GEMM (mma_bf16.cu)
MMA_GEMM_TIERS = (16, 32, 64)  # rows one launch covers (bf16_mma_*_t{T}); past the last: cuBLAS
MMA_GEMM_WARPS_PER_SM = 16  # split K until a launch holds this many warps per SM
ELEM_THREADS = 256
COMBINE_THREADS = 128
COMBINE_VEC = 8  # hidden elements per combine thread (mirrors COMBINE_VEC in elementwise.cu)
UNION_MAX_IDS = 64  # rows * top_k of one union table: ONE block of that many threads
ROUTER_MAX_TOP_K = KERNEL_MAX_TOP_K
ROUTER_THREADS = 32  # one warp per row
SORT_THREADS = 1024
ELEM_MAX_BLOCKS = 8192  # grid-stride beyond this

DEFINES = {
    "NVFP4_WARPS": NVFP4_WARPS,
    "RING_WARPS": RING_WARPS,
    "GEMV_WARPS": GEMV_WARPS,
    "GEMV_ROWS_PER_WARP": GEMV_ROWS_PER_WARP,
    "MMA_GEMM_WARPS": MMA_GEMM_WARPS,
    "ELEM_THREADS": ELEM_THREADS,
    "COMBINE_THREADS": COMBINE_THREADS,
    "UNION_MAX_IDS": UNION_MAX_IDS,
    "ROUTER_MAX_TOP_K": ROUTER_MAX_TOP_K,
    "SORT_THREADS": SORT_THREADS,
}

BF16 = np.dtype(ml_dtypes.bfloat16)
F32, I32, U8 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint8)
_DEFAULT_SMEM = 48 * 1024


def define_options() -> tuple[str, ...]:
    return tuple(f"-D{k}={v}" for k, v in DEFINES.items())


def kernel_files() -> list[Path]:
    return sorted(KERNEL_DIR.glob("*.cu"))


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.M)


def kernel_source(name: str) -> str:
    """The text NVRTC compiles: the file with its local ``#include "x.cuh"`` inlined (so CuPy's
    cache key covers the headers too), each piece behind a ``#line`` marker."""
    path = KERNEL_DIR / name
    text = path.read_text()
    out, pos = [f'#line 1 "{name}"\n'], 0
    for m in _LOCAL_INCLUDE.finditer(text):
        header = m.group(1)
        out.append(text[pos:m.start()])
        line = text.count("\n", 0, m.end()) + 2
        body = re.sub(r"^#pragma once[ \t]*$", "", (KERNEL_DIR / header).read_text(), flags=re.M)  # keeps lines
        out.append(f'#line 1 "{header}"\n{body}\n#line {line} "{name}"\n')
        pos = m.end() + 1
    out.append(text[pos:])
    return "".join(out)


@functools.cache
def _module(name: str, device: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        return cupy.RawModule(code=kernel_source(name), options=define_options())  # C++17: CuPy's default


@functools.cache
def _function(name: str, entry: str, device: int) -> Any:
    return _module(name, device).get_function(entry)


@functools.cache
def _device_attr(device: int, key: str) -> int:
    import cupy

    return int(cupy.cuda.Device(device).attributes[key])


def _current_device() -> int:
    import cupy

    return cupy.cuda.Device().id


def _launch(file: str, entry: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
            smem: int = 0) -> None:
    dev = _current_device()
    fn = _function(file, entry, dev)
    if smem > _DEFAULT_SMEM and fn.max_dynamic_shared_size_bytes < smem:
        limit = _device_attr(dev, "MaxSharedMemoryPerBlockOptin")
        if smem > limit:
            raise ValueError(f"{entry}: needs {smem} bytes of shared memory, the device allows {limit}")
        fn.max_dynamic_shared_size_bytes = smem
    fn(grid, block, args, shared_mem=smem)


def _check(name: str, a: Any, dtype: np.dtype, align: int = 16) -> None:
    if a.dtype != dtype:
        raise TypeError(f"{name}: dtype {a.dtype}, expected {dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {a.strides}")
    if align and a.data.ptr % align:
        raise ValueError(f"{name}: data at {a.data.ptr:#x} is not {align}-byte aligned")


def _check_shape(name: str, a: Any, shape: tuple[int, ...]) -> None:
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {tuple(shape)}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split_k(groups: int, copies: int, steps: int, block_warps: int, warps_per_sm: int, min_steps: int,
             sms: int) -> tuple[int, int]:
    """(grid.x, ksplit) of a tensor-core launch whose blocks hold ``block_warps`` warps and whose row
    groups (``copies`` times over: slots, matrices) are each swept by ``ksplit`` consecutive warps:
    K is halved while the launch holds fewer than ``warps_per_sm`` warps per SM and each slice
    keeps at least ``min_steps`` steps."""
    ks = 1
    while ks < block_warps and groups * copies * ks < warps_per_sm * sms and steps >= 2 * min_steps * ks:
        ks *= 2
    return _cdiv(groups, block_warps // ks), ks


def _i32(v: int) -> np.int32:
    return np.int32(v)


def _i64(v: int) -> np.int64:
    return np.int64(v)


# ---- cuBLAS GEMM (wider than the GEMV tiers) ---------------------------------------------------------
_CUDA_R_32F, _CUDA_R_16BF = 0, 14  # cudaDataType_t
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)  # host alpha / beta (pointer mode host)


@functools.cache
def _cublas() -> Any:
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:  # older CuPy layouts
        from cupy.cuda import cublas
    return cublas


def gemm_bf16(x_TK: Any, w_NK: Any, out_TN: Any) -> None:
    """``out = x @ w^T`` in ONE cuBLAS GemmEx call: bf16 operands (products exact in fp32), fp32
    accumulation, ``out`` bf16 (rounded once) or fp32 (the router's logits), on the current stream.
    Row-major as column-major: ``out^T [N, T] = w [N, K] @ x^T [K, T]``."""
    import cupy

    t, k = x_TK.shape
    n = w_NK.shape[0]
    _check("x", x_TK, BF16, 2), _check("w", w_NK, BF16, 2), _check_shape("w", w_NK, (n, k))
    if out_TN.dtype not in (BF16, F32):
        raise TypeError(f"out: dtype {out_TN.dtype}, expected bfloat16 or float32")
    _check("out", out_TN, out_TN.dtype, 2), _check_shape("out", out_TN, (t, n))
    if t == 0:
        return
    cb = _cublas()
    cb.gemmEx(cupy.cuda.device.get_cublas_handle(), cb.CUBLAS_OP_T, cb.CUBLAS_OP_N, n, t, k,
              _ONE.ctypes.data, w_NK.data.ptr, _CUDA_R_16BF, k, x_TK.data.ptr, _CUDA_R_16BF, k,
              _ZERO.ctypes.data, out_TN.data.ptr, _CUDA_R_16BF if out_TN.dtype == BF16 else _CUDA_R_32F, n,
              cb.CUBLAS_COMPUTE_32F, cb.CUBLAS_GEMM_DEFAULT)


# ---- bf16 tensor-core GEMM, 9..64 rows (mma_bf16.cu) ---------------------------------------------------
_MMA = "mma_bf16.cu"
MMA_GEMM_MAX_ROWS = MMA_GEMM_TIERS[-1]
MMA_GEMM_K_STEP = 32  # k of one step of a warp (two m16n8k16 mma): K must be a multiple


def _mma_tier(r: int, what: str) -> int:
    if not 1 <= r <= MMA_GEMM_MAX_ROWS:
        raise ValueError(f"{what}: {r} rows; the tensor-core tiers cover 1..{MMA_GEMM_MAX_ROWS} (wider goes to cuBLAS)")
    return next(t for t in MMA_GEMM_TIERS if r <= t)


def _mma_geometry(n: int, k: int, p: int, tier: int) -> tuple[int, int, int]:
    """(grid.x, ksplit, dynamic smem): K split over 1..MMA_GEMM_WARPS warps of a block until the launch
    holds MMA_GEMM_WARPS_PER_SM warps per SM, each slice keeping >= 16 steps of 32 k; the slices'
    partial sums (p * tier / 2 floats per lane) meet in shared memory."""
    sms = _device_attr(_current_device(), "MultiProcessorCount")
    grid_x, ks = _split_k(_cdiv(n, 16), 1, k // MMA_GEMM_K_STEP, MMA_GEMM_WARPS, MMA_GEMM_WARPS_PER_SM, 16, sms)
    smem = MMA_GEMM_WARPS * p * (tier // 8) * 4 * 32 * 4 if ks > 1 else 0
    return grid_x, ks, smem


def mma_gemm_takes(x_RK: Any) -> bool:
    """Whether the tensor-core GEMM serves these rows: at most MMA_GEMM_MAX_ROWS, K in whole steps."""
    return x_RK.shape[0] <= MMA_GEMM_MAX_ROWS and x_RK.shape[1] % MMA_GEMM_K_STEP == 0


def _mma_rows(x_RK: Any, what: str) -> tuple[int, int, int]:
    r, k = x_RK.shape
    tier = _mma_tier(r, what)
    if k % MMA_GEMM_K_STEP:
        raise ValueError(f"{what}: in width {k} is not a multiple of {MMA_GEMM_K_STEP} (one tensor-core step)")
    _check("x", x_RK, BF16)
    return r, k, tier


def mma_gemm_bf16(x_RK: Any, w_NK: Any, out_RN: Any) -> None:
    """``out = x @ w^T`` for R <= 64 rows on the tensor cores, every weight read once for all rows;
    ``out`` bf16 (rounded once) or fp32 (router logits)."""
    r, k, tier = _mma_rows(x_RK, "mma_gemm_bf16")
    n = w_NK.shape[0]
    _check("w", w_NK, BF16), _check_shape("w", w_NK, (n, k))
    if out_RN.dtype not in (BF16, F32):
        raise TypeError(f"out: dtype {out_RN.dtype}, expected bfloat16 or float32")
    _check("out", out_RN, out_RN.dtype, 2), _check_shape("out", out_RN, (r, n))
    grid_x, ks, smem = _mma_geometry(n, k, 1, tier)
    entry = f"bf16_mma_gemm_{'f32_' if out_RN.dtype == F32 else ''}t{tier}"
    _launch(_MMA, entry, (grid_x, 1, 1), (MMA_GEMM_WARPS * 32, 1, 1),
            (x_RK, _i64(k), w_NK, out_RN, _i64(n), _i32(r), _i32(n), _i32(k), _i32(ks)), smem=smem)


def mma_glu_bf16(x_RK: Any, wg_NK: Any, wu_NK: Any, limit: float, gate_RN: Any, up_RN: Any, act_RN: Any) -> None:
    """gate, up and the clamped SwiGLU of a bf16 MLP for R <= 64 rows in ONE tensor-core launch."""
    r, k, tier = _mma_rows(x_RK, "mma_glu_bf16")
    n = wg_NK.shape[0]
    for name, w in (("gate weight", wg_NK), ("up weight", wu_NK)):
        _check(name, w, BF16), _check_shape(name, w, (n, k))
    for name, a in (("gate", gate_RN), ("up", up_RN), ("act", act_RN)):
        _check(name, a, BF16, 2), _check_shape(name, a, (r, n))
    grid_x, ks, smem = _mma_geometry(n, k, 2, tier)
    _launch(_MMA, f"bf16_mma_glu_t{tier}", (grid_x, 1, 1), (MMA_GEMM_WARPS * 32, 1, 1),
            (x_RK, _i64(k), wg_NK, wu_NK, gate_RN, up_RN, act_RN, _i64(n), _i32(r), _i32(n), _i32(k), _i32(ks),
             np.float32(limit)), smem=smem)


# ---- bf16 GEMV (1..8 rows) -----------------------------------------------------------------------
_GEMV = "gemv_bf16.cu"
_GEMV_BLOCK = (GEMV_WARPS * 32, 1, 1)


def _gemv_geometry(n_groups: int, k: int) -> tuple[int, int]:
    """(grid.x, ksplit): split K over 1, 2, 4 or 8 warps of a block until the grid fills the
    device (4 blocks per SM), keeping at least 64 chunks per warp slice."""
    sms = _device_attr(_current_device(), "MultiProcessorCount")
    ksplit = 1
    while (ksplit < GEMV_WARPS and _cdiv(n_groups, GEMV_WARPS // ksplit) < 4 * sms
           and k // GEMV_CHUNK >= 64 * 2 * ksplit):
        ksplit *= 2
    return _cdiv(n_groups, GEMV_WARPS // ksplit), ksplit


def _gemv_rows(x_RK: Any, what: str) -> tuple[int, int]:
    r, k = x_RK.shape
    if not 1 <= r <= GEMV_MAX_ROWS:
        raise ValueError(f"{what}: {r} rows; the GEMV tiers cover 1..{GEMV_MAX_ROWS} (wider goes to cuBLAS)")
    if k % GEMV_CHUNK:
        raise ValueError(f"{what}: in width {k} is not a multiple of {GEMV_CHUNK}")
    _check("x", x_RK, BF16)
    return r, k


def gemv_bf16(x_RK: Any, w_NK: Any, out_RN: Any) -> None:
    """``out = bf16(x @ w^T)`` for R = 1..8 rows, one weight read for all rows."""
    r, k = _gemv_rows(x_RK, "gemv_bf16")
    n = w_NK.shape[0]
    _check("w", w_NK, BF16), _check_shape("w", w_NK, (n, k))
    _check("out", out_RN, BF16, 2), _check_shape("out", out_RN, (r, n))
    grid_x, ksplit = _gemv_geometry(_cdiv(n, GEMV_ROWS_PER_WARP), k)
    _launch(_GEMV, f"bf16_gemv_r{r}", (grid_x, 1, 1), _GEMV_BLOCK,
            (x_RK, _i64(k), w_NK, out_RN, _i64(n), _i32(n), _i32(k), _i32(ksplit)))


def glu_bf16(x_RK: Any, wg_NK: Any, wu_NK: Any, limit: float, gate_RN: Any, up_RN: Any, act_RN: Any) -> None:
    """gate, up and the clamped SwiGLU of a bf16 MLP for R = 1..8 rows in ONE launch."""
    r, k = _gemv_rows(x_RK, "glu_bf16")
    n = wg_NK.shape[0]
    for name, w in (("gate weight", wg_NK), ("up weight", wu_NK)):
        _check(name, w, BF16), _check_shape(name, w, (n, k))
    for name, a in (("gate", gate_RN), ("up", up_RN), ("act", act_RN)):
        _check(name, a, BF16, 2), _check_shape(name, a, (r, n))
    grid_x, ksplit = _gemv_geometry(n, k)
    _launch(_GEMV, f"bf16_glu_r{r}", (grid_x, 1, 1), _GEMV_BLOCK,
            (x_RK, _i64(k), wg_NK, wu_NK, gate_RN, up_RN, act_RN, _i64(n), _i32(n), _i32(k), _i32(ksplit),
             np.float32(limit)))


def router_gemv(x_RH: Any, router_EH: Any, out_RE: Any) -> None:
    """fp32 logits ``x @ router^T`` for R = 1..8 rows; the router is bf16 or fp32 as stored."""
    r, k = _gemv_rows(x_RH, "router_gemv")
    e = router_EH.shape[0]
    if router_EH.dtype not in (BF16, F32):
        raise TypeError(f"router: dtype {router_EH.dtype}, expected bfloat16 or float32")
    _check("router", router_EH, router_EH.dtype), _check_shape("router", router_EH, (e, k))
    _check("logits", out_RE, F32, 4), _check_shape("logits", out_RE, (r, e))
    grid_x, ksplit = _gemv_geometry(_cdiv(e, GEMV_ROWS_PER_WARP), k)
    entry = f"router_gemv_{'f32' if router_EH.dtype == F32 else 'bf16'}w_r{r}"
    _launch(_GEMV, entry, (grid_x, 1, 1), _GEMV_BLOCK,
            (x_RH, _i64(k), router_EH, out_RE, _i64(e), _i32(e), _i32(k), _i32(ksplit)))


# ---- router top-k ---------------------------------------------------------------------------------
def router_topk(logits_TE: Any, bias_E: Any, p: RouteParams, ids_TK: Any, wts_TK: Any) -> None:
    t, e = logits_TE.shape
    if not 1 <= p.top_k <= min(ROUTER_MAX_TOP_K, e):
        raise ValueError(f"router_topk: top_k = {p.top_k}, expected 1..{min(ROUTER_MAX_TOP_K, e)}")
    _check("logits", logits_TE, F32, 4), _check("bias", bias_E, F32, 4), _check_shape("bias", bias_E, (e,))
    _check("ids", ids_TK, I32, 4), _check("wts", wts_TK, F32, 4)
    _check_shape("ids", ids_TK, (t, p.top_k)), _check_shape("wts", wts_TK, (t, p.top_k))
    _launch("router.cu", "router_topk", (t, 1, 1), (ROUTER_THREADS, 1, 1),
            (logits_TE, bias_E, ids_TK, wts_TK, _i32(e), _i32(p.top_k), np.float32(p.routed_scale),
             _i32(int(p.renormalize)), _i32(int(p.bf16_ladder))), smem=8 * e)


# ---- elementwise ------------------------------------------------------------------------------------
_ELEM = "elementwise.cu"


def _elem_grid(n: int) -> tuple[int, int, int]:
    return (max(1, min(_cdiv(n, ELEM_THREADS), ELEM_MAX_BLOCKS)), 1, 1)


def _same(name: str, a: Any, like: Any, dtype: np.dtype) -> None:
    _check(name, a, dtype, 2), _check_shape(name, a, like.shape)


def swiglu(gate: Any, up: Any, limit: float, out: Any) -> None:
    _same("gate", gate, out, BF16), _same("up", up, out, BF16), _same("out", out, out, BF16)
    if out.size:
        _launch(_ELEM, "swiglu_bf16", _elem_grid(out.size), (ELEM_THREADS, 1, 1),
                (gate, up, out, _i64(out.size), np.float32(limit)))


def add(a: Any, b: Any, out: Any) -> None:
    _same("a", a, out, BF16), _same("b", b, out, BF16), _same("out", out, out, BF16)
    if out.size:
        _launch(_ELEM, "add_bf16", _elem_grid(out.size), (ELEM_THREADS, 1, 1), (a, b, out, _i64(out.size)))


def bf16_to_f32(a: Any, out: Any) -> None:
    _same("a", a, out, BF16), _same("out", out, out, F32)
    if out.size:
        _launch(_ELEM, "bf16_to_f32_copy", _elem_grid(out.size), (ELEM_THREADS, 1, 1), (a, out, _i64(out.size)))


def combine(routed_SH: Any, wts_TK: Any, shared_TH: Any | None, out_TH: Any, perm_TK: Any | None = None) -> None:
    """``out[t] = bf16(sum_k wts[t, k] * routed[row(t, k)] + shared[t])``, row ``t*K + k`` or
    ``perm[t, k]``; grid (H / (threads * 8), T)."""
    t, h = out_TH.shape
    k = wts_TK.shape[1]
    if h % COMBINE_VEC:
        raise ValueError(f"combine: hidden {h} is not a multiple of {COMBINE_VEC}")
    _check("routed", routed_SH, BF16), _check_shape("routed", routed_SH, (routed_SH.shape[0], h))
    _check("wts", wts_TK, F32, 4), _check_shape("wts", wts_TK, (t, k))
    _check("out", out_TH, BF16)
    if shared_TH is not None:
        _check("shared", shared_TH, BF16), _check_shape("shared", shared_TH, (t, h))
    shared = shared_TH if shared_TH is not None else np.uint64(0)  # a null pointer
    grid = (_cdiv(h, COMBINE_THREADS * COMBINE_VEC), t, 1)
    if t == 0:
        return
    if perm_TK is None:
        _check_shape("routed", routed_SH, (t * k, h))
        _launch(_ELEM, "moe_combine", grid, (COMBINE_THREADS, 1, 1), (routed_SH, wts_TK, shared, out_TH, _i32(h), _i32(k)))
    else:
        _check("perm", perm_TK, I32, 4), _check_shape("perm", perm_TK, (t, k))
        _launch(_ELEM, "moe_combine_indexed", grid, (COMBINE_THREADS, 1, 1),
                (routed_SH, perm_TK, wts_TK, shared, out_TH, _i32(h), _i32(k)))


# ---- routing tables -----------------------------------------------------------------------------------
def union_table(ids_RK: Any, u_eid_U: Any, u_slot_UR: Any) -> None:
    r, k = ids_RK.shape
    if r * k > UNION_MAX_IDS:
        raise ValueError(f"union_table: rows * top_k = {r * k} exceeds the {UNION_MAX_IDS} ids of one block")
    _check("ids", ids_RK, I32, 4), _check("u_eid", u_eid_U, I32, 4), _check("u_slot", u_slot_UR, I32, 4)
    _check_shape("u_eid", u_eid_U, (r * k,)), _check_shape("u_slot", u_slot_UR, (r * k, r))
    _launch("moe_route.cu", "moe_union_table", (1, 1, 1), (r * k, 1, 1), (ids_RK, u_eid_U, u_slot_UR, _i32(r), _i32(k)))


def sort_by_expert(ids_TK: Any, num_experts: int, sorted_token_ids_S: Any, sorted_expert_ids_S: Any,
                   expert_offsets: Any, token_to_perm_TK: Any) -> None:
    t, k = ids_TK.shape
    _check("ids", ids_TK, I32, 4)
    for name, a, shape in (("sorted_token_ids", sorted_token_ids_S, (t * k,)),
                           ("sorted_expert_ids", sorted_expert_ids_S, (t * k,)),
                           ("expert_offsets", expert_offsets, (num_experts + 1,)),
                           ("token_to_perm", token_to_perm_TK, (t, k))):
        _check(name, a, I32, 4), _check_shape(name, a, shape)
    _launch("moe_route.cu", "moe_sort_by_expert", (1, 1, 1), (SORT_THREADS, 1, 1),
            (ids_TK, _i32(t * k), _i32(k), _i32(num_experts), sorted_token_ids_S, sorted_expert_ids_S,
             expert_offsets, token_to_perm_TK), smem=4 * num_experts * (1 + SORT_THREADS // 32))

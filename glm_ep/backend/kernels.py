"""The CUDA kernels of glm_ep: ONE cached loader and thin typed wrappers.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from glm_ep.config import KERNEL_MAX_TOP_K, NVFP4_GROUP
from glm_ep.routing import RouteParams

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"

# ---- compile-time constants (-D) and the geometry they fix ------------------------------------
NVFP4_WARPS = 8  # warps per NVFP4 GEMV block
NVFP4_CHUNK = 32  # k per 16-byte packed chunk: K must be a multiple
MMA_ROWS = 16  # weight rows per warp group: the mma's 16-row A operand (MMA_ROWS in gemv_nvfp4.cu)
MMA_STEP_CHUNKS = 4  # 16-byte chunks per step of a lane quad (128 k)
MMA_MAX_X_ROWS = 8  # x rows per launch: the mma's 8 B columns
MMA_WORK_WARPS_PER_SM = 16  # split K until a launch holds this many warps per SM (16: fastest of 16/48/96 on H200)
RING_WARPS = 2  # warps per block of the persistent decode kernels (gemv_nvfp4_ring.cu)
RING_STEP_K = 128  # k per step of the ring kernels; a ring stage is a slab of T steps (K a multiple)
SM_SMEM = 228 * 1024  # shared memory of one SM (sm_90), of which each resident block costs 1 KB more
GEMV_WARPS = 8  # warps per bf16 GEMV block
GEMV_ROWS_PER_WARP = 2  # rows per warp-group of a bf16 GEMV
GEMV_CHUNK = 8  # k per 16-byte bf16 chunk: K must be a multiple
GEMV_MAX_ROWS = 8  # widest batch-M tier (bf16_gemv_r1 .. r8)
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
    "ELEM_THREADS": ELEM_THREADS,
    "COMBINE_THREADS": COMBINE_THREADS,
    "UNION_MAX_IDS": UNION_MAX_IDS,
    "ROUTER_MAX_TOP_K": ROUTER_MAX_TOP_K,
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


def _i32(v: int) -> np.int32:
    return np.int32(v)


def _i64(v: int) -> np.int64:
    return np.int64(v)


# ---- routed experts: NVFP4 pointer tables -------------------------------------------------------
@dataclass(frozen=True)
class ExpertPtrTable:
    """One projection of every local expert, as the grouped kernels index it: device arrays of the
    experts' packed / scale base pointers (uint64) and their fp32 ``scale_2``, by local id. The
    arrays the pointers point at are kept alive in ``packed`` / ``scale``."""

    packed_ptrs: Any  # uint64 [count]
    scale_ptrs: Any  # uint64 [count]
    scale2: Any  # fp32 [count]
    n: int  # out width
    k: int  # in width
    packed: tuple[Any, ...]  # uint8 [n, k/2] per expert
    scale: tuple[Any, ...]  # uint8 (E4M3 bits) [n, k/16] per expert
    scale2_host: tuple[float, ...]


def check_nvfp4_k(k: int, what: str) -> None:
    if k % NVFP4_CHUNK:
        raise ValueError(f"{what}: in width {k} is not a multiple of {NVFP4_CHUNK} (one 16-byte NVFP4 chunk)")


_NVFP4_BLOCK = (NVFP4_WARPS * 32, 1, 1)
_NVFP4 = "gemv_nvfp4.cu"


def _mma_geometry(n: int, k: int, entries: int) -> tuple[int, int]:
    """(grid.x, ksplit) of a tensor-core launch: K is split over 1, 2, 4 or 8 warps of a block until
    the launch holds MMA_WORK_WARPS_PER_SM warps per SM, each slice keeping >= 4 steps."""
    groups, steps = _cdiv(n, MMA_ROWS), _cdiv(k // NVFP4_CHUNK, MMA_STEP_CHUNKS)
    sms = _device_attr(_current_device(), "MultiProcessorCount")
    ks = 1
    while ks < NVFP4_WARPS and groups * max(entries, 1) * ks < MMA_WORK_WARPS_PER_SM * sms and steps >= 8 * ks:
        ks *= 2
    return _cdiv(groups, NVFP4_WARPS // ks), ks


def nvfp4_gemv(x_1K: Any, packed_NK2: Any, scale_NG: Any, scale2: float, out_1N: Any) -> None:
    """One expert, one row: ``out = bf16(x @ dequant(w)^T)``; ``scale_2`` by value."""
    n, k = packed_NK2.shape[0], packed_NK2.shape[1] * 2
    check_nvfp4_k(k, "nvfp4_gemv")
    _check("x", x_1K, BF16), _check("packed", packed_NK2, U8), _check("scale", scale_NG, U8, 2)
    _check("out", out_1N, BF16, 2)
    _check_shape("x", x_1K, (1, k)), _check_shape("out", out_1N, (1, n))
    _check_shape("scale", scale_NG, (n, k // NVFP4_GROUP))
    grid_x, ks = _mma_geometry(n, k, 1)
    _launch(_NVFP4, "nvfp4_mma_gemv", (grid_x, 1, 1), _NVFP4_BLOCK,
            (x_1K, packed_NK2, scale_NG, np.float32(scale2), out_1N, _i32(n), _i32(k), _i32(ks)))


# ---- the persistent decode kernels (gemv_nvfp4_ring.cu) ---------------------------------------
RING_KERNELS = ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3))  # the (T, D) gemv_nvfp4_ring.cu instantiates


@dataclass
class RingConfig:
    """How the one-row routed kernels run: the persistent ring (``enabled``) or gemv_nvfp4.cu's
    block-per-tile kernels. By P, the matrices a warp sweeps (1: one projection, 2: gate + up): the
    slab (T steps of 128 k per ring stage) and the ring depth D (stages per warp); the warps per SM
    the grid aims at (fewer where the rings' shared memory does not fit). ``max_warps`` caps the grid
    (tests: several items per warp)."""

    enabled: bool = True
    slab: dict = field(default_factory=lambda: {1: 4, 2: 4})
    depth: dict = field(default_factory=lambda: {1: 2, 2: 2})  # fastest on H200 (docs/perf/NOTES.md)
    warps_per_sm: int = 16
    max_warps: int = 0


RING = RingConfig()
_RING = "gemv_nvfp4_ring.cu"


def ring_stage_bytes(p: int, t: int) -> int:
    """One ring stage of one warp (RingStage<P, T>): P x 16 rows x 64 T weight bytes, P x 16 x 8 T
    scale bytes, 256 T bytes of x."""
    return p * 16 * 64 * t + p * 16 * 8 * t + 256 * t


def _ring_ok(n: int, k: int, slots: int, p: int) -> bool:
    return RING.enabled and n % MMA_ROWS == 0 and k % (RING_STEP_K * RING.slab[p]) == 0 and slots <= 32


def _ring_geometry(n: int, slots: int, p: int) -> tuple[int, int, str]:
    """(blocks, dynamic smem bytes, entry suffix): as even a share of the slots x row-group items per
    warp as the cap allows (warps_per_sm per SM, or fewer where the rings do not fit), RING_WARPS per
    block."""
    t, depth = RING.slab[p], RING.depth[p]
    if (t, depth) not in RING_KERNELS:
        raise ValueError(f"ring slab {t}, depth {depth}: gemv_nvfp4_ring.cu instantiates (T, D) in {RING_KERNELS}")
    smem = RING_WARPS * depth * ring_stage_bytes(p, t)
    per_sm = min(RING.warps_per_sm, SM_SMEM // (smem + 1024) * RING_WARPS)
    items = max(1, slots * (n // MMA_ROWS))
    cap = max(1, _device_attr(_current_device(), "MultiProcessorCount") * per_sm)
    if RING.max_warps:
        cap = min(cap, RING.max_warps)
    warps = _cdiv(items, _cdiv(items, cap))
    return _cdiv(warps, RING_WARPS), smem, f"t{t}_d{depth}"


def nvfp4_moe_gemv(x: Any, per_slot_input: bool, proj: ExpertPtrTable, ids_S: Any, start: int, count: int,
                   out_SN: Any) -> None:
    """Every slot of ONE row in one launch: slot s runs expert ``ids[s]`` on ``x[0]`` or,
    ``per_slot_input``, on ``x[s]``; a remote slot's output row is left untouched."""
    s = ids_S.size
    _check("x", x, BF16), _check("ids", ids_S, I32, 4), _check("out", out_SN, BF16)
    _check_shape("x", x, (s if per_slot_input else 1, proj.k))
    _check_shape("out", out_SN, (s, proj.n))
    x_stride = _i64(proj.k if per_slot_input else 0)
    if _ring_ok(proj.n, proj.k, s, 1):
        blocks, smem, suffix = _ring_geometry(proj.n, s, 1)
        _launch(_RING, f"nvfp4_ring_moe_gemv_{suffix}", (blocks, 1, 1), (RING_WARPS * 32, 1, 1),
                (x, x_stride, proj.packed_ptrs, proj.scale_ptrs, proj.scale2, ids_S, _i32(s), _i32(start),
                 _i32(count), out_SN, _i32(proj.n), _i32(proj.k)), smem=smem)
        return
    head = (x, x_stride, proj.packed_ptrs, proj.scale_ptrs, proj.scale2, ids_S,
            _i32(start), _i32(count), out_SN, _i32(proj.n), _i32(proj.k))
    grid_x, ks = _mma_geometry(proj.n, proj.k, s)
    _launch(_NVFP4, "nvfp4_mma_moe_gemv", (grid_x, s, 1), _NVFP4_BLOCK, head + (_i32(ks),))


def nvfp4_moe_glu(x_1K: Any, gate: ExpertPtrTable, up: ExpertPtrTable, ids_S: Any, start: int, count: int,
                  limit: float, gate_SN: Any, up_SN: Any, act_SN: Any) -> None:
    """Decode gate, up and the clamped SwiGLU of every slot of one row in ONE launch."""
    s, n, k = ids_S.size, gate.n, gate.k
    _check("x", x_1K, BF16), _check("ids", ids_S, I32, 4)
    _check_shape("x", x_1K, (1, k))
    for name, a in (("gate", gate_SN), ("up", up_SN), ("act", act_SN)):
        _check(name, a, BF16, 2), _check_shape(name, a, (s, n))
    if _ring_ok(n, k, s, 2):
        blocks, smem, suffix = _ring_geometry(n, s, 2)
        _launch(_RING, f"nvfp4_ring_moe_glu_{suffix}", (blocks, 1, 1), (RING_WARPS * 32, 1, 1),
                (x_1K, gate.packed_ptrs, gate.scale_ptrs, gate.scale2, up.packed_ptrs, up.scale_ptrs, up.scale2,
                 ids_S, _i32(s), _i32(start), _i32(count), gate_SN, up_SN, act_SN, _i32(n), _i32(k),
                 np.float32(limit)), smem=smem)
        return
    head = (x_1K, gate.packed_ptrs, gate.scale_ptrs, gate.scale2, up.packed_ptrs, up.scale_ptrs, up.scale2,
            ids_S, _i32(start), _i32(count), gate_SN, up_SN, act_SN, _i32(n), _i32(k))
    grid_x, ks = _mma_geometry(n, k, 2 * s)
    _launch(_NVFP4, "nvfp4_mma_moe_glu", (grid_x, s, 1), _NVFP4_BLOCK, head + (_i32(ks), np.float32(limit)))


def _union_dims(u_eid_U: Any, u_slot_UR: Any, out_RKN: Any, what: str) -> tuple[int, int]:
    r, k = out_RKN.shape[0], out_RKN.shape[1]
    if not 1 <= r <= MMA_MAX_X_ROWS:
        raise ValueError(f"{what}: {r} rows; one union launch covers 1..{MMA_MAX_X_ROWS} rows (the mma's B columns)")
    if r * k > UNION_MAX_IDS:
        raise ValueError(f"{what}: rows * top_k = {r * k} exceeds the union table's {UNION_MAX_IDS} ids")
    _check("u_eid", u_eid_U, I32, 4), _check("u_slot", u_slot_UR, I32, 4)
    _check_shape("u_eid", u_eid_U, (r * k,)), _check_shape("u_slot", u_slot_UR, (r * k, r))
    return r, k


def nvfp4_moe_gemv_union(x: Any, per_slot_input: bool, proj: ExpertPtrTable, u_eid_U: Any, u_slot_UR: Any,
                         start: int, count: int, out_RKN: Any) -> None:
    """R = 2..8 rows (grid.y = union entry): each union expert's weights swept once for every row
    that chose it. ``x`` is ``[R, Kin]`` or, ``per_slot_input``, ``[R, K, Kin]``."""
    r, k = _union_dims(u_eid_U, u_slot_UR, out_RKN, "nvfp4_moe_gemv_union")
    _check("x", x, BF16), _check("out", out_RKN, BF16)
    _check_shape("x", x, (r, k, proj.k) if per_slot_input else (r, proj.k))
    _check_shape("out", out_RKN, (r, k, proj.n))
    x_row = proj.k * (k if per_slot_input else 1)
    tables = (proj.packed_ptrs, proj.scale_ptrs, proj.scale2, u_eid_U, u_slot_UR)
    grid_x, ks = _mma_geometry(proj.n, proj.k, r * k)
    _launch(_NVFP4, "nvfp4_mma_moe_gemv_union", (grid_x, r * k, 1), _NVFP4_BLOCK,
            (x, _i64(x_row), _i64(proj.k if per_slot_input else 0), *tables, _i32(r), _i32(start), _i32(count),
             out_RKN, _i64(k * proj.n), _i32(proj.n), _i32(proj.k), _i32(ks)))


def nvfp4_moe_glu_union(x_RK: Any, gate: ExpertPtrTable, up: ExpertPtrTable, u_eid_U: Any, u_slot_UR: Any,
                        start: int, count: int, limit: float, gate_RKN: Any, up_RKN: Any, act_RKN: Any) -> None:
    """The union twin of ``nvfp4_moe_glu``: gate, up and SwiGLU of R = 2..8 rows in ONE launch."""
    r, k = _union_dims(u_eid_U, u_slot_UR, act_RKN, "nvfp4_moe_glu_union")
    n, kin = gate.n, gate.k
    _check("x", x_RK, BF16), _check_shape("x", x_RK, (r, kin))
    for name, a in (("gate", gate_RKN), ("up", up_RKN), ("act", act_RKN)):
        _check(name, a, BF16, 2), _check_shape(name, a, (r, k, n))
    tables = (gate.packed_ptrs, gate.scale_ptrs, gate.scale2, up.packed_ptrs, up.scale_ptrs, up.scale2,
              u_eid_U, u_slot_UR)
    grid_x, ks = _mma_geometry(n, kin, 2 * r * k)
    _launch(_NVFP4, "nvfp4_mma_moe_glu_union", (grid_x, r * k, 1), _NVFP4_BLOCK,
            (x_RK, _i64(kin), *tables, _i32(r), _i32(start), _i32(count), gate_RKN, up_RKN, act_RKN,
             _i64(k * n), _i32(n), _i32(kin), _i32(ks), np.float32(limit)))


def nvfp4_sorted_gemv(x: Any, gather_rows: bool, sorted_token_ids_S: Any, expert_offsets: Any, num_experts: int,
                      proj: ExpertPtrTable, start: int, count: int, out_SN: Any) -> None:
    """Expert-sorted rows (grid.y = sorted row): row i of local expert e reads
    ``x[sorted_token_ids[i]]`` (``gather_rows``) or ``x[i]``; rows of remote experts are untouched."""
    s = sorted_token_ids_S.size
    _check("x", x, BF16), _check("sorted_token_ids", sorted_token_ids_S, I32, 4)
    _check("expert_offsets", expert_offsets, I32, 4), _check("out", out_SN, BF16)
    _check_shape("expert_offsets", expert_offsets, (num_experts + 1,))
    _check_shape("out", out_SN, (s, proj.n))
    if x.ndim != 2 or x.shape[1] != proj.k or (not gather_rows and x.shape[0] != s):
        raise ValueError(f"x: shape {tuple(x.shape)}, expected [rows, {proj.k}]"
                         + ("" if gather_rows else f" with {s} rows"))
    if s == 0:
        return
    args = (x, _i32(int(gather_rows)), sorted_token_ids_S, expert_offsets, _i32(num_experts), proj.packed_ptrs,
            proj.scale_ptrs, proj.scale2, _i32(start), _i32(count), out_SN, _i32(proj.n), _i32(proj.k))
    grid_x, ks = _mma_geometry(proj.n, proj.k, s)
    _launch(_NVFP4, "nvfp4_mma_sorted_gemv", (grid_x, s, 1), _NVFP4_BLOCK, args + (_i32(ks),))


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
             expert_offsets, token_to_perm_TK), smem=4 * num_experts)

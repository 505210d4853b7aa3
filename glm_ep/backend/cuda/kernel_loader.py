"""ONE cached loader for every kernel of glm_ep, the ``-D`` constants it compiles them with, and
the launch and argument checks every wrapper module (``dense``, ``elementwise``, ``route_kernels``,
``routed``, ``grouped``) shares.

Every kernel lives in ``glm_ep/backend/cuda/kernels/*.cu`` and is compiled by NVRTC (``cupy.RawModule``) for
the device's own arch, once per (file, device); a ``#line`` marker in front of every inlined piece
makes compiler errors name the ``.cu`` file and line. Every number a kernel and its wrappers must
agree on is defined HERE and passed to every file as ``-D``: the constants (``DEFINES``; a ``.cu``
that uses one ``#error``s without it, and ``static_assert``s the value its code is written for),
and the shared-memory layouts the wrappers size launches by (``layout_defines``: each
``static_assert``ed against the ``sizeof`` of the kernel's own stage struct). Limits of the device
(SMs, shared memory) are read from it. Wrappers check dtype, contiguity and 16-byte alignment
(``check``), pass scalars as ``np.int32`` / ``np.int64`` / ``np.float32``, and launch on the
current CuPy stream (the backend makes its own stream current around every op).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from glm_ep.backend.base import KERNEL_LIMITS
from glm_ep.config.topology import RING_GLU_KERNELS, UNION_RING_KERNELS
from glm_ep.backend.cuda import pdl

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"

# ---- compile-time constants (-D) and the kernel limits they fix ---------------------------------
NVFP4_WARPS = 8  # warps per NVFP4 GEMV block
RING_WARPS = 2  # warps per block of the persistent decode kernels (gemv_nvfp4_ring.cu)
# items a warp of a ring launch has on average from which it claims them from a counter (``ring_claims``) rather than
# taking every W-th: H100, 2026-12-07 (docs/perf/DESIGN-NOTES.md), the verify site 1-5% faster at 4..8 rows (3.75-8
# items a warp: 4 rows' union launches have 3.75), 1-4 us slower at 2..3 rows (2-2.9) and 3-4 at one row (about one)
RING_CLAIMS_MIN_ITEMS = 3
GEMV_WARPS = 8  # warps per bf16 GEMV block
GEMV_ROWS_PER_WARP = 2  # rows per warp-group of a bf16 GEMV
GEMV_MAX_ROWS = KERNEL_LIMITS.max_gemv_rows  # widest batch-M tier (bf16_gemv_r1 .. r8)
MMA_ROWS = 16  # weight rows per warp group of the NVFP4 kernels: the m16n8k16 mma's A operand
WSTREAM_WARPS = 4  # warps per block of the warp-streaming GEMM (mma_bf16.cu, bf16_wstream_*), each its own ring
WSTREAM_DEPTH = 2  # stages of each warp's ring (16 rows x 512 bytes a stage)
WSTREAM_STAGE_K = 256  # k of one stage: one 16-byte copy a lane a weight row (the kernel's lane layout fixes it)
WSTREAM_TIERS = (8, 16)  # rows one warp-streaming launch covers (bf16_wstream_*_t{T})
ELEM_THREADS = 256
COMBINE_THREADS = 128
COMBINE_VEC = 8  # hidden elements per combine thread: one 16-byte vector of bf16
UNION_MAX_IDS = KERNEL_LIMITS.max_union_ids  # rows * top_k of one union table: ONE block of that many threads
UNION_MAX_ROWS = KERNEL_LIMITS.max_row_group  # rows of one union sweep (gemv_nvfp4.cu): the mma's 8 B columns
ROUTER_MAX_TOP_K = KERNEL_LIMITS.max_top_k  # experts the router keeps per row (router.cu: float w[ROUTER_MAX_TOP_K])
SORT_THREADS = 1024

DEFINES = {
    "NVFP4_WARPS": NVFP4_WARPS,
    "RING_WARPS": RING_WARPS,
    "RING_CLAIMS_MIN_ITEMS": RING_CLAIMS_MIN_ITEMS,
    "GEMV_WARPS": GEMV_WARPS,
    "GEMV_ROWS_PER_WARP": GEMV_ROWS_PER_WARP,
    "WSTREAM_WARPS": WSTREAM_WARPS,
    "WSTREAM_DEPTH": WSTREAM_DEPTH,
    "WSTREAM_STAGE_K": WSTREAM_STAGE_K,
    "ELEM_THREADS": ELEM_THREADS,
    "COMBINE_THREADS": COMBINE_THREADS,
    "COMBINE_VEC": COMBINE_VEC,
    "MMA_ROWS": MMA_ROWS,
    "UNION_MAX_IDS": UNION_MAX_IDS,
    "ROUTER_MAX_TOP_K": ROUTER_MAX_TOP_K,
    "SORT_THREADS": SORT_THREADS,
}

#: what these kernels can do, as the dispatch, the stack and the lever checks read it
CAPABILITIES = dataclasses.replace(KERNEL_LIMITS, capture=True)

# ---- the kernel variants and the shared-memory layouts the launches are sized by ----------------
#: gemm_nvfp4.cu's GEMM_NARROW / GEMM_PLACED / GEMM_VARIANT (WM = 1), GEMM_TILED (WM > 1) and GEMM_WGMMA lines:
#: (rows per tile BM, warps along the rows WM, warps of 32 weight rows along the columns WN, k per stage BK,
#: stages, the mma: "sync" (mma.sync with the x rows as its m16 side, every arch), "narrow" (mma.sync with the
#: x rows as its n8 side, every arch), "placed" (narrow, dequantized by bit placement instead of the lookup) or
#: "wgmma" (sm_90a: the weights as wgmma's A operand in registers, the x rows its n side; WN / 2 warpgroups of 64
#: weight rows each, WM = 2))
GEMM_VARIANTS = ((8, 1, 4, 64, 4, "narrow"), (16, 1, 4, 64, 4, "narrow"), (16, 1, 4, 128, 3, "narrow"),
                 (16, 1, 4, 128, 3, "placed"), (64, 1, 4, 64, 4, "narrow"),
                 (64, 1, 8, 128, 3, "sync"), (128, 2, 4, 64, 3, "sync"), (128, 2, 8, 64, 6, "wgmma"),
                 (64, 2, 4, 64, 6, "wgmma"))
#: The stage sweep (``glm-ep bench --prefill --gemm-stages``): the default tiles' other stage counts, and the blocks
#: an SM each tile's launch bounds ask for (its shipped line's), built apart from the shipped variants in
#: GEMM_SWEEP_FILE, a build of gemm_nvfp4.cu with only these (entries ``..._s{stages}``). A count whose stages
#: leave fewer blocks an SM than asked still runs: the bench times what it is.
GEMM_SWEEP_STAGES = {(16, 1, 4, 128, 3, "placed"): ((2, 4), 4), (64, 1, 4, 64, 4, "narrow"): ((3, 5, 6), 3),
                     (64, 2, 4, 64, 6, "wgmma"): ((4, 8), 2), (128, 2, 8, 64, 6, "wgmma"): ((4, 8), 1)}
GEMM_SWEEP_VARIANTS = tuple((*v[:4], st, v[5]) for v, (counts, _) in GEMM_SWEEP_STAGES.items() for st in counts)
GEMM_SWEEP_FILE = "gemm_nvfp4.cu+stages"
#: gemv_nvfp4_ring.cu's RING_ONE_ENTRIES lines: (steps of 128 k per slab T, ring depth D); one geometry, the
#: fastest measured (docs/perf/DESIGN-NOTES.md). Its RING_GLU_ENTRY lines (gate + up) are RING_GLU_KERNELS and
#: gemv_nvfp4_union.cu's RING_UNION_ENTRIES lines UNION_RING_KERNELS: (T, D) pairs the topology's ring levers
#: name, listed once in config/topology.py (imported above)
RING_KERNELS = ((4, 2),)
#: the x rows a union stage holds (a group's rows rounded up), each with every UNION_RING_KERNELS pair
UNION_RING_ROWS = (2, 4, 6, 8)


def gemm_stage_bytes(bm: int, bn: int, bk: int) -> int:
    """One pipeline stage of the grouped GEMM (``GemmStage<BM, BN, BK>``): BM rows of x (BK bf16 each),
    BN weight rows of BK / 2 packed bytes and BK / 16 scale bytes."""
    return bm * bk * 2 + bn * bk // 2 + bn * bk // 16


def gemm_smem_bytes(bm: int, wm: int, wn: int, bk: int, stages: int, mma: str = "sync") -> int:
    """A variant's dynamic shared memory: its stages, and for the tiled engine (WM > 1) two bf16 weight
    tiles (the dequantized stage and the next). The wgmma engine: its stages and 1024 bytes to align them."""
    bn = 32 * wn
    if mma == "wgmma":
        return stages * gemm_stage_bytes(bm, bn, bk) + 1024
    return stages * gemm_stage_bytes(bm, bn, bk) + (2 * bn * bk * 2 if wm > 1 else 0)


def gemm_suffix(bm: int, wm: int, wn: int, bk: int, stages: int, mma: str = "sync") -> str:
    """The entry-point suffix of a variant (``nvfp4_gemm_sorted[_glu]_{suffix}``); a stage sweep's variant (not in
    GEMM_VARIANTS) ends in ``_s{stages}``."""
    if (bm, wm, wn, bk, stages, mma) in GEMM_SWEEP_VARIANTS:
        return f"{gemm_suffix(bm, wm, wn, bk, 0, mma)}_s{stages}"
    if mma == "wgmma":
        return f"m{bm}wg{wn}k{bk}"
    if mma in ("narrow", "placed"):
        return f"m{bm}w{wn}k{bk}{mma[0]}"
    return f"m{bm}w{wn}k{bk}" if wm == 1 else f"m{bm}w{wm}x{wn}k{bk}"


def ring_stage_bytes(p: int, t: int, rows: int = 1) -> int:
    """One ring stage of one warp (``RingStage<P, T, R>``): P x 16 rows x 64 T weight bytes, P x 16 x
    8 T scale bytes, 256 T bytes of each of the R x rows (1: decode)."""
    return p * MMA_ROWS * 64 * t + p * MMA_ROWS * 8 * t + rows * 256 * t


def gemm_sweep_instances() -> str:
    """GEMM_SWEEP_FILE's instantiations (gemm_nvfp4.cu's GEMM_NARROW_OF / GEMM_WGMMA_OF), one line of text."""
    lines = []
    for v, (counts, blocks) in GEMM_SWEEP_STAGES.items():
        bm, _, wn, bk, _, mma = v
        for st in counts:
            suf = f"_s{st}"
            if mma == "wgmma":
                lines.append(f"GEMM_WGMMA_OF({bm},{wn},{st},{blocks},{suf},{suf.upper()})")
            else:
                placed, tag = (mma == "placed"), mma[0]
                lines.append(f"GEMM_NARROW_OF({bm},{bm // 8},{wn},{bk},{st},{blocks},{str(placed).lower()},{tag},"
                             f"{tag.upper()},{suf},{suf.upper()})")
    return " ".join(lines)


def layout_defines() -> dict[str, int]:
    """The dynamic shared memory of every grouped-GEMM variant (``GEMM_SMEM_`` + its upper-case suffix) and
    the bytes of every ring stage (``RING_STAGE_BYTES_P{P}_T{T}``, union ones ``..._R{R}``), as the
    wrappers compute them."""
    out = {f"GEMM_SMEM_{gemm_suffix(*v).upper()}": gemm_smem_bytes(*v) for v in GEMM_VARIANTS}
    for t in sorted({t for t, _ in RING_KERNELS + RING_GLU_KERNELS}):
        out.update({f"RING_STAGE_BYTES_P{p}_T{t}": ring_stage_bytes(p, t) for p in (1, 2)})
    for t in sorted({t for t, _ in UNION_RING_KERNELS}):
        out.update({f"RING_STAGE_BYTES_P{p}_T{t}_R{r}": ring_stage_bytes(p, t, r)
                    for p in (1, 2) for r in UNION_RING_ROWS})
    return out


BF16 = np.dtype(ml_dtypes.bfloat16)
F32, I32, U8, U32 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint8), np.dtype(np.uint32)


def define_options(name: str = "") -> tuple[str, ...]:
    """The ``-D`` options every kernel file is compiled with (NVRTC here, nvcc in the build check); ``name``
    GEMM_SWEEP_FILE: with its variants' shared memory too."""
    sweep = ({f"GEMM_SMEM_{gemm_suffix(*v).upper()}": gemm_smem_bytes(*v) for v in GEMM_SWEEP_VARIANTS}
             if name == GEMM_SWEEP_FILE else {})
    return tuple(f"-D{k}={v}" for k, v in {**DEFINES, **layout_defines(), **sweep}.items())


def kernel_files() -> list[Path]:
    return sorted(KERNEL_DIR.glob("*.cu"))


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.M)


def source_file(name: str) -> str:
    """The kernel file a build is of: ``name`` itself, or for a build of a file with other defines ("file+what",
    GEMM_SWEEP_FILE) the file."""
    return name.split("+")[0]


def kernel_source(name: str) -> str:
    """The text NVRTC compiles: the file with its local ``#include "x.cuh"`` inlined (so CuPy's
    cache key covers the headers too), each piece behind a ``#line`` marker. A build of a file with other
    defines (``name`` "file+what") is the file's text; GEMM_SWEEP_FILE's opens with its GEMM_SWEEP (a ``-D`` would
    do, but nvcc splits a define's value at its commas)."""
    head = f"#define GEMM_SWEEP {gemm_sweep_instances()}\n" if name == GEMM_SWEEP_FILE else ""
    name = source_file(name)
    path = KERNEL_DIR / name
    text = path.read_text()
    out, pos = [f'{head}#line 1 "{name}"\n'], 0
    for m in _LOCAL_INCLUDE.finditer(text):
        header = m.group(1)
        out.append(text[pos:m.start()])
        line = text.count("\n", 0, m.end()) + 2
        body = re.sub(r"^#pragma once[ \t]*$", "", (KERNEL_DIR / header).read_text(), flags=re.M)  # keeps lines
        out.append(f'#line 1 "{header}"\n{body}\n#line {line} "{name}"\n')
        pos = m.end() + 1
    out.append(text[pos:])
    return "".join(out)


# ---- loading and launching ------------------------------------------------------------------------
#: files built for an arch-specific target on a device of that compute capability (wgmma needs sm_90a)
ARCH_SPECIFIC = {"gemm_nvfp4.cu": {(9, 0): "sm_90a"}}


@functools.cache
def _module(name: str, device: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        cubin = arch_build(name, device)
        if cubin is None:  # C++17: CuPy's default
            return cupy.RawModule(code=kernel_source(name), options=define_options(name))
        return cupy.RawModule(path=str(cubin))


@functools.cache
def arch_build(name: str, device: int) -> Path | None:
    """The arch-specific build of ``name`` for ``device`` (``ARCH_SPECIFIC``), or None where the file
    has none for this device or NVRTC cannot build it (then the plain build serves and the
    arch-specific kernels are not offered: a warning says why)."""
    target = ARCH_SPECIFIC.get(source_file(name), {}).get(compute_capability(device))
    if target is None:
        return None
    try:
        return _arch_cubin(name, target)
    except RuntimeError as e:
        log.warning("%s; building it for the plain arch instead, without its %s kernels", e, target)
        return None


def _arch_cubin(name: str, target: str) -> Path:
    """``name`` built by NVRTC for ``target`` (CuPy builds for the plain arch only), with the options
    CuPy would add; cached in CuPy's kernel cache directory, keyed by source, options and NVRTC."""
    from cupy_backends.cuda.libs import nvrtc

    src = kernel_source(name)
    opts = (*define_options(name), "-std=c++17", "-ftz=true", f"-arch={target}")
    key = hashlib.sha256(repr((src, opts, nvrtc.getVersion())).encode()).hexdigest()[:32]
    cache = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))  # CuPy's own default
    path = cache / f"glm_ep_{Path(source_file(name)).stem}_{target}_{key}.cubin"
    if path.exists():
        return path
    prog = nvrtc.createProgram(src, name, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"{name}: NVRTC failed for {target}:\n{nvrtc.getProgramLog(prog)}") from e
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(cubin)
    os.replace(tmp, path)  # atomic: ranks or threads building at once each publish a whole file
    return path


@functools.cache
def compute_capability(device: int) -> tuple[int, int]:
    import cupy

    cc = cupy.cuda.Device(device).compute_capability  # "90", "121"
    return int(cc[:-1]), int(cc[-1])


@functools.cache
def _function(name: str, entry: str, device: int) -> Any:
    return _module(name, device).get_function(entry)


@functools.cache
def _static_smem(name: str, entry: str, device: int) -> int:
    """The entry's statically allocated shared memory, in bytes (a driver query: asked once)."""
    return int(_function(name, entry, device).shared_size_bytes)


@functools.cache
def device_attr(device: int, key: str) -> int:
    """A ``cudaDeviceAttr`` of ``device`` by CuPy's name (``cudaDevAttr`` dropped), read once."""
    import cupy

    return int(cupy.cuda.Device(device).attributes[key])


def current_device() -> int:
    import cupy

    return cupy.cuda.Device().id


def sm_count() -> int:
    """Streaming multiprocessors of the current device."""
    return device_attr(current_device(), "MultiProcessorCount")


def smem_per_sm() -> tuple[int, int]:
    """(shared memory of one SM, what each resident block reserves of it besides its own) of the
    current device: 228 KB and 1 KB on sm_90."""
    dev = current_device()
    return device_attr(dev, "MaxSharedMemoryPerMultiprocessor"), device_attr(dev, "ReservedSharedMemoryPerBlock")


def block_smem_limit() -> int:
    """Shared memory one block of the current device may opt into: 227 KB on sm_90, 99 KB on a GB10 (sm_121)."""
    return device_attr(current_device(), "MaxSharedMemoryPerBlockOptin")


def launch(file: str, entry: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
           smem: int = 0, persistent: bool = False) -> None:
    """Launch ``entry`` of ``file`` on the current stream; ``smem`` bytes of dynamic shared memory
    (opted into past the device's default per block, refused past its opt-in limit). Inside
    ``pdl.dependent_launches(True)`` the launch may overlap the previous kernel's tail (``pdl``),
    unless ``persistent``: a grid sized to sit evenly on every SM at once with its work split
    statically (the decode rings) starts on an idle device, since blocks placed while the previous
    kernel drains crowd the SMs that free first (measured slower as dependents:
    docs/perf/DESIGN-NOTES.md)."""
    dev = current_device()
    fn = _function(file, entry, dev)
    total = smem + _static_smem(file, entry, dev)  # static shared memory counts against the same limit
    if total > device_attr(dev, "MaxSharedMemoryPerBlock") and fn.max_dynamic_shared_size_bytes < smem:
        limit = block_smem_limit()
        if total > limit:
            raise ValueError(f"{entry}: needs {total} bytes of shared memory ({smem} dynamic), the device "
                             f"allows {limit}")
        fn.max_dynamic_shared_size_bytes = smem
    if pdl.active() and not persistent:
        import cupy

        pdl.launch(fn.kernel.ptr, grid, block, args, smem, cupy.cuda.get_current_stream().ptr)
        return
    fn(grid, block, args, shared_mem=smem)


# ---- argument checks and launch arithmetic --------------------------------------------------------
def check(name: str, a: Any, dtype: np.dtype, align: int = 16) -> None:
    """``a`` has ``dtype``, is C-contiguous and its data is ``align``-byte aligned."""
    if a.dtype != dtype:
        raise TypeError(f"{name}: dtype {a.dtype}, expected {dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {a.strides}")
    if align and a.data.ptr % align:
        raise ValueError(f"{name}: data at {a.data.ptr:#x} is not {align}-byte aligned")


def check_shape(name: str, a: Any, shape: tuple[int, ...]) -> None:
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {tuple(shape)}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_k(groups: int, copies: int, steps: int, block_warps: int, warps_per_sm: int, min_steps: int,
            sms: int) -> tuple[int, int]:
    """(grid.x, ksplit) of a tensor-core launch whose blocks hold ``block_warps`` warps and whose row
    groups (``copies`` times over: slots, matrices) are each swept by ``ksplit`` consecutive warps:
    K is halved while the launch holds fewer than ``warps_per_sm`` warps per SM and each slice
    keeps at least ``min_steps`` steps."""
    ks = 1
    while ks < block_warps and groups * copies * ks < warps_per_sm * sms and steps >= 2 * min_steps * ks:
        ks *= 2
    return cdiv(groups, block_warps // ks), ks


def i32(v: int) -> np.int32:
    return np.int32(v)


def i64(v: int) -> np.int64:
    return np.int64(v)

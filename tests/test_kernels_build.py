"""Every kernel file compiles with nvcc for the H200 (sm_90) and the GB10 (sm_121).

Runs without a GPU (CI). What is compiled is the exact text NVRTC gets at run time
(``loader.kernel_source``: local headers inlined, the loader's -D constants), so a failure here
is a failure there, reported with nvcc's own message.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from glm_ep.backend.cuda import grouped, loader, nvfp4

NVCC = shutil.which("nvcc") or next((str(p) for p in [Path("/usr/local/cuda/bin/nvcc")] if p.is_file()), None)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (no CUDA toolkit on PATH or in /usr/local/cuda)")
FILES = loader.kernel_files()


def test_kernel_files_exist():
    assert {p.name for p in FILES} >= {"gemv_bf16.cu", "gemv_nvfp4.cu", "router.cu", "elementwise.cu", "moe_route.cu"}


@pytest.mark.parametrize("path", sorted(loader.KERNEL_DIR.glob("*.cu*")), ids=lambda p: p.name)
def test_no_system_headers(path):
    """NVRTC compiles without the CUDA or system headers: only local "x.cuh" includes."""
    bad = [line for line in path.read_text().splitlines() if re.match(r"\s*#\s*include\s*<", line)]
    assert not bad, f"{path.name} includes system headers: {bad}"


def test_mirrored_constants():
    """Constants a .cu states itself must agree with the grid arithmetic of the wrappers."""
    for name, const, value in (("elementwise.cu", "COMBINE_VEC", loader.COMBINE_VEC),
                               ("gemv_nvfp4.cu", "MMA_ROWS", nvfp4.MMA_ROWS)):
        text = (loader.KERNEL_DIR / name).read_text()
        assert re.search(rf"#define {const} {value}\b", text), f"{name}: {const} differs from the wrappers ({value})"


def test_instantiated_variants():
    """The kernel variants the wrappers launch are the ones the .cu files instantiate."""
    gemm = (loader.KERNEL_DIR / "gemm_nvfp4.cu").read_text()
    rows = re.findall(r"^GEMM_VARIANT\((\d+), (\d+), (\d+), (\d+), (\d+), \d+\)", gemm, re.M)
    assert all(int(bm) == 16 * int(mt) for bm, mt, *_ in rows), rows
    assert {(int(bm), int(w), int(bk), int(st)) for bm, _, w, bk, st in rows} == set(grouped.GEMM_VARIANTS)
    mma = (loader.KERNEL_DIR / "mma_bf16.cu").read_text()
    assert tuple(int(t) for t in re.findall(r"^MMA_GEMM_ENTRIES\((\d+)\)", mma, re.M)) == loader.MMA_GEMM_TIERS


def test_split_k():
    """K is halved while the launch is short of warps and each slice keeps its minimum of steps."""
    split = loader.split_k
    # GLM gate + up decode: 128 row groups x 16 slot-matrices, 32 steps: one split fills 132 SMs
    assert split(128, 16, 32, 8, 16, 4, sms=132) == (32, 2)
    assert split(128, 1, 32, 8, 16, 4, sms=132) == (128, 8)  # one copy: split to 8 warps of 4 steps
    assert split(128, 1, 7, 8, 16, 4, sms=132) == (16, 1)  # too few steps to split at all
    assert split(768, 1, 128, 8, 16, 16, sms=132) == (384, 4)  # the dense FFN at 9..64 rows


def test_gemm_variant_choice():
    """Few rows per expert take the 16-row tiles, many the 64-row ones; every default is built, and
    a variant's shared memory is its stages of x rows, packed weights and scales."""
    nv = grouped
    assert nv.gemm_variant(16 * 8, 288)[0] == 16
    assert nv.gemm_variant(1024 * 8, 288)[0] == 32
    assert nv.gemm_variant(4096 * 8, 288)[0] == 64
    assert set(nv.GEMM_DEFAULT.values()) <= set(nv.GEMM_VARIANTS)
    geo = nv.GemmGeometry.of((64, 4, 64, 4))
    assert (geo.bn, geo.threads, geo.smem) == (128, 128, 4 * (64 * 64 * 2 + 128 * 32 + 128 * 4))
    assert geo.tiles(slots=1000, count=16) == 16 + 16  # ceil(1000 / 64) row tiles + one partial per expert
    with pytest.raises(ValueError, match="instantiates"):
        nv.GemmGeometry.of((48, 4, 64, 4))


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90", "sm_121"])
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_compiles(path: Path, arch: str, tmp_path: Path):
    src = tmp_path / path.name
    src.write_text(loader.kernel_source(path.name))
    cmd = [NVCC, "--cubin", f"-arch={arch}", "-std=c++17", *loader.define_options(), "-o",
           str(tmp_path / "out.cubin"), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"nvcc -arch={arch} failed on {path.name}:\n{r.stdout}{r.stderr}"

"""Every kernel file compiles with nvcc for the H200 (sm_90) and the GB10 (sm_121).

Runs without a GPU (CI). What is compiled is the exact text NVRTC gets at run time
(``loader.kernel_source``: local headers inlined, the loader's -D constants), so a failure here
is a failure there, reported with nvcc's own message.
"""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from glm_ep.backend.cuda import grouped, kernel_loader as loader

import _kernel_builds as kb
from _kernel_builds import ARCHS, FILES, NVCC, Build, built_for as _built_for

needs_nvcc = pytest.mark.skipif(not kb.HAVE_NVCC,
                                reason="nvcc and ptxas not found (no CUDA toolkit on PATH or in /usr/local/cuda)")
H200_BLOCK_SMEM, GB10_BLOCK_SMEM = 232448, 101376  # shared memory one block may opt into (sm_90, sm_121)


def test_kernel_files_exist():
    assert {p.name for p in FILES} >= {"gemv_bf16.cu", "gemv_nvfp4.cu", "router.cu", "elementwise.cu", "moe_route.cu"}


@pytest.mark.parametrize("path", sorted(loader.KERNEL_DIR.glob("*.cu*")), ids=lambda p: p.name)
def test_no_system_headers(path):
    """NVRTC compiles without the CUDA or system headers: only local "x.cuh" includes."""
    bad = [line for line in path.read_text().splitlines() if re.match(r"\s*#\s*include\s*<", line)]
    assert not bad, f"{path.name} includes system headers: {bad}"


def test_every_define_a_kernel_needs_is_passed():
    """Each name a .cu refuses to compile without (``#ifndef X`` + ``#error``) is a -D of the loader."""
    passed = {opt[2:].split("=")[0] for opt in loader.define_options()}
    for path in loader.KERNEL_DIR.glob("*.cu*"):
        needed = set(re.findall(r"^#ifndef (\w+)\s*\n#error", path.read_text(), re.M))
        needed |= {n for a, b in re.findall(r"^#if !defined\((\w+)\) \|\| !defined\((\w+)\)", path.read_text(), re.M)
                   for n in (a, b)}
        assert needed <= passed, f"{path.name} needs {sorted(needed - passed)}, which the loader does not pass"


@pytest.mark.parametrize("path", sorted(loader.KERNEL_DIR.glob("*.cu*")), ids=lambda p: p.name)
def test_every_kernel_file_names_its_numpy_twin_and_its_test(path: Path):
    """A kernel file's opening comment says which NumPy code it must agree with and which tests hold the two
    together; every test file it names exists."""
    comment = re.match(r"(?:[ \t]*//[^\n]*\n)*", path.read_text()).group(0)
    head = " ".join(line.strip().lstrip("/").strip() for line in comment.splitlines())  # the text, unwrapped
    assert "NumPy twin:" in head and "held together by" in head, f"{path.name}: its header names no twin or test"
    named = set(re.findall(r"(test_\w+\.py)", head))
    assert named, f"{path.name}: its header names no test file"
    tests = {p.name for p in (Path(__file__).resolve().parents[1]).rglob("test_*.py")}
    assert named <= tests, f"{path.name} names {sorted(named - tests)}, which do not exist"


@needs_nvcc
@pytest.mark.parametrize("name,file", [("COMBINE_VEC", "elementwise.cu"), ("MMA_ROWS", "gemv_nvfp4.cu"),
                                       ("RING_STAGE_BYTES_P2_T4", "gemv_nvfp4_ring.cu"),
                                       ("GEMM_SMEM_M64W8K128", "gemm_nvfp4.cu"),
                                       ("GEMM_SMEM_M128W2X4K64", "gemm_nvfp4.cu"),
                                       ("GEMM_SMEM_M128WG8K64", "gemm_nvfp4.cu"),
                                       ("WSTREAM_STAGE_K", "mma_bf16.cu")])
def test_a_constant_that_differs_from_the_kernel_does_not_compile(name: str, file: str, tmp_path: Path):
    """The .cu files static_assert the values and layouts the wrappers size their launches by: a
    loader that disagreed with the kernel by one would fail the build, not corrupt memory."""
    opts = [o if not o.startswith(f"-D{name}=") else f"-D{name}={int(o.split('=')[1]) + 1}"
            for o in loader.define_options()]
    assert opts != list(loader.define_options())
    src = tmp_path / file
    src.write_text(loader.kernel_source(file))
    r = subprocess.run([NVCC, "--cubin", "-arch=sm_90", "-std=c++17", *opts, "-o", str(tmp_path / "out.cubin"),
                        str(src)], capture_output=True, text=True)
    assert r.returncode != 0 and "static assertion failed" in r.stdout + r.stderr, r.stdout + r.stderr


def test_instantiated_variants():
    """The kernel variants the wrappers launch are the ones the .cu files instantiate."""
    gemm = (loader.KERNEL_DIR / "gemm_nvfp4.cu").read_text()
    rows = re.findall(r"^GEMM_VARIANT\((\d+), (\d+), (\d+), (\d+), (\d+), \d+\)", gemm, re.M)
    tiled = re.findall(r"^GEMM_TILED\((\d+), (\d+), (\d+), (\d+), (\d+), (\d+), \d+\)", gemm, re.M)
    narrow = re.findall(r"^GEMM_NARROW\((\d+), (\d+), (\d+), (\d+), (\d+), \d+\)", gemm, re.M)
    placed = re.findall(r"^GEMM_PLACED\((\d+), (\d+), (\d+), (\d+), (\d+), \d+\)", gemm, re.M)
    assert rows and tiled and narrow and placed
    assert all(int(bm) == 16 * int(mt) for bm, mt, *_ in rows), rows
    assert all(int(bm) == 8 * int(mt) for bm, mt, *_ in narrow + placed), narrow + placed
    assert all(int(bm) == 16 * int(mt) * int(wm) and int(wm) > 1 for bm, mt, wm, *_ in tiled), tiled
    wgmma = re.findall(r"^GEMM_WGMMA\((\d+), (\d+), (\d+), \d+\)", gemm, re.M)
    assert wgmma
    found = {(int(bm), 1, int(w), int(bk), int(st), "sync") for bm, _, w, bk, st in rows}
    found |= {(int(bm), int(wm), int(wn), int(bk), int(st), "sync") for bm, _, wm, wn, bk, st in tiled}
    found |= {(int(bm), 2, int(wn), 64, int(st), "wgmma") for bm, wn, st in wgmma}
    found |= {(int(bm), 1, int(w), int(bk), int(st), "narrow") for bm, _, w, bk, st in narrow}
    found |= {(int(bm), 1, int(w), int(bk), int(st), "placed") for bm, _, w, bk, st in placed}
    assert found == set(loader.GEMM_VARIANTS)
    ring = (loader.KERNEL_DIR / "gemv_nvfp4_ring.cu").read_text()
    for macro, forms, built in (("RING_ONE_ENTRIES", ("1, f16_", "2, bf16u_", "3, pl_"), loader.RING_KERNELS),
                                ("RING_GLU_ENTRY", ("1, f16_", "2, bf16u_"), loader.RING_GLU_KERNELS)):  # never placed
        for form in forms:
            found = re.findall(rf"^{macro}\((\d+), (\d+), {form}\)", ring, re.M)
            assert {(int(t), int(d)) for t, d in found} == set(built), (macro, form, found)
    assert len(re.findall(r"^RING_(ONE_ENTRIES|GLU_ENTRY)\(", ring, re.M)) == (3 * len(loader.RING_KERNELS)
                                                                               + 2 * len(loader.RING_GLU_KERNELS))
    union = (loader.KERNEL_DIR / "gemv_nvfp4_union.cu").read_text()
    found = re.findall(r"^RING_UNION_ENTRIES\((\d+), (\d+), (\d+)\)", union, re.M)
    assert sorted((int(r), int(t), int(d)) for r, t, d in found) == sorted(
        (r, t, d) for r in loader.UNION_RING_ROWS for t, d in loader.UNION_RING_KERNELS), found  # every pair, once
    mma = (loader.KERNEL_DIR / "mma_bf16.cu").read_text()
    assert tuple(int(t) for t in re.findall(r"^WSTREAM_ENTRIES\((\d+)\)", mma, re.M)) == loader.WSTREAM_TIERS


def test_split_k():
    """K is halved while the launch is short of warps and each slice keeps its minimum of steps."""
    split = loader.split_k
    # GLM gate + up decode: 128 row groups x 16 slot-matrices, 32 steps: one split fills 132 SMs
    assert split(128, 16, 32, 8, 16, 4, sms=132) == (32, 2)
    assert split(128, 1, 32, 8, 16, 4, sms=132) == (128, 8)  # one copy: split to 8 warps of 4 steps
    assert split(128, 1, 7, 8, 16, 4, sms=132) == (16, 1)  # too few steps to split at all


def test_staged_order_feeds_the_wgmma_fragments():
    """The staged k order (grouped.staged_order) is a permutation within each 64 k, and puts under each wgmma
    fragment pair the k its lane's placed pair holds: lane t of k step s, register j (a0 / a2 of a row) takes
    positions 16 s + 8 j + 2 t, + 1, and dequant_word_placed makes word j of the lane's 8 bytes (k 16 t + 8 j ..
    + 7) into pairs (k 16 t + 8 j + s, + 4), pair s for step s."""
    order = grouped.staged_order(192)
    assert sorted(order.tolist()) == list(range(192))
    assert all(set(order[c:c + 64] // 64) == {c // 64} for c in range(0, 192, 64))
    assert (order[:64] != np.arange(64)).any()
    for s in range(4):
        for j in range(2):
            for t in range(4):
                pos = 16 * s + 8 * j + 2 * t
                assert order[pos:pos + 2].tolist() == [16 * t + 8 * j + s, 16 * t + 8 * j + s + 4]
    with pytest.raises(ValueError, match="not a multiple of 64"):
        grouped.staged_order(96)


def test_gemm_variant_choice():
    """Few rows per expert take the narrow 16-row tile with the placed dequantization (to 16 rows an expert), more
    the narrow 64-row one, and where wgmma runs its 64-row tile past 13 rows an expert and its 128-row tile past 48;
    every default is built, and a variant's shared memory is its stages of x rows, packed weights and scales (and
    the two bf16 weight tiles)."""
    nv = grouped
    placed, narrow64 = (16, 1, 4, 128, 3, "placed"), (64, 1, 4, 64, 4, "narrow")
    assert nv.gemm_variant(16 * 8, 288, 4096) == placed  # the rows as the mma's n8 side
    assert nv.gemm_variant(2 * 288 + 1, 288, 4096) == placed
    assert nv.gemm_variant(16 * 288, 288, 4096) == placed
    assert nv.gemm_variant(16 * 288 + 1, 288, 4096) == narrow64
    assert nv.gemm_variant(4096 * 8, 288, 4096) == narrow64  # past the largest key: its variant
    assert nv.gemm_variant(16 * 288, 288, 4096 + 64) == (16, 1, 4, 64, 4, "narrow")  # 128 k does not divide K
    assert nv.gemm_variant(2 * 288, 288, 4096 + 64) == (16, 1, 4, 64, 4, "narrow")
    # one expert (a dense FFN stored NVFP4): the register engine to 32 rows, wgmma past it
    assert nv.gemm_variant(24, 1, 4096, wgmma=True) == narrow64
    assert nv.gemm_variant(33, 1, 4096, wgmma=True) == nv.GEMM_WGMMA
    # where wgmma runs (sm_90a): its 64-row tile past 13 rows per expert, its 128-row tile past 48, the same
    # choice below
    assert nv.gemm_variant(13 * 288, 288, 4096, wgmma=True) == placed
    assert nv.gemm_variant(13 * 288 + 1, 288, 4096, wgmma=True) == nv.GEMM_WGMMA_64 == (64, 2, 4, 64, 6, "wgmma")
    assert nv.gemm_variant(48 * 288, 288, 4096, wgmma=True) == nv.GEMM_WGMMA_64
    assert nv.gemm_variant(48 * 288 + 1, 288, 4096, wgmma=True) == nv.GEMM_WGMMA == (128, 2, 8, 64, 6, "wgmma")
    assert nv.gemm_variant(1024 * 8, 288, 4096 + 32, wgmma=True) == narrow64  # 64 k does not divide K
    assert nv.gemm_variant(4096 * 8, 288, 4096, wgmma=True) == nv.GEMM_WGMMA
    assert nv.gemm_variant(256 * 8, 288, 4096, wgmma=True) == nv.gemm_variant(256 * 8, 288, 4096)
    assert nv.gemm_variant(4096 * 8, 288, 4096 + 32, wgmma=True) == narrow64  # a stage of 64 k does not divide K
    assert (set(nv.GEMM_DEFAULT.values()) | set(nv.GEMM_FALLBACK.values()) | {nv.GEMM_WGMMA, nv.GEMM_WGMMA_64}
            <= set(nv.GEMM_VARIANTS))
    for v in nv.GEMM_DEFAULT.values():
        assert 64 % v[3] == 0 or v in nv.GEMM_FALLBACK, f"{v}: no fallback for an in width of 64 k steps"
    geo = nv.GemmGeometry.of((64, 1, 8, 128, 3, "sync"))
    assert (geo.bn, geo.threads, geo.smem) == (256, 256, 3 * (64 * 128 * 2 + 256 * 64 + 256 * 8))
    assert geo.tiles(slots=1000, count=16) == 16 + 15  # ceil(1000 / 64) row tiles + a partial per expert but one
    assert geo.tiles(slots=64, count=1) == 1 and geo.tiles(slots=0, count=5) == geo.tiles(slots=5, count=0) == 0
    assert geo.suffix == "m64w8k128"
    tiled = nv.GemmGeometry.of((128, 2, 4, 64, 3, "sync"))  # + the two bf16 weight tiles it dequantizes into
    assert (tiled.bn, tiled.threads, tiled.suffix) == (128, 256, "m128w2x4k64")
    assert tiled.smem == 3 * (128 * 64 * 2 + 128 * 32 + 128 * 4) + 2 * 128 * 64 * 2
    wg = nv.GemmGeometry.of((128, 2, 8, 64, 6, "wgmma"))  # four warpgroups of 64 weight rows; 6 stages, aligned
    assert (wg.bn, wg.threads, wg.suffix) == (256, 512, "m128wg8k64")
    assert wg.smem == 6 * (128 * 64 * 2 + 256 * 32 + 256 * 4) + 1024
    wg4 = nv.GemmGeometry.of((64, 2, 4, 64, 6, "wgmma"))  # two warpgroups x 64 rows: two blocks an SM
    assert (wg4.bn, wg4.threads, wg4.suffix) == (128, 256, "m64wg4k64")
    assert wg4.smem == 6 * (64 * 64 * 2 + 128 * 32 + 128 * 4) + 1024 and 2 * wg4.smem <= H200_BLOCK_SMEM
    narrow = nv.GemmGeometry.of((8, 1, 4, 64, 4, "narrow"))  # 64 x copies a stage: half the threads take one
    assert (narrow.bn, narrow.threads, narrow.suffix) == (128, 128, "m8w4k64n")
    assert narrow.smem == 4 * (8 * 64 * 2 + 128 * 32 + 128 * 4)
    p16 = nv.GemmGeometry.of(placed)  # the narrow tile's stages; the dequantization is the kernel's
    assert (p16.bn, p16.threads, p16.suffix, p16.smem) == (128, 128, "m16w4k128p", 3 * (16 * 128 * 2 + 128 * 64 + 128 * 8))
    with pytest.raises(ValueError, match="instantiates"):
        nv.GemmGeometry.of((48, 1, 4, 64, 4, "sync"))


@pytest.mark.parametrize("bm", [8, 16, 64, 128])
def test_gemm_tiles_bound_every_routing(bm: int):
    """The grid's row tiles cover every way the slots can fall on the local experts, and the bound is
    reached: the kernel's blocks past the last tile return, a tile beyond the grid would be lost."""
    geo = grouped.GemmGeometry.of(next(v for v in loader.GEMM_VARIANTS if v[0] == bm))
    rng = np.random.default_rng(bm)
    for _ in range(300):
        count, slots = int(rng.integers(1, 40)), int(rng.integers(1, 2000))
        cuts = np.sort(rng.integers(0, slots + 1, count - 1))
        rows = np.diff(np.concatenate([[0], cuts, [slots]]))
        assert sum(-(-int(r) // bm) for r in rows) <= geo.tiles(slots, count)
    worst = [bm + 1] * 3 + [1] * 5  # every expert's last tile nearly empty
    assert sum(-(-r // bm) for r in worst) == geo.tiles(sum(worst), len(worst))


def test_k_splits():
    """A launch of fewer blocks than SMs splits K into two blocks an SM (the dense FFN stored NVFP4: its down
    projection is 32 weight-row blocks over 192 stages of k), within the stages, the scratch and the partial
    sums' bytes cap; a launch with a block an SM, or one without a scratch, does not."""
    ks = grouped.k_splits
    assert ks(32, 192, 64 * 4096, 1 << 30, sms=132) == 8  # down at 64 rows, one expert
    assert ks(32, 192, 64 * 4096, 3 * 64 * 4096, sms=132) == 3  # the scratch holds three splits
    assert ks(32, 192, 1024 * 4096, 1 << 30, sms=132) == 1  # 16 MB of partials a split: past the cap
    assert ks(192, 64, 2 * 16 * 12288, 1 << 30, sms=132) == 1  # glu at 16 rows: 192 blocks, one an SM already
    assert ks(100, 64, 2 * 16 * 12288, 1 << 30, sms=132) == 3  # 300 blocks reach two an SM
    assert ks(32, 15, 64 * 4096, 1 << 30, sms=132) == 1  # 15 stages: one split keeps at least 8
    assert ks(32, 192, 64 * 4096, 0, sms=132) == 1


def test_gemm_without_routing_is_one_expert_in_row_order():
    """No sorted ids and no offsets: the table's one expert takes every row of the output in order; a table
    of several experts, or ids without their offsets, is refused by name."""
    out = np.zeros((5, 8), np.float32)
    assert grouped._slots(None, None, out, 1, "w") == 5
    with pytest.raises(ValueError, match=r"w: without expert_offsets one local expert owns every row in order .*got 2"):
        grouped._slots(None, None, out, 2, "w")
    with pytest.raises(ValueError, match=r"got 1 local experts and sorted_token_ids"):
        grouped._slots(np.zeros(5, np.int32), None, out, 1, "w")
    with pytest.raises(ValueError, match=r"w: expert_offsets without sorted_token_ids"):
        grouped._slots(None, np.zeros(3, np.int32), out, 2, "w")
    with pytest.raises(ValueError, match=r"w: 2 K splits need a float32 scratch of 80 elements, got none"):
        grouped._splits(2, 1, 8, 40, None, "w")
    assert grouped._splits(1, 1, 8, 40, np.zeros(3, np.float64), "w") == 1  # an unused scratch is not checked


def test_gemm_large_x_takes_the_register_engine(monkeypatch):
    """The tiled and wgmma engines address x with 32-bit offsets: an x of 2^32 elements or more
    takes the register engine by default, and asking for a tiled variant is refused by name."""
    class X:  # only the element count matters
        size = grouped.X_OFFSET_LIMIT

    monkeypatch.setattr(grouped, "wgmma_here", lambda: True)
    monkeypatch.setattr(grouped, "block_smem_limit", lambda: H200_BLOCK_SMEM)
    assert grouped._geometry(None, X.size, 4096 * 8, 288, 4096, "t", True) == grouped.GemmGeometry.of((64, 1, 4, 64, 4, "narrow"))
    X.size = grouped.X_OFFSET_LIMIT - 1
    assert grouped._geometry(None, X.size, 4096 * 8, 288, 4096, "t", True).mma == "wgmma"
    # an x in the natural k order never takes the wgmma variant by default (it reads x staged)
    assert grouped._geometry(None, X.size, 4096 * 8, 288, 4096, "t", False).mma == "narrow"
    X.size = grouped.X_OFFSET_LIMIT
    with pytest.raises(ValueError, match="32-bit offsets"):
        grouped._geometry((128, 2, 4, 64, 3, "sync"), X.size, 4096 * 8, 288, 4096, "t", False)


def test_wgmma_variant_refused_where_it_does_not_run(monkeypatch):
    """Asking for the wgmma variant on a device without sm_90a names the variant and the device;
    the default never offers it there."""
    monkeypatch.setattr(grouped, "wgmma_here", lambda: False)
    monkeypatch.setattr(grouped, "current_device", lambda: 0)
    monkeypatch.setattr(grouped, "compute_capability", lambda device: (12, 1))
    monkeypatch.setattr(grouped, "block_smem_limit", lambda: GB10_BLOCK_SMEM)

    class X:
        size = 4096 * 4096

    with pytest.raises(ValueError, match=r"m128wg8k64 needs wgmma .*\(12, 1\)"):
        grouped._geometry(grouped.GEMM_WGMMA, X.size, 4096 * 8, 288, 4096, "t", True)
    assert grouped._geometry(None, X.size, 4096 * 8, 288, 4096, "t", True).mma == "narrow"


@pytest.mark.parametrize("limit", [GB10_BLOCK_SMEM, H200_BLOCK_SMEM], ids=["GB10", "H200"])
def test_gemm_variant_past_the_block_shared_memory_does_not_run(monkeypatch, limit: int):
    """A tile variant whose stages pass the shared memory one block may opt into does not run there (m64w8k128's
    104448 bytes on a GB10's 101376): ``runs_here`` says so, so the bench and the GPU tests pass it over, and
    asking for it is refused by name and size; every variant the default choice can make fits a GB10."""
    monkeypatch.setattr(grouped, "wgmma_here", lambda: False)
    monkeypatch.setattr(grouped, "block_smem_limit", lambda: limit)
    big = (64, 1, 8, 128, 3, "sync")
    assert grouped.GemmGeometry.of(big).smem == 104448
    assert grouped.runs_here(big) == (limit == H200_BLOCK_SMEM)

    class X:
        size = 4096 * 4096

    if limit == GB10_BLOCK_SMEM:
        with pytest.raises(ValueError, match=rf"t: variant m64w8k128 needs 104448 bytes .* allows {limit}"):
            grouped._geometry(big, X.size, 4096 * 8, 288, 4096, "t", False)
    for v in set(grouped.GEMM_DEFAULT.values()) | set(grouped.GEMM_FALLBACK.values()):
        assert grouped.runs_here(v), f"default variant {v} does not fit {limit} bytes a block"


def test_arch_build_falls_back_to_the_plain_build(monkeypatch, caplog):
    """Where NVRTC cannot build gemm_nvfp4.cu for sm_90a, the plain build serves (no wgmma kernels
    offered) and a warning says why; files without an arch-specific build never try one."""
    loader.arch_build.cache_clear()
    monkeypatch.setattr(loader, "compute_capability", lambda device: (9, 0))

    def refuse(name, target):
        raise RuntimeError(f"{name}: NVRTC failed for {target}:\nunsupported")

    monkeypatch.setattr(loader, "_arch_cubin", refuse)
    try:
        with caplog.at_level(logging.WARNING):
            assert loader.arch_build("gemm_nvfp4.cu", 0) is None
        assert "without its sm_90a kernels" in caplog.text and "unsupported" in caplog.text
        assert loader.arch_build("gemv_nvfp4.cu", 0) is None
    finally:
        loader.arch_build.cache_clear()


@pytest.fixture(scope="module")
def builds():
    """``builds(path, arch)``: every kernel file's build for every arch it is built for (``_kernel_builds``), started
    by ``conftest.py`` once collected (else now); each awaited by the tests that read it."""
    return kb.start().get


def _ptx(b: Build, path: Path, arch: str) -> Path:
    assert b.ptx_rc == 0, f"nvcc --ptx -arch={arch} failed on {path.name}:\n{b.ptx_log}"
    return b.ptx


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_compiles(path: Path, arch: str, builds):
    """Every file builds for Hopper and GB10; the arch-specific ones (wgmma) also for sm_90a: nvcc's PTX,
    then ptxas for the same arch."""
    if not _built_for(path, arch):
        pytest.skip(f"{path.name} is not built for {arch}")
    b = builds(path, arch)
    _ptx(b, path, arch)
    assert b.cubin_rc == 0, f"ptxas -arch={arch} failed on {path.name}:\n{b.cubin_log}"


def test_no_diagnostic_switches_in_the_kernels():
    """The kernels carry no ablation or diagnostic switches: every ``#if`` / ``#ifdef`` / ``#ifndef`` of a kernel
    file tests a constant the loader passes or one the compiler defines (``__CUDA_ARCH__``), never a switch that
    only a build the product does not make would set."""
    passed = {opt[2:].split("=")[0] for opt in loader.define_options() + loader.define_options(loader.GEMM_SWEEP_FILE)}
    passed.add("GEMM_SWEEP")  # the stage sweep's build of gemm_nvfp4.cu: its source opens with the define
    for path in loader.KERNEL_DIR.glob("*.cu*"):
        conditions = re.findall(r"^\s*#\s*(?:if|ifdef|ifndef|elif)\b(.*)$", path.read_text(), re.M)
        names = {n for c in conditions for n in re.findall(r"[A-Za-z_]\w*", c)} - {"defined"}
        own = {n for n in names if not n.startswith("__")}
        assert own <= passed, f"{path.name} tests {sorted(own - passed)}, which no product build defines"


def test_gemm_stage_sweep_variants():
    """The stage sweep's variants (``bench --prefill --gemm-stages``): shipped tiles at other stage counts, none of
    them a shipped variant, each in the sweep's build under a suffix of its own, within a block's shared memory."""
    sweep, shipped = set(loader.GEMM_SWEEP_VARIANTS), set(loader.GEMM_VARIANTS)
    assert sweep and not sweep & shipped
    assert {(*v[:4], v[5]) for v in sweep} <= {(*v[:4], v[5]) for v in shipped}
    assert all(v in shipped for v in loader.GEMM_SWEEP_STAGES)
    p4 = grouped.GemmGeometry.of((16, 1, 4, 128, 4, "placed"))
    assert (p4.suffix, p4.file) == ("m16w4k128p_s4", loader.GEMM_SWEEP_FILE)
    assert p4.smem == 4 * (16 * 128 * 2 + 128 * 64 + 128 * 8)
    wg8 = grouped.GemmGeometry.of((128, 2, 8, 64, 8, "wgmma"))
    assert (wg8.suffix, wg8.smem) == ("m128wg8k64_s8", 8 * (128 * 64 * 2 + 256 * 32 + 256 * 4) + 1024)
    assert grouped.GemmGeometry.of((16, 1, 4, 128, 3, "placed")).file == "gemm_nvfp4.cu"
    assert all(grouped.GemmGeometry.of(v).smem <= H200_BLOCK_SMEM for v in sweep)
    with pytest.raises(ValueError, match="stage sweep's build"):
        grouped.GemmGeometry.of((16, 1, 4, 128, 5, "placed"))


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_121"])
def test_gemm_stage_sweep_builds(tmp_path: Path, arch: str):
    """The stage sweep's build of gemm_nvfp4.cu (GEMM_SWEEP_FILE) compiles with every sweep entry and none of the
    shipped variants' (the wgmma entries on sm_90a only)."""
    src, out = tmp_path / "gemm_sweep.cu", tmp_path / "gemm_sweep.ptx"
    src.write_text(loader.kernel_source(loader.GEMM_SWEEP_FILE))
    r = subprocess.run([NVCC, "--ptx", f"-arch={arch}", "-std=c++17", "-ftz=true",
                        *loader.define_options(loader.GEMM_SWEEP_FILE), "-o", str(out), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    entries = set(re.findall(r"\.entry (nvfp4_gemm_sorted\w*)\(", out.read_text()))
    want = {f"nvfp4_gemm_sorted{g}_{grouped.GemmGeometry.of(v).suffix}" for v in loader.GEMM_SWEEP_VARIANTS
            for g in ("", "_glu") if arch == "sm_90a" or v[5] != "wgmma"}
    assert want <= entries, sorted(want - entries)
    shipped = {f"nvfp4_gemm_sorted{g}_{grouped.GemmGeometry.of(v).suffix}" for v in loader.GEMM_VARIANTS
               for g in ("", "_glu")}
    assert not entries & shipped, sorted(entries & shipped)


@needs_nvcc
def test_warp_streaming_gemm_builds_at_every_ring_depth(tmp_path: Path):
    """The warp-streaming GEMM's wait counts are written for rings of 2 and 3 stages (the loader builds 2): both
    compile, and a depth it has no wait count for is refused at build time."""
    src = tmp_path / "mma_bf16.cu"
    src.write_text(loader.kernel_source("mma_bf16.cu"))
    for depth, ok in ((2, True), (3, True), (4, False)):  # the front end holds the wait counts' static_asserts
        opts = [o if not o.startswith("-DWSTREAM_DEPTH=") else f"-DWSTREAM_DEPTH={depth}"
                for o in loader.define_options()]
        r = subprocess.run([NVCC, "--ptx", "-arch=sm_90", "-std=c++17", *opts, "-o", str(tmp_path / "out.ptx"),
                            str(src)], capture_output=True, text=True)
        assert (r.returncode == 0) == ok, f"WSTREAM_DEPTH={depth}:\n{r.stdout}{r.stderr}"
        assert ok or "static assertion failed" in r.stdout + r.stderr


#: a PTX instruction that touches memory (a kernel parameter's ld.param does not), predicated or not, or
#: a call (a device function not inlined could touch memory before the wait)
_MEMORY_OP = re.compile(r"^\s*(?:@!?%?\w+\s+)?(ld|ldu|st|atom|red|cp\.async|cp\.reduce|ldmatrix|stmatrix|prefetch|"
                        r"wgmma|tex|tld4|suld|sust|sured|call)\b(?!\.param)")


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90", "sm_90a"])
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_kernel_waits_for_its_predecessor_before_touching_memory(path: Path, arch: str, builds):
    """The backend launches every kernel as a programmatic dependent (``pdl``): correct only if each
    entry's first memory access comes after ``griddepcontrol.wait``. Checked on the PTX nvcc makes
    for sm_90 (and sm_90a where the file has an arch-specific build), entry by entry (macro-made
    entries included)."""
    if not _built_for(path, arch):
        pytest.skip(f"{path.name} is not built for {arch}")
    ptx = _ptx(builds(path, arch), path, arch)
    entries = re.split(r"^\.visible \.entry ", ptx.read_text(), flags=re.M)[1:]
    assert entries, f"{path.name}: no kernel entries in its PTX"
    bad = []
    for body in entries:
        name = body.split("(", 1)[0]
        lines = body.splitlines()
        wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
        first = next((i for i, line in enumerate(lines) if _MEMORY_OP.match(line)), None)
        if wait is None or (first is not None and first < wait):
            bad.append(f"{name}: griddepcontrol.wait at line {wait}, first memory access at line {first}"
                       + (f" ({lines[first].strip()})" if first is not None else ""))
    assert not bad, f"{path.name}: entries that touch memory before waiting for their predecessor:\n" + "\n".join(bad)

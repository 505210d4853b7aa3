"""What ``make_backend`` refuses, on every rank and before any device is touched: levers and a
top-k past the backend's ``Capabilities``, ring levers that name a kernel gemv_nvfp4_ring.cu does
not instantiate, and an fp16 operand form the site's ``swiglu_limit`` does not bound. Runs without
a GPU: the CUDA backend's capabilities and ring levers are checked before CuPy is asked for one."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from glm_ep.backend import make_backend
from glm_ep.backend.cuda import CudaBackend, RingConfig
from glm_ep.backend.cuda.ring import act_bound, act_fits_f16, act_shift
from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.config.model import ModelConfig, RankLayout, SiteConfig
from glm_ep.config.presets import preset
from glm_ep.errors import ConfigError
from glm_ep.dist.placement import Placement
from glm_ep.config.topology import PathLevers, Topology

from helpers import tiny_dict

HERE = Placement(rank=0, world=1, node=0, local_rank=0, local_size=1, host="here")


def _cfg(**overrides) -> SiteConfig:
    model = ModelConfig.from_dict(tiny_dict(**overrides), source="cfg.json")
    return SiteConfig.for_rank(model, RankLayout(1, 0, 1, 1))


@pytest.mark.parametrize("levers,top_k,named", [
    ({"row_batch_max": 9}, 8, "levers.row_batch_max = 9, expected 1..8 on backend '{}' (its widest row group)"),
    ({"union_max_ids": 65}, 8, "levers.union_max_ids = 65, expected 1..64 on backend '{}'"),
    ({"prefill_gemm_min_rows": 8}, 8, "levers.prefill_gemm_min_rows = 8, expected >= 9 on backend '{}'"),
    ({"nvfp4_dense_gemm_min_rows": 4}, 8, "levers.nvfp4_dense_gemm_min_rows = 4, expected >= 9 on backend '{}'"),
    ({"nvfp4_dense_dequant_min_rows": 8}, 8,
     "levers.nvfp4_dense_dequant_min_rows = 8, expected >= 9 or 0 (off) on backend '{}'"),
    ({}, 17, "num_experts_per_tok = 17, expected <= 16 on backend '{}'"),
], ids=["row-batch-max", "union-max-ids", "prefill-min-rows", "nvfp4-dense-min-rows", "nvfp4-dequant-min-rows",
        "top-k"])
@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_levers_and_top_k_past_the_backend_capabilities(levers: dict, top_k: int, named: str, backend: str) -> None:
    topo = Topology.from_dict({"backend": backend, "levers": levers})
    with pytest.raises(ConfigError, match=re.escape(named.format(backend))):
        make_backend(topo, HERE, _cfg(num_experts_per_tok=top_k, n_routed_experts=32))


def test_the_defaults_fit_both_backends() -> None:
    assert isinstance(make_backend(Topology(), HERE, _cfg(num_experts_per_tok=16, n_routed_experts=32)), NumpyBackend)
    CudaBackend.capabilities.check("cuda", PathLevers(), 16)
    assert NumpyBackend.capabilities.max_row_group == CudaBackend.capabilities.max_row_group == 8
    assert not NumpyBackend.capabilities.capture and CudaBackend.capabilities.capture


def test_both_backends_read_the_kernel_limits_from_one_place() -> None:
    """The NumPy backend's limits are ``KERNEL_LIMITS`` without importing the CUDA loader (a fresh interpreter: nothing
    under ``glm_ep.backend.cuda`` is loaded), and the CUDA kernels are compiled with the same numbers."""
    import subprocess
    import sys

    from glm_ep.backend.base import KERNEL_LIMITS
    from glm_ep.backend.cuda import kernel_loader as K

    code = ("import sys, glm_ep.backend.numpy_backend as nb\n"
            "from glm_ep.backend.base import KERNEL_LIMITS\n"
            "assert nb.NumpyBackend.capabilities == KERNEL_LIMITS\n"
            "print(sorted(m for m in sys.modules if m.startswith('glm_ep.backend.cuda')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    assert (K.UNION_MAX_ROWS, K.UNION_MAX_IDS, K.GEMV_MAX_ROWS, K.ROUTER_MAX_TOP_K) == (
        KERNEL_LIMITS.max_row_group, KERNEL_LIMITS.max_union_ids, KERNEL_LIMITS.max_gemv_rows, KERNEL_LIMITS.max_top_k)
    assert K.DEFINES["UNION_MAX_IDS"] == 64 and K.DEFINES["ROUTER_MAX_TOP_K"] == 16
    assert CudaBackend.capabilities == dataclasses.replace(KERNEL_LIMITS, capture=True)


def test_ring_levers_default_to_the_measured_ring_and_parse_from_toml() -> None:
    assert RingConfig.from_levers(PathLevers()) == RingConfig()  # the numbers of the ring as measured
    lv = Topology.from_dict({"levers": {"ring_union_slab": [4, 4], "ring_union_depth": [2, 2],
                                        "ring_max_warps": 7}}).levers
    assert RingConfig.from_levers(lv) == RingConfig(union_slab=(4, 4), union_depth=(2, 2), max_warps=7)
    lv = Topology.from_dict({"levers": {"ring_placed": False, "ring_f16": True}}).levers
    assert RingConfig.from_levers(lv).forms(7.0) == ("bf16u", "f16")
    lv = Topology.from_dict({"levers": {"ring_down_combine": False}}).levers
    assert RingConfig.from_levers(lv) == RingConfig(down_combine=False)
    lv = Topology.from_dict({"levers": {"ring_min_items_per_sm": 0}}).levers
    assert RingConfig.from_levers(lv) == RingConfig(min_items_per_sm=0)
    lv = Topology.from_dict({"levers": {"ring_glu_slab": 2, "ring_glu_depth": 3}}).levers
    assert RingConfig.from_levers(lv) == RingConfig(glu_slab=2, glu_depth=3)


def test_the_decode_rings_gate_up_geometry_is_one_built() -> None:
    """Gate + up's (slab, depth) must be one gemv_nvfp4_ring.cu instantiates (named, with the ones it does); the
    ring off takes none. Its slab sets the K the ring takes (whole slabs) and the entry; one projection keeps
    RING_SLAB / RING_DEPTH."""
    with pytest.raises(ConfigError, match=r"levers.ring_glu_slab = 2, ring_glu_depth = 4: expected a \(slab, depth\) "
                                          r"in \[\(4, 2\), \(2, 3\), \(2, 2\)\]"):
        RingConfig(glu_slab=2, glu_depth=4)
    RingConfig(enabled=False, glu_slab=2, glu_depth=4)
    slab2 = RingConfig(glu_slab=2, glu_depth=2, min_items_per_sm=0)
    assert slab2.takes(2048, 256, 8, 2) and not RingConfig(min_items_per_sm=0).takes(2048, 256, 8, 2)
    assert not slab2.takes(4096, 256, 8, 1)  # one projection's slab is still 4 steps of 128 k
    assert slab2.stages(2) == (2, 2) and slab2.stages(1) == (4, 2)


@pytest.mark.parametrize("levers,needle", [
    ({"ring_glu_slab": 3}, r"levers.ring_glu_slab = 3, ring_glu_depth = 2: expected a \(slab, depth\) in"),
    ({"ring_glu_depth": -1}, r"levers.ring_glu_slab = 4, ring_glu_depth = -1: expected"),
    ({"ring_union_slab": [3, 5]}, r"levers.ring_union_slab = \[3, 5\], ring_union_depth = \[3, 3\]: expected"),
    ({"ring_union_depth": [4, 3]}, r"ring_union_depth = \[4, 3\]: expected \(one projection, gate \+ up\) pairs"),
])
def test_ring_geometries_are_checked_with_the_topology_on_any_backend(levers, needle) -> None:
    """A ring geometry no kernel is built for is refused when the topology is read, a CPU one included (it
    used to pass there and fail first on a GPU); with the ring off it names nothing that runs, and passes."""
    with pytest.raises(ConfigError, match=needle):
        Topology.from_dict({"backend": "cpu", "levers": levers})
    Topology.from_dict({"backend": "cpu", "levers": {**levers, "ring": False}})


def test_the_ring_declines_launches_of_few_items_an_sm(monkeypatch) -> None:
    """One slot of one expert's down projection (a dense FFN stored NVFP4: 4096 outputs, 256 items of 16 rows)
    is under 4 items an SM of 132 and goes to the block kernels; its gate + up (768 items) and the routed
    experts' 8 slots stay on the ring; ``min_items_per_sm = 0`` takes every shape the kernels are built for."""
    from glm_ep.backend.cuda import ring as R

    monkeypatch.setattr(R, "sm_count", lambda: 132)
    ring = RingConfig()
    assert not ring.takes(4096, 12288, 1, 1)
    assert ring.takes(12288, 4096, 1, 2) and ring.takes(2048, 4096, 8, 2) and ring.takes(4096, 2048, 8, 1)
    assert RingConfig(min_items_per_sm=0).takes(4096, 12288, 1, 1)
    # no K: nothing for the ring to stream (its items would never end); the block kernels take it
    assert not RingConfig(min_items_per_sm=0).takes(4096, 0, 8, 1)
    assert not RingConfig(union_max_rows=8).union_takes(4096, 0, 4, 1)
    monkeypatch.setattr(R, "sm_count", lambda: 48)  # a GB10: 256 items are 5.3 an SM
    assert ring.takes(4096, 12288, 1, 1)


def test_ring_claims_lever_and_where_a_launch_claims() -> None:
    """``ring_claims`` parses (default on) and reaches the ring; a ring launch passes its counter only where its
    items give each of its warps ``RING_CLAIMS_MIN_ITEMS`` (else the null pointer: a fixed stride), and a counter
    of the wrong type or size is refused by name."""
    from glm_ep.backend.cuda import routed
    from glm_ep.backend.cuda.kernel_loader import RING_CLAIMS_MIN_ITEMS, RING_WARPS

    assert PathLevers().ring_claims and RingConfig().claims
    lv = Topology.from_dict({"levers": {"ring_claims": False}}).levers
    assert not lv.ring_claims and not RingConfig.from_levers(lv).claims
    with pytest.raises(ConfigError, match="ring_claims"):
        Topology.from_dict({"levers": {"ring_claims": 1}})

    class Counter:  # a device array's face: dtype, layout, pointer, size
        def __init__(self, dtype: Any = np.uint32, size: int = 2) -> None:
            self.dtype, self.size = np.dtype(dtype), size
            self.flags = type("flags", (), {"c_contiguous": True})()
            self.data = type("data", (), {"ptr": 0x7F0000000000})()

    c, most = Counter(), RING_CLAIMS_MIN_ITEMS
    warps = 10 * RING_WARPS
    assert routed._claims(c, most * warps, 10) is c
    assert routed._claims(c, most * warps - 1, 10) == np.uint64(0)  # too few items a warp: a fixed stride
    assert routed._claims(None, 10 ** 6, 1) == np.uint64(0)
    for items in (most * warps, 1):  # a counter not fit to claim is refused whatever the launch's items
        with pytest.raises(TypeError, match="claims: dtype int32"):
            routed._claims(Counter(np.int32), items, 10)
        with pytest.raises(ValueError, match="ring claims: 1 uint32, the ring keeps 2"):
            routed._claims(Counter(size=1), items, 10)


def test_dependent_launch_lever_and_its_argument_marshalling() -> None:
    """``pdl`` parses (default on) and reaches the backend; ``cuLaunchKernelEx``'s parameter array
    holds a device array's pointer and a scalar's own bytes, and refuses what CuPy would guess at."""
    import ctypes

    import numpy as np

    from glm_ep.backend.cuda import pdl

    assert PathLevers().pdl and not Topology.from_dict({"levers": {"pdl": False}}).levers.pdl
    with pytest.raises(ConfigError, match="pdl"):
        Topology.from_dict({"levers": {"pdl": "yes"}})

    class FakeDeviceArray:
        class data:
            ptr = 0xDEADBEEF000

    args = (FakeDeviceArray(), np.int32(-7), np.int64(1 << 40), np.float32(1.5), np.uint64(0), np.float16(-2.25),
            np.uint32(0xFFFFFFFF), np.bool_(True))

    def passed(args: tuple) -> list[bytes]:
        params, sizes = pdl.kernel_params(args)
        return [ctypes.string_at(params[i], n) for i, n in enumerate(sizes)]

    want = [np.uint64(0xDEADBEEF000).tobytes()] + [a.tobytes() for a in args[1:]]
    assert passed(args) == want
    # the same signature again with other values (the thread's buffer is reused), and another signature of
    # as many arguments: each launch's values, never a previous one's
    again = (FakeDeviceArray(), np.int32(9), np.int64(-1), np.float32(-0.0), np.uint64(1 << 63), np.float16(0.5),
             np.uint32(1), np.bool_(False))
    assert passed(again) == [want[0]] + [a.tobytes() for a in again[1:]]
    other = tuple(reversed(args))
    assert passed(other) == list(reversed(want))
    refused = ((3, "int"), (np.zeros(3, np.float32), "ndarray"), (1.5, "float"), (np.complex128(1), "complex128"))
    for bad, what in refused:
        with pytest.raises(TypeError, match=f"kernel argument 1: {what}, expected a device array"):
            pdl.kernel_params((FakeDeviceArray(), bad))
    assert "sm_80" in pdl.unsupported_reason((8, 0))
    # the driver's structs as cuda.h lays them out (64-bit): CUlaunchConfig, CUlaunchAttribute
    cfg, attr = pdl._LaunchConfig, pdl._LaunchAttribute
    assert ctypes.sizeof(cfg) == 56 and ctypes.sizeof(attr) == 72 and pdl.PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert [(f, getattr(cfg, f).offset) for f in ("grid", "block", "shared_mem", "stream", "attrs", "num_attrs")] == [
        ("grid", 0), ("block", 12), ("shared_mem", 24), ("stream", 32), ("attrs", 40), ("num_attrs", 48)]
    assert (attr.id.offset, attr.value.offset) == (0, 8)
    with pdl.dependent_launches(True):
        assert pdl.active()
        with pdl.dependent_launches(False):
            assert not pdl.active()
        assert pdl.active()
    assert not pdl.active()


def test_down_combine_parts_cover_the_shared_width_in_routed_item_spans() -> None:
    """A shared item sweeps a routed item's slabs at 32 T k each: at GLM-5.3-Flash's shape (hidden
    4096, moe and shared width 2048) that is 512 k, so 4 items per row group at tp 1, 2 at tp 2."""
    ring = RingConfig()
    assert ring.down_combine_parts(4096, 2048, 2048) == 4
    assert ring.down_combine_parts(4096, 2048, 1024) == 2
    assert ring.down_combine_parts(4096, 2048, 768) == 0  # not a whole number of spans
    assert ring.down_combine_parts(4104, 2048, 2048) == 0  # rows not in groups of 16
    assert ring.down_combine_parts(4096, 2000, 2048) == 0  # the routed K is not whole slabs
    assert ring.down_combine_parts(4096, 2048, 0) == 0
    assert RingConfig(down_combine=False).down_combine_parts(4096, 2048, 2048) == 0


@pytest.mark.parametrize("levers,named", [
    ({"ring_union_slab": [4]}, "levers.ring_union_slab = [4], expected two positive integers"),
    ({"ring_union_depth": [2, 0]}, "levers.ring_union_depth = [2, 0], expected two positive integers"),
    ({"ring_union_slab": "4,4"}, "levers.ring_union_slab = '4,4' has type str, expected a list of integers"),
    ({"ring_max_warps": -1}, "levers.ring_max_warps = -1, expected >= 0"),
    ({"ring_min_items_per_sm": -2}, "levers.ring_min_items_per_sm = -2, expected >= 0 (0: off)"),
    ({"ring_f16": False, "ring_f16_hidden": True}, "levers.ring_f16_hidden = true needs ring_f16 = true"),
])
def test_ring_levers_are_checked_when_parsed(levers: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        Topology.from_dict({"levers": levers})


def test_a_ring_kernel_that_is_not_built_is_refused() -> None:
    with pytest.raises(ConfigError, match=re.escape("levers.ring_union_slab = [8, 4], ring_union_depth = [4, 2]: "
                                                    "expected")):  # with the topology, before any backend
        Topology.from_dict({"backend": "cuda", "levers": {"ring_union_slab": [8, 4], "ring_union_depth": [4, 2]}})
    with pytest.raises(ConfigError, match=re.escape("levers.ring_union_slab = [8, 4], ring_union_depth = [4, 2]: "
                                                    "expected")):  # a RingConfig built in code: the same check
        RingConfig(union_slab=(8, 4), union_depth=(4, 2))
    RingConfig(enabled=False, union_slab=(8, 4), union_depth=(4, 2))  # the block kernels do not care


@pytest.mark.parametrize("lever,value,why", [
    ("ring_slab", [8, 8], "one slab (4 steps of 128 k) and depth (2 stages)"),
    ("ring_depth", [4, 3], "one slab (4 steps of 128 k) and depth (2 stages)"),
    ("ring_unscaled", False, "the scaled bf16 form measured slower"),
    ("ring_placed_hidden", True, "the placed form measured no faster there"),
])
def test_a_removed_ring_lever_is_refused_naming_it(tmp_path: Path, lever: str, value, why: str) -> None:
    """The levers that chose a ring form or geometry which measured slower went with their kernels: a topology
    naming one (whatever its value, the old default too) is refused, saying it was removed and why, never ignored."""
    topo = tmp_path / "old.toml"
    topo.write_text(f"world = 1\n[levers]\nring = true\n{lever} = {str(value).lower()}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{topo}: levers.{lever} was removed: ") + ".*" + re.escape(why)
                       + r".*; delete it from the topology"):
        Topology.load(topo)
    with pytest.raises(ConfigError, match=r"levers.ring_slab was removed: .*levers.ring_unscaled was removed: .*"
                                          r"delete them from the topology"):
        Topology.from_dict({"levers": {"ring_unscaled": True, "ring_slab": [4, 4]}})


def test_the_fp16_form_only_where_the_limit_bounds_the_activation() -> None:
    """|act| <= max(L, 0.28) * L, rounded to bf16: inside fp16 (65504) up to L = 255.7 or so."""
    assert act_fits_f16(4.0) and act_fits_f16(255.7) and act_fits_f16(1e-3)
    assert not act_fits_f16(255.8) and not act_fits_f16(float("inf"))
    assert RingConfig(placed=False).forms(1e6) == ("bf16u", "bf16u")  # exact for any input, whatever the limit
    assert RingConfig().forms(1e6) == ("bf16u", "placed")  # the down projection placed: act below 1e12
    assert RingConfig(f16=True).forms(7.0) == ("bf16u", "f16")  # down only: the hidden state is unbounded
    assert RingConfig(f16=True, f16_hidden=True).forms(7.0) == ("f16", "f16")
    # the placed form: the down projection, where the limit bounds the activation (else the unscaled bf16 form)
    assert RingConfig().forms(10.0) == ("bf16u", "placed")
    assert act_shift(10.0) == 113 and act_shift(0.5) == 120 - math.frexp(act_bound(0.5))[1]
    assert act_shift(2.0 ** 60) == 0 and RingConfig().forms(2.0 ** 60) == ("bf16u", "bf16u")
    assert RingConfig(enabled=False, f16=True).forms(1e6) == ("bf16", "bf16")  # the block kernels' one form
    with pytest.raises(ConfigError, match=r"levers.ring_f16 = true: .* swiglu_limit = 300 .* set ring_f16 = false"):
        RingConfig(f16=True).forms(300.0)
    topo = Topology.from_dict({"backend": "cuda", "levers": {"ring_f16": True}})
    with pytest.raises(ConfigError, match=r"levers.ring_f16 = true: .* swiglu_limit = 300"):
        make_backend(topo, HERE, _cfg(swiglu_limit=300.0))


@pytest.mark.parametrize("sms,smem,resident", [(132, 233472, 396), (48, 102400, 48)], ids=["H200", "GB10"])
def test_warp_streaming_geometry_on_small_and_large_devices(monkeypatch, sms: int, smem: int,
                                                            resident: int) -> None:
    """The dense FFN's warp-streaming launches on an H200 and on a device that holds one block an SM (GB10):
    K splits only while every block stays resident, and a one-slice launch, whose grid may pass what the
    device holds, asks for no split-K scratch."""
    from glm_ep.backend.cuda import dense

    monkeypatch.setattr(dense, "sm_count", lambda: sms)
    monkeypatch.setattr(dense, "smem_per_sm", lambda: (smem, 1024))
    assert dense.wstream_resident_blocks() == resident
    n_partials, n_arrived = dense.wstream_scratch_sizes()
    for n, k, glu in ((12288, 4096, True), (4096, 12288, False), (6144, 4096, True), (4096, 6144, False)):
        grid, ks = dense.wstream_geometry(n, k, glu)
        blocks = -(-n // (dense.WSTREAM_WARPS * (8 if glu else 16)))
        assert grid == blocks * ks and ks >= 1
        assert ks == 1 or grid <= resident, f"{n} x {k}: {ks} slices, {grid} blocks past {resident} resident"
        need, counters = dense.wstream_scratch_need(grid, ks, dense.WSTREAM_MAX_ROWS)
        assert need <= n_partials and counters <= n_arrived, f"{n} x {k}: scratch short"
    assert dense.wstream_geometry(12288, 4096, True) == (384, 1)  # 384 blocks hold 12 warps an SM on the H200
    assert dense.wstream_geometry(4096, 12288, False) == ((256, 4) if sms == 132 else (64, 1))
    assert dense.wstream_scratch_need(384, 1, 16) == (0, 0)


@pytest.mark.parametrize("sms,smem", [(132, 233472), (48, 102400)], ids=["H200", "GB10"])
def test_warp_streaming_split_leaves_no_slice_empty(monkeypatch, sms: int, smem: int) -> None:
    """Every K slice the automatic split makes streams some of K (the kernel's ``wstream_slice``: whole stages,
    ceil(stages / S) a slice from the slice's index times that), for every in width the kernel takes (whole
    32-k steps) up to past the dense FFN's; S stays a split that keeps every block resident."""
    from glm_ep.backend.cuda import dense

    monkeypatch.setattr(dense, "sm_count", lambda: sms)
    monkeypatch.setattr(dense, "smem_per_sm", lambda: (smem, 1024))
    resident, step_k = dense.wstream_resident_blocks(), 32
    per_stage = dense.WSTREAM_STAGE_K // step_k
    for n, glu in ((4096, False), (2048, True), (512, False)):
        for k in range(step_k, 16384 + 1, step_k):
            grid, ks = dense.wstream_geometry(n, k, glu)
            steps = k // step_k
            per = -(-steps // (per_stage * ks)) * per_stage
            empty = [s for s in range(ks) if min(steps, s * per) >= min(steps, s * per + per)]
            assert not empty, f"{n} x {k}, glu {glu}: {ks} slices of {per} steps, slices {empty} hold none"
            assert ks == 1 or grid <= resident


@pytest.mark.parametrize("small_min", [0, 4, 5])
def test_dense_ffn_engine_by_rows(monkeypatch, small_min):
    """The measured split: the warp-streaming GEMM serves a dense-FFN-sized gate + up at 5..16 rows and a plain
    projection of that size at 5..8, never a smaller weight (shared expert, router: the GEMV and cuBLAS above it
    stay ahead there) unless WSTREAM_SMALL_MIN_ROWS opens it to those from that many rows to the GEMV's 8."""
    from glm_ep.backend.cuda import dense

    assert dense.WSTREAM_SMALL_MIN_ROWS == 5  # the shipped crossover (H100: docs/perf/DESIGN-NOTES.md)
    monkeypatch.setattr(dense, "WSTREAM_SMALL_MIN_ROWS", small_min)
    bf16 = ml_dtypes.bfloat16
    large = np.empty((2 * dense.SMALL_WEIGHT_MAX // 4096, 4096), bf16)
    small = np.empty((dense.SMALL_WEIGHT_MAX // 4096, 4096), bf16)
    for t in range(1, 20):
        x = np.empty((t, 4096), bf16)
        assert dense.wstream_takes(x, large, glu=True) == (5 <= t <= 16), f"{t} rows, dense-FFN gate + up"
        assert dense.wstream_takes(x, large, glu=False) == (5 <= t <= 8), f"{t} rows, dense-FFN down"
        for glu in (True, False):
            want = small_min > 0 and small_min <= t <= 8
            assert dense.wstream_takes(x, small, glu) == want, f"{t} rows, shared-expert weight"
    odd_k = np.empty((6, 4096 + 16), bf16)  # K not whole 32-k steps: never
    assert not dense.wstream_takes(odd_k, np.empty((large.shape[0], 4096 + 16), bf16), glu=True)
    assert not dense.wstream_takes(odd_k, np.empty((small.shape[0], 4096 + 16), bf16), glu=True)


GB10_BLOCK_SMEM, H200_BLOCK_SMEM = 101376, 232448  # shared memory one block may opt into (sm_121, sm_90)


def test_ring_levers_past_the_block_shared_memory_are_refused() -> None:
    """A ring whose blocks need more shared memory than the device gives one block is a ConfigError naming the
    levers and the sizes (make_backend raises it on every rank, before any weight is read), where the launch would
    have been refused at the first one-row step. What the defaults build fits both devices."""
    for limit in (GB10_BLOCK_SMEM, H200_BLOCK_SMEM):
        RingConfig().check_fits(limit)
        RingConfig(union_max_rows=8).check_fits(limit)
    assert RingConfig().smem(2) == 40960 and RingConfig().smem(1) == 22528  # 2 stages of 2 warps' slabs
    assert RingConfig(glu_slab=2, glu_depth=3).smem(2) == 30720  # 3 stages of 2 warps' half-size slabs
    with pytest.raises(ConfigError, match=r"levers.ring = true: .*gate \+ up needs 40960 bytes .* allows 32768 .*"
                                          r"set ring = false"):
        RingConfig().check_fits(32768)
    # the union ring's levers are named for its own blocks (8 rows at slab 4, depth 2: 68 KB), and only where it runs
    union = RingConfig(union_max_rows=8, union_slab=(4, 4), union_depth=(2, 2))
    assert union.union_smem(2, 8) == 69632 > 65536 > union.smem(2)
    with pytest.raises(ConfigError, match=r"levers.ring_union_slab = \[4, 4\], ring_union_depth = \[2, 2\]: .*"
                                          r"69632 bytes .* allows 65536"):
        union.check_fits(65536)
    RingConfig(union_max_rows=1, union_slab=(4, 4), union_depth=(2, 2)).check_fits(65536)
    RingConfig(enabled=False).check_fits(1024)


@pytest.mark.parametrize("limit,most", [(232448, 1760), (101376, 767)], ids=["H200", "GB10"])
def test_the_sort_by_expert_fits_the_device_or_is_refused(limit: int, most: int) -> None:
    """A sort block holds a count per expert for the block and each of its 32 warps (132 bytes an expert): on a
    GB10's 99 KB a block that is 767 experts. More is refused at load, naming the limit and the lever that keeps
    wide calls off the sort, not at the first wide call."""
    from glm_ep.backend.cuda import route_kernels as route

    assert route.sort_smem(most) + route.SORT_STATIC_SMEM <= limit < route.sort_smem(most + 1) + route.SORT_STATIC_SMEM
    route.check_sort_fits(most, limit, "sm_x")
    with pytest.raises(ConfigError, match=re.escape(
            f"n_routed_experts = {most + 1}: the sort by expert of wide calls needs "
            f"{route.sort_smem(most + 1) + route.SORT_STATIC_SMEM} bytes of shared memory a block, this device "
            f"(sm_x) allows {limit} (at most {most} experts); expected fewer experts, or levers.prefill_gemm = false")):
        route.check_sort_fits(most + 1, limit, "sm_x")


def test_cuda_scratch_is_declared_for_the_workspace(monkeypatch) -> None:
    """The CUDA kernels' scratch, declared for the workspace to make (the backend allocates none of its own), sized as
    the launches read it: the fused router's counter, the warp-streaming K split's sums and counters for every launch
    it makes, the one-row down ring's combine sums for the site's shapes, the sort's counts for the router's experts
    where the sorted path can run at the workspace's rows; counters zeroed; one line of the footprint report."""
    from glm_ep.backend.cuda import dense, scratch
    from glm_ep.mlp.site import site_buffers
    from glm_ep.mlp.workspace import footprint_lines, fmt_bytes

    for module in (dense, scratch):
        monkeypatch.setattr(module, "sm_count", lambda: 132)
    monkeypatch.setattr(dense, "smem_per_sm", lambda: (233472, 1024))
    model = ModelConfig.from_dict(preset("glm-5.3-flash"))
    cfg, ring = SiteConfig.for_rank(model, RankLayout(2, 0, 2, 2)), RingConfig()
    parts = ring.down_combine_parts(4096, 2048, 1024)
    assert parts >= 1
    declared = scratch.scratch_buffers(ring, cfg, PathLevers())
    b = {x.name: x for x in declared}
    n_partials, n_arrived = dense.wstream_scratch_sizes()
    want = {"route_done": (1, np.uint32, True), "wstream_partials": (n_partials, np.float32, False),
            "wstream_arrived": (n_arrived, np.uint32, True), "down_combine_partials": (parts * 4096, np.float32, False),
            "down_combine_arrived": (4096 // 16, np.uint32, True), "sort_counts": (132 * 288, np.int32, False),
            "ring_claims": (2, np.uint32, True)}
    assert {n: (x.elements(512), x.dtype, x.zeroed) for n, x in b.items()} == want
    assert all(x.stack == "backend scratch" for x in declared)
    assert b["sort_counts"].elements(23) == 0 and b["sort_counts"].elements(24) == 132 * 288  # prefill_gemm_min_rows
    def named(declared: tuple, name: str) -> Any:
        return next(x for x in declared if x.name == name)

    assert named(scratch.scratch_buffers(ring, cfg, PathLevers(prefill_gemm=False)), "sort_counts").elements(4096) == 0
    for off in (RingConfig(claims=False), RingConfig(enabled=False)):  # a fixed stride, or no ring: no counter
        assert named(scratch.scratch_buffers(off, cfg, PathLevers()), "ring_claims").elements(512) == 0
    no_shared = dataclasses.replace(cfg, local_shared_intermediate=0)
    assert [x.elements(1) for x in scratch.scratch_buffers(ring, no_shared, PathLevers())][3:5] == [0, 0]
    lines = footprint_lines((*site_buffers(cfg), *declared), 512, 45, True)
    total = sum(x.nbytes(512) for x in declared)
    assert lines[-1].startswith(f"backend scratch: {fmt_bytes(total)} (the CUDA kernels' counters and partial sums")
    assert CudaBackend.buffers is not NumpyBackend.buffers and NumpyBackend().buffers(cfg, PathLevers()) == ()

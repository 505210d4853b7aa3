"""A dense FFN stored NVFP4 through bf16 weights (the ``dequant`` path) on the NumPy backend: the op's numerics
against the grouped GEMM's, its scratch (size, when it is made, the loader's report and its error)."""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.checkpoint import nvfp4
from glm_ep.backend.base import RoutedExperts
from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.config.model import RankLayout, SiteConfig
from glm_ep.errors import ConfigError
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.mlp.runtime import report_lines, reserve_dequant
from glm_ep.config.topology import PathLevers, Topology
from glm_ep.checkpoint.weights import ExpertWeights
from glm_ep.mlp.workspace import Workspace, fmt_bytes

from helpers import BF16, random_nvfp4_mlp, tiny_model


def _table(w: nvfp4.Nvfp4Weight, be: NumpyBackend):
    return be.upload_experts([ExpertWeights(w, w, w)], 0, 10.0).gate


def test_dequant_linear_writes_exact_bf16_weights_and_the_grouped_gemm_numerics() -> None:
    """The scratch takes e2m1 * e4m3 exactly (times scale_2 in fp32 it is ``nvfp4.dequantize`` bit for bit: no
    rounding in bf16), every nibble and block scale included; the output is ``moe_gemm_sorted``'s within one
    bf16 rounding (scale_2 applied to the sums instead of to each weight), with NaN-poisoned outputs."""
    rng = np.random.default_rng(3)
    be = NumpyBackend()
    w = random_nvfp4_mlp(rng, 96, 64).gate
    packed = w.packed.copy()
    packed[0, :8] = [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]  # all 16 nibbles, in k order
    packed[1] = rng.integers(0, 256, packed.shape[1], dtype=np.uint8)
    scale = w.scale.copy()
    scale[2] = np.arange(scale.shape[1], dtype=np.uint8).view(scale.dtype)  # zero and subnormal E4M3 scales
    scale[3] = np.array([0x7E, 0x70, 0x38, 0x08], dtype=np.uint8).view(scale.dtype)  # 448 down to 2^-6
    w = nvfp4.Nvfp4Weight(packed, scale, 0.037)
    table = _table(w, be)
    x = rng.standard_normal((13, 64)).astype(BF16)
    w_NK = np.full((96, 64), np.nan, dtype=BF16)
    out = np.full((13, 96), np.nan, dtype=BF16)
    be.dequant_linear(x, table, 0, w_NK, out)
    np.testing.assert_array_equal(w_NK.astype(np.float32) * np.float32(w.scale_2), nvfp4.dequantize(w))
    want = np.full((13, 96), np.nan, dtype=BF16)
    be.moe_gemm_sorted(x, table, None, None, want, gather_rows=False)
    got, ref = out.astype(np.float32), want.astype(np.float32)
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got - ref) <= np.abs(ref) * 2.0 ** -7 + 1e-30), np.max(np.abs(got - ref))


def test_dequant_linear_refuses_a_scratch_of_another_shape() -> None:
    be = NumpyBackend()
    table = _table(random_nvfp4_mlp(np.random.default_rng(1), 32, 64).gate, be)
    with pytest.raises(ValueError, match=r"weight scratch .*\(64, 32\), expected bfloat16 \(32, 64\)"):
        be.dequant_linear(np.zeros((9, 64), BF16), table, 0, np.zeros((64, 32), BF16), np.zeros((9, 32), BF16))


def _dense_dispatch(levers: PathLevers) -> ExpertDispatch:
    cfg = SiteConfig.for_rank(tiny_model(), RankLayout(1, 0, 1, 1)).dense_as_expert()
    return ExpertDispatch(NumpyBackend(), cfg, levers)


def test_the_scratch_holds_one_projection_and_only_where_the_path_can_run() -> None:
    d = _dense_dispatch(PathLevers(nvfp4_dense_dequant_min_rows=32))
    one = d.cfg.moe_intermediate * d.cfg.hidden * 2
    assert [d.dequant_bytes(r) for r in (31, 32, 512)] == [0, one, one]
    assert d.reserve(31) == 0 and d._w_bf16 is None
    assert d.reserve(32) == one and d._w_bf16.nbytes == one and d._w_bf16.dtype == BF16
    made = d._w_bf16
    assert d.reserve(512) == one and d._w_bf16 is made  # made once
    assert _dense_dispatch(PathLevers(nvfp4_dense_dequant_min_rows=0)).dequant_bytes(4096) == 0
    assert _dense_dispatch(PathLevers(host_dispatch=True)).dequant_bytes(4096) == 0
    routed = ExpertDispatch(NumpyBackend(), SiteConfig.for_rank(tiny_model(), RankLayout(1, 0, 1, 1)),
                            PathLevers(nvfp4_dense_dequant_min_rows=9))
    assert routed.dequant_bytes(4096) == 0


def test_the_loader_reports_the_scratch_and_names_what_to_change_when_it_does_not_fit(monkeypatch) -> None:
    model = tiny_model()
    cfg = SiteConfig.for_rank(model, RankLayout(1, 0, 1, 1))
    topo = Topology(levers=PathLevers(nvfp4_dense_dequant_min_rows=64))
    lines = report_lines(model, cfg, topo, [1000], dequant_bytes=2_000_000)
    assert lines[-1] == ("dequant scratch: 2.00 MB (the dense FFN stored NVFP4 from 64 rows: one projection as bf16, "
                         "shared by its layers)")
    assert not any(line.startswith("dequant") for line in report_lines(model, cfg, topo, [1000]))
    d = _dense_dispatch(PathLevers(nvfp4_dense_dequant_min_rows=64))

    def no_memory(*_a, **_k):
        raise MemoryError("out of memory allocating 1 bytes")

    monkeypatch.setattr(d.be.xp, "empty", no_memory)
    with pytest.raises(ConfigError, match=r"dequant scratch of .* MB for calls of >= 64 rows, and allocating it "
                                          r"failed \(out of memory.*levers.nvfp4_dense_dequant_min_rows = 0"):
        reserve_dequant(d, 512)


@pytest.mark.parametrize("value,named", [(-1, "levers.nvfp4_dense_dequant_min_rows = -1, expected >= 0 (0: off)")])
def test_the_lever_is_checked(value: int, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        PathLevers(nvfp4_dense_dequant_min_rows=value)


def test_a_routed_experts_table_of_one_expert_runs_the_path() -> None:
    """The path body end to end on NumPy at the lever's floor: gate, up (bf16), the SwiGLU, down, against the
    grouped GEMM path of the same site within bf16 rounding."""
    rng = np.random.default_rng(5)
    be = NumpyBackend()
    cfg = SiteConfig.for_rank(tiny_model(), RankLayout(1, 0, 1, 1)).dense_as_expert()
    w = random_nvfp4_mlp(rng, cfg.moe_intermediate, cfg.hidden)
    experts: RoutedExperts = be.upload_experts([w], 0, cfg.swiglu_limit)
    x = rng.standard_normal((20, cfg.hidden)).astype(BF16)
    outs = {}
    for name, lv in (("dequant", PathLevers(nvfp4_dense_dequant_min_rows=9)), ("sorted", PathLevers())):
        d = ExpertDispatch(be, cfg, lv)
        assert d.path_for(20) == name
        ws = Workspace(np, cfg, 20)
        out = np.full((20, cfg.hidden), np.nan, dtype=BF16)
        d.every_row(x, experts, ws, out)
        outs[name] = out.astype(np.float32)
    assert np.all(np.isfinite(outs["dequant"]))
    err = np.linalg.norm(outs["dequant"] - outs["sorted"]) / np.linalg.norm(outs["sorted"])
    assert err < 1e-2, err


@pytest.mark.parametrize("rows,dense,shown", [(256, "nvfp4", True), (255, "nvfp4", False), (256, "bf16", False)])
def test_footprint_reports_the_scratch_the_load_makes(rows: int, dense: str, shown: bool, capsys) -> None:
    """``glm-ep footprint`` prints the dequant scratch line the load logs, with the same bytes (one projection of
    the dense FFN's rank-0 shard in bf16), where the workspace's widest call reaches the lever and the dense FFN is
    stored NVFP4; not otherwise."""
    from glm_ep.app.cli import main

    assert main(["footprint", "--preset", "glm-5.3-flash", "--dense", dense, "--rows", str(rows), "--tp", "2"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("dequant scratch:")]
    want = f"dequant scratch: {fmt_bytes(12288 // 2 * 4096 * 2)} (the dense FFN stored NVFP4 from 256 rows"
    assert [ln.startswith(want) for ln in lines] == ([True] if shown else []), lines

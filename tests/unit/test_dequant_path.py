"""A dense FFN stored NVFP4 through bf16 weights (the ``dequant`` path) on the NumPy backend: the op's numerics
against the grouped GEMM's, its scratch (size, made by the workspace once for the stack, the loader's report and
its error)."""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.checkpoint import nvfp4
from glm_ep.backend.base import RoutedExperts
from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.config.model import RankLayout, SiteConfig
from glm_ep.errors import ConfigError
from glm_ep.mlp.dispatch import ExpertDispatch
from glm_ep.mlp.runtime import report_lines
from glm_ep.mlp.site import site_buffers
from glm_ep.config.topology import PathLevers, Topology
from glm_ep.checkpoint.weights import ExpertWeights
from glm_ep.mlp.workspace import allocate_workspaces, fmt_bytes, workspace_pool, ws_total_bytes

from helpers import BF16, random_nvfp4_mlp, tiny_model, workspace


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


def _dense_cfg() -> SiteConfig:
    return SiteConfig.for_rank(tiny_model(), RankLayout(1, 0, 1, 1))


def _w_bf16(levers: PathLevers, nvfp4_dense: bool = True):
    return next((b for b in site_buffers(_dense_cfg(), levers, nvfp4_dense) if b.name == "w_bf16"), None)


def test_the_scratch_holds_one_projection_and_only_where_the_path_can_run() -> None:
    """The dequant path's weight scratch, as the dense FFN's dispatch declares it: one projection in bf16, one for the
    stack, where the workspace's widest call reaches the lever; nothing with the lever off, under host dispatch, or
    without a dense FFN stored NVFP4."""
    cfg = _dense_cfg()
    one = cfg.local_dense_intermediate * cfg.hidden * 2
    w = _w_bf16(PathLevers(nvfp4_dense_dequant_min_rows=32))
    assert w.stack == "dequant scratch" and [w.nbytes(r) for r in (31, 32, 512)] == [0, one, one]
    assert _w_bf16(PathLevers(nvfp4_dense_dequant_min_rows=0)).nbytes(4096) == 0
    assert _w_bf16(PathLevers(host_dispatch=True)).nbytes(4096) == 0
    assert _w_bf16(PathLevers(nvfp4_dense_dequant_min_rows=9), nvfp4_dense=False).nbytes(4096) == 0  # 32 experts


def test_the_workspace_makes_the_scratch_once_for_the_stack() -> None:
    """Made with the workspaces, once whatever their mode (every per-layer workspace sees the same array), and not
    counted in a workspace's own bytes; none below the lever's rows."""
    cfg = _dense_cfg()
    one = cfg.local_dense_intermediate * cfg.hidden * 2
    levers = PathLevers(nvfp4_dense_dequant_min_rows=32)
    buffers = site_buffers(cfg, levers, nvfp4_dense=True)
    pool = workspace_pool(NumpyBackend(), buffers, 32, 3, shared=False)
    arrays = [ws.view("w_bf16", cfg.local_dense_intermediate, cfg.hidden) for ws in pool]
    assert arrays[0].nbytes == one and arrays[0].dtype == BF16
    assert all(np.shares_memory(a, arrays[0]) for a in arrays[1:])
    assert pool[0].nbytes == ws_total_bytes(site_buffers(cfg, levers), 32)  # the per-site buffers alone
    assert not workspace_pool(NumpyBackend(), buffers, 31, 1, shared=True)[0].fits("w_bf16", 1)


def test_the_loader_reports_the_scratch_and_names_what_to_change_when_it_does_not_fit(monkeypatch) -> None:
    model, cfg = tiny_model(), _dense_cfg()
    topo = Topology(levers=PathLevers(nvfp4_dense_dequant_min_rows=64), workspace_rows=64)
    buffers = site_buffers(cfg, topo.levers, nvfp4_dense=True)
    lines = report_lines(model, topo, [1000], buffers)
    one = cfg.local_dense_intermediate * cfg.hidden * 2
    assert lines[-1] == (f"dequant scratch: {fmt_bytes(one)} (the dense FFN stored NVFP4 from 64 rows: one projection "
                         "as bf16, shared by its layers)")
    assert not any(line.startswith("dequant") for line in report_lines(model, topo, [1000], site_buffers(cfg)))
    need = ws_total_bytes(buffers, 64) + one
    with pytest.raises(ConfigError, match=r"needs .* \(with .* of scratch one for the stack\), but only .* is free; "
                                          r"lower workspace_rows in the topology; set levers.nvfp4_dense_dequant_min_"
                                          r"rows = 0 or above workspace_rows to go without the dequant scratch"):
        allocate_workspaces(NumpyBackend(), buffers, 64, 4, True, need - 1)
    assert allocate_workspaces(NumpyBackend(), buffers, 64, 4, True, need)[0].fits("w_bf16", one // 2)

    def no_memory(*_a, **_k):
        raise MemoryError("out of memory allocating 1 bytes")

    be = NumpyBackend()
    monkeypatch.setattr(be, "xp", type("NoMemory", (), {"empty": staticmethod(no_memory)})())
    with pytest.raises(ConfigError, match=r"allocating it failed \(out of memory.*levers.nvfp4_dense_dequant_min_rows"
                                          r" = 0"):
        allocate_workspaces(be, buffers, 64, 4, True, None)


@pytest.mark.parametrize("value,named", [(-1, "levers.nvfp4_dense_dequant_min_rows = -1, expected >= 0 (0: off)")])
def test_the_lever_is_checked(value: int, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        PathLevers(nvfp4_dense_dequant_min_rows=value)


def test_a_routed_experts_table_of_one_expert_runs_the_path() -> None:
    """The path body end to end on NumPy at the lever's floor: gate, up (bf16), the SwiGLU, down, against the
    grouped GEMM path of the same site within bf16 rounding."""
    rng = np.random.default_rng(5)
    be = NumpyBackend()
    cfg = _dense_cfg()
    w = random_nvfp4_mlp(rng, cfg.local_dense_intermediate, cfg.hidden)
    experts: RoutedExperts = be.upload_experts([w], 0, cfg.swiglu_limit)
    x = rng.standard_normal((20, cfg.hidden)).astype(BF16)
    outs = {}
    for name, lv in (("dequant", PathLevers(nvfp4_dense_dequant_min_rows=9)), ("sorted", PathLevers())):
        d = ExpertDispatch.nvfp4_dense(be, cfg, lv)
        assert d.path_for(20) == name
        ws = workspace(cfg, 20, lv, nvfp4_dense=True)
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


def test_footprint_refuses_dense_beside_a_model(tiny_checkpoint, capsys) -> None:
    """``--dense`` says how a preset's dense FFNs are stored; beside ``--model`` (whose checkpoint says so itself) it
    was silently ignored, so a user asking for NVFP4 got the bf16 figures of a bf16 checkpoint without a word."""
    from glm_ep.app.cli import main

    assert main(["footprint", "--model", str(tiny_checkpoint), "--dense", "nvfp4"]) == 2
    assert "--dense nvfp4 with --model: the checkpoint says how its dense FFNs are stored" in capsys.readouterr().err
    assert main(["footprint", "--model", str(tiny_checkpoint)]) == 0

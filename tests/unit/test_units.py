"""The seed's own unit tests: row groups and the workspace sizing, with hand-computed numbers.

The workspace figures are those of the seed at the GLM-5.3-Flash shape, tp = ep = 2, in DECIMAL
MB/GB (the unit the load report prints).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from glm_ep.config.model import ModelConfig, RankLayout, SiteConfig
from glm_ep.config.presets import preset
from glm_ep.mlp.routing import row_groups
from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.mlp.site import site_buffers
from glm_ep.mlp.workspace import (Buffer, fmt_bytes, footprint_lines, merged, stack_bytes, workspace_pool, ws_bytes,
                                  ws_total_bytes)

from cli_jobs import mpi_env
from helpers import REPO, build_stack, random_weights, random_x, tiny_model, workspace

MAX_CAP = 8  # the widest row group that ships


@pytest.mark.parametrize("cap", range(1, MAX_CAP + 1))
def test_row_groups_cover_in_order_and_never_orphan(cap: int) -> None:
    for rows in range(1, 65):
        groups = row_groups(rows, cap)
        nxt = 0
        for start, width in groups:
            assert start == nxt, f"rows={rows} cap={cap}: gap or overlap in {groups}"
            assert 1 <= width <= cap, f"rows={rows} cap={cap}: width {width} in {groups}"
            if rows >= 2 and cap == MAX_CAP:
                assert width >= 2, f"rows={rows}: a group of one row in {groups}"
            nxt += width
        assert nxt == rows, f"rows={rows} cap={cap}: covers {nxt} rows ({groups})"
        # as even as the count allows: widths differ by at most one
        widths = [w for _, w in groups]
        assert max(widths) - min(widths) <= 1, f"rows={rows} cap={cap}: uneven {groups}"
        assert len(groups) == -(-rows // cap), f"rows={rows} cap={cap}: more groups than needed"


def test_row_groups_at_the_shipping_widths() -> None:
    assert row_groups(16, 8) == [(0, 8), (8, 8)]
    assert row_groups(8, 8) == [(0, 8)]
    assert row_groups(9, 8) == [(0, 5), (5, 4)]


def _glm_tp2_ep2() -> SiteConfig:
    model = ModelConfig.from_dict(preset("glm-5.3-flash"))
    return SiteConfig.for_rank(model, RankLayout(world=2, rank=0, tp=2, ep=2))


def _sizes(cfg: SiteConfig, rows: int) -> dict[str, int]:
    return ws_bytes(site_buffers(cfg), rows)


def _total(cfg: SiteConfig, rows: int) -> int:
    return ws_total_bytes(site_buffers(cfg), rows)


def test_glm_site_geometry_at_tp2_ep2() -> None:
    c = _glm_tp2_ep2()
    assert (c.hidden, c.local_dense_intermediate, c.moe_intermediate, c.local_shared_intermediate) == (
        4096, 6144, 2048, 1024)
    assert (c.num_experts, c.local_experts, c.top_k) == (288, 144, 8)


@pytest.mark.parametrize("rows", [16, 64, 128, 256, 512, 1024])
def test_workspace_buffers_match_hand_computed_sizes(rows: int) -> None:
    b = _sizes(_glm_tp2_ep2(), rows)
    assert sorted(b) == sorted(["a_gate", "a_up", "a_act", "logits", "ids", "wts", "expert_out", "shared_out", "u_eid",
                                "u_slot", "sorted_token_ids", "sorted_expert_ids", "expert_offsets", "token_to_perm"])
    # act = max(rows * 6144, rows * 8 * 2048) = rows * 16384 bf16 elements
    assert b["a_gate"] == rows * 16384 * 2
    assert b["a_up"] == b["a_gate"] and b["a_act"] == b["a_gate"]
    assert b["logits"] == rows * 288 * 4
    assert b["ids"] == rows * 8 * 4
    assert b["wts"] == rows * 8 * 4
    assert b["expert_out"] == rows * 8 * 4096 * 2
    assert b["shared_out"] == rows * 4096 * 2
    assert b["u_eid"] == rows * 8 * 4
    assert b["u_slot"] == rows * 8 * rows * 4  # QUADRATIC in rows
    assert b["sorted_token_ids"] == rows * 8 * 4
    assert b["sorted_expert_ids"] == rows * 8 * 4
    assert b["expert_offsets"] == 289 * 4  # row-independent
    assert b["token_to_perm"] == rows * 8 * 4
    assert _total(_glm_tp2_ep2(), rows) == 173376 * rows + 32 * rows * rows + 1156


def _wide_dense_tp2_ep2() -> SiteConfig:
    """tiny with a 2048-wide dense FFN at tp = ep = 2: hidden 128, dense 1024 a rank, routed 64 x top-8 = 512
    (the dense width the larger term, unlike GLM's), shared 64 / 2 = 32, 32 experts."""
    model = tiny_model(intermediate_size=2048)
    return SiteConfig.for_rank(model, RankLayout(world=2, rank=0, tp=2, ep=2))


def _wide_shared() -> SiteConfig:
    """tiny with 16 shared experts and top-2 at tp = 1: hidden 128, dense 256, routed 64 x top-2 = 128, shared
    16 x 64 = 1024 (the shared width the larger term), 32 experts."""
    return SiteConfig.for_rank(tiny_model(n_shared_experts=16, num_experts_per_tok=2), RankLayout(1, 0, 1, 1))


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("shape", ["wide-dense-tp2", "wide-shared"])
def test_workspace_act_buffers_hold_the_widest_of_dense_shared_and_routed(shape: str, rows: int) -> None:
    """gate/up/act hold [rows, width] of the dense FFN and the shared expert as well as the routed
    [rows, top_k, moe width]: where this rank's dense (or shared) width passes top_k * moe width, it sizes them."""
    cfg, k = (_wide_dense_tp2_ep2(), 8) if shape == "wide-dense-tp2" else (_wide_shared(), 2)
    b = _sizes(cfg, rows)
    # act = max(rows * 1024, rows * k * 64) = rows * 1024 bf16 elements
    assert b["a_gate"] == b["a_up"] == b["a_act"] == rows * 1024 * 2
    assert b["logits"] == rows * 32 * 4
    assert b["ids"] == b["wts"] == b["u_eid"] == b["token_to_perm"] == rows * k * 4
    assert b["sorted_token_ids"] == b["sorted_expert_ids"] == rows * k * 4
    assert b["expert_out"] == rows * k * 128 * 2
    assert b["shared_out"] == rows * 128 * 2
    assert b["u_slot"] == rows * k * rows * 4
    assert b["expert_offsets"] == 33 * 4
    # 3 * 2048 + 128 + 6 * 4k + 256k + 256 per row, 4k per row squared, 132
    assert _total(cfg, rows) == (6528 + 280 * k) * rows + 4 * k * rows * rows + 132
    ws = workspace(cfg, rows)  # what is allocated
    assert ws.fits("a_act", rows * 1024) and not ws.fits("a_act", rows * 1024 + 1)
    assert ws.fits("a_up", rows * 1024) and not ws.fits("a_up", rows * 1024 + 1)


@pytest.mark.parametrize("rows,per_ws,copies45", [
    (256, "46.48 MB", "2.092 GB"), (512, "97.16 MB", "4.372 GB"), (1024, "211.09 MB", "9.499 GB")])
def test_workspace_decimal_megabytes_and_45_copies(rows: int, per_ws: str, copies45: str) -> None:
    one = _total(_glm_tp2_ep2(), rows)
    assert abs(one / 1e6 - float(per_ws.split()[0])) < 0.005
    assert abs(45 * one / 1e9 - float(copies45.split()[0])) < 0.0005
    assert fmt_bytes(one) == per_ws
    assert fmt_bytes(45 * one) == copies45
    text = "\n".join(footprint_lines(site_buffers(_glm_tp2_ep2()), rows, layers=45, shared=True))
    assert per_ws in text and copies45 in text


def test_a_buffer_as_f32_is_all_of_its_bytes() -> None:
    """The K split's scratch: all of a bf16 buffer, as float32, sharing its memory (and made once)."""
    ws = workspace(_glm_tp2_ep2(), 3)
    f = ws.as_f32("a_gate")
    assert f.dtype == np.float32 and f.nbytes == _sizes(_glm_tp2_ep2(), 3)["a_gate"]
    f[...] = 1.0
    assert (ws.view("a_gate", 4).view(np.uint16) == [0, 0x3F80, 0, 0x3F80]).all()
    assert ws.as_f32("a_gate") is f


@pytest.mark.parametrize("model", ["glm-tp2-ep2", "odd-width"])
def test_a_up_lies_right_after_a_gate(model: str) -> None:
    """One allocation holds a_gate then a_up (the same size, a_up from the next 256 bytes): a view at the same offset
    in each is one constant stride apart, what lets a backend write gate and up in one batched GEMM; a_up's writes
    never reach a_gate. A width that is no multiple of 128 elements included."""
    cfg = _glm_tp2_ep2() if model == "glm-tp2-ep2" else SiteConfig.for_rank(
        tiny_model(intermediate_size=600), RankLayout(1, 0, 1, 1))  # a_gate: 5 x 600 elements
    ws = workspace(cfg, 5)
    size = _sizes(cfg, 5)["a_gate"]
    n = size // 2
    gate, up = ws.view("a_gate", n - 16, offset=16), ws.view("a_up", n - 16, offset=16)
    assert up.ctypes.data - gate.ctypes.data == -(-size // 256) * 256  # (CuPy allocations start 256-aligned)
    ws.view("a_gate", n)[...] = 0
    ws.view("a_up", n)[...] = 1
    assert not ws.view("a_gate", n).astype(np.float32).any() and (ws.view("a_up", n).astype(np.float32) == 1).all()


def test_per_layer_mode_reports_45_copies_as_the_stack() -> None:
    shared = footprint_lines(site_buffers(_glm_tp2_ep2()), 256, layers=45, shared=True)[1]
    private = footprint_lines(site_buffers(_glm_tp2_ep2()), 256, layers=45, shared=False)[1]
    assert "stack total 46.48 MB" in shared and "saving 2.045 GB" in shared
    assert "stack total 2.092 GB" in private


def test_zero_rows_clamps_to_one() -> None:
    c = _glm_tp2_ep2()
    assert _total(c, 0) == _total(c, 1) == 173376 + 32 + 1156
    assert all(b > 0 for b in _sizes(c, 0).values())


def test_workspace_allocates_exactly_the_reported_bytes() -> None:
    c = SiteConfig.for_rank(ModelConfig.from_dict(preset("tiny")), RankLayout(2, 1, 2, 2))
    for rows in (0, 1, 9, 40):
        ws = workspace(c, rows)
        assert sum(buf.nbytes for buf in ws._flat.values()) == _total(c, rows) == ws.nbytes
        assert ws.view("u_slot", max(rows, 1) * c.top_k, max(rows, 1)).shape == (max(rows, 1) * 8, max(rows, 1))
        with pytest.raises(ValueError, match="u_slot"):
            ws.view("u_slot", max(rows, 1) * c.top_k + 1, max(rows, 1))


def test_workspace_views_are_windows_kept_per_shape_and_offset() -> None:
    import numpy as np

    c = SiteConfig.for_rank(ModelConfig.from_dict(preset("tiny")), RankLayout(1, 0, 1, 1))
    ws = workspace(c, 8)
    a = ws.view("a_act", 2, 64)
    assert ws.view("a_act", 2, 64) is a  # kept
    b, tail = ws.view("a_act", 4, 32), ws.view("a_act", 2, 64, offset=128)
    assert b is not a and b.shape == (4, 32) and tail.shape == (2, 64)
    flat = ws._flat["a_act"]
    flat[:] = np.arange(flat.size) % 251
    assert np.array_equal(a.reshape(-1), flat[:128]) and np.array_equal(b.reshape(-1), flat[:128])
    assert np.array_equal(tail.reshape(-1), flat[128:256])  # a view sees later writes: a window, no copy
    assert ws.fits("a_act", flat.size) and not ws.fits("a_act", flat.size + 1)
    with pytest.raises(ValueError, match="from element"):
        ws.view("a_act", flat.size, offset=1)


def test_footprint_cli_prints_the_glm_numbers() -> None:
    r = subprocess.run([sys.executable, "-m", "glm_ep", "footprint", "--preset", "glm-5.3-flash",
                        "--tp", "2", "--ep", "2", "--rows", "256"],
                       capture_output=True, text=True, timeout=60, env=mpi_env(), cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "46.48 MB" in r.stdout, r.stdout
    assert "2.092 GB" in r.stdout, r.stdout


@pytest.mark.parametrize("layout", [(1, 0, 1, 1), (2, 0, 2, 2), (2, 1, 2, 1), (2, 1, 2, 1, 2), (4, 3, 2, 2, 2)])
def test_footprint_weight_bytes_are_what_a_rank_loads(tiny_checkpoint, tiny_checkpoint_dense_nvfp4, layout) -> None:
    """The config-only weight count (``glm-ep footprint``) equals the bytes ``load_layer`` hands a rank, and
    the header count ``layer_read_bytes`` the bytes it reads, with the dense FFNs stored bf16 or NVFP4 and with
    the routed experts split by ``moe_tp`` (the 5th value); ``footprint --model`` reads which from the checkpoint."""
    from glm_ep.checkpoint.reader import Checkpoint
    from glm_ep.checkpoint.layers import layer_read_bytes, load_layer
    from glm_ep.config.model import RankLayout, SiteConfig
    from glm_ep.app.footprint import rank_weight_bytes

    for ckpt, nvfp4 in ((tiny_checkpoint, False), (tiny_checkpoint_dense_nvfp4, True)):
        with Checkpoint(ckpt) as ck:
            cfg = SiteConfig.for_rank(ck.config, RankLayout(*layout))
            loaded = sum(w.nbytes for w in (load_layer(ck, cfg, i) for i in range(ck.config.num_hidden_layers))
                         if w is not None)
            read = sum(layer_read_bytes(ck, cfg, i) for i in range(ck.config.num_hidden_layers))
        assert rank_weight_bytes(ck.config, cfg, dense_nvfp4=nvfp4) == loaded, (ckpt.name, layout)
        assert read == loaded, (ckpt.name, layout)
        if layout[0] == 1:
            r = subprocess.run([sys.executable, "-m", "glm_ep", "footprint", "--model", str(ckpt)],
                               capture_output=True, text=True, timeout=60, env=mpi_env(), cwd=REPO)
            assert r.returncode == 0 and f"weights: rank 0 holds {fmt_bytes(loaded)}" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("layout", [(1, 0, 1, 1), (2, 1, 2, 2)])
def test_footprint_counts_an_f32_router_as_stored(tmp_path, layout) -> None:
    """A checkpoint whose routers are stored F32 (the runtime holds them so): ``footprint --model`` reads the dtype
    from a header (it counted 2 bytes an element: 99 MB a rank short at the GLM shape)."""
    from glm_ep.checkpoint.reader import Checkpoint
    from glm_ep.checkpoint.layers import load_layer
    from glm_ep.config.model import RankLayout, SiteConfig
    from glm_ep.config.presets import preset
    from glm_ep.checkpoint.synth import write_synthetic

    ckpt = write_synthetic(tmp_path / "f32", preset("tiny"), router_dtype="f32")
    with Checkpoint(ckpt) as ck:
        cfg = SiteConfig.for_rank(ck.config, RankLayout(*layout))
        loaded = sum(w.nbytes for w in (load_layer(ck, cfg, i) for i in range(ck.config.num_hidden_layers))
                     if w is not None)
    tp, ep = layout[2], layout[3]
    r = subprocess.run([sys.executable, "-m", "glm_ep", "footprint", "--model", str(ckpt), "--tp", str(tp),
                        "--ep", str(ep)], capture_output=True, text=True, timeout=60, env=mpi_env(), cwd=REPO)
    assert r.returncode == 0 and f"weights: rank {layout[1]} holds {fmt_bytes(loaded)}" in r.stdout, r.stdout + r.stderr


def test_numpy_combine_rounds_once() -> None:
    """The combine sums the weighted slots and the shared expert in fp32 and rounds ONCE to bf16: 1 + 2^-8 + 2^-8
    is 1 + 2^-7 (a bf16), where rounding after each add would stay at 1 (1 + 2^-8 is a tie, to even: 1)."""
    import ml_dtypes

    from glm_ep.backend.numpy_backend import NumpyBackend

    bf16 = ml_dtypes.bfloat16
    be = NumpyBackend()
    routed = np.array([[1.0, 4.0], [2.0 ** -8, 0.0], [2.0 ** -8, 0.0]], dtype=bf16)  # 1 row, 3 slots, hidden 2
    wts = np.array([[1.0, 1.0, 1.0]], dtype=np.float32)
    out = np.zeros((1, 2), dtype=bf16)
    be.combine(routed, wts, None, out)
    assert out.astype(np.float32).tolist() == [[1.0 + 2.0 ** -7, 4.0]]
    shared = np.array([[2.0 ** -8, 0.0]], dtype=bf16)  # the shared expert joins the same single rounding
    be.combine(routed[:2], wts[:, :2], shared, out)
    assert out.astype(np.float32).tolist() == [[1.0 + 2.0 ** -7, 4.0]]
    be.combine(routed, wts, None, out, perm_TK=np.array([[2, 1, 0]]))  # slots read through a permutation
    assert out.astype(np.float32).tolist() == [[1.0 + 2.0 ** -7, 4.0]]


def test_numpy_grouped_gemm_without_routing() -> None:
    """No routing: the one expert takes every row in order (as x @ w.T, rounded to bf16); a table of two experts
    or a row count that is not the output's is refused by name, not broadcast."""
    import ml_dtypes

    from glm_ep.checkpoint import nvfp4
    from glm_ep.backend.numpy_backend import NumpyBackend
    from glm_ep.checkpoint.weights import ExpertWeights

    rng = np.random.default_rng(5)
    w = ExpertWeights(*(nvfp4.quantize(rng.standard_normal((32, 32)).astype(np.float32)) for _ in range(3)))
    be = NumpyBackend()
    one, two = be.upload_experts((w,), 0, 7.0), be.upload_experts((w, w), 0, 7.0)
    a = rng.standard_normal((3, 32)).astype(ml_dtypes.bfloat16)
    out = np.zeros((3, 32), ml_dtypes.bfloat16)
    be.moe_gemm_sorted(a, one.gate, None, None, out, False)
    want = (a.astype(np.float32) @ nvfp4.dequantize(w.gate).T).astype(ml_dtypes.bfloat16)
    got, want = out.astype(np.float32), want.astype(np.float32)
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
    with pytest.raises(ValueError, match=r"without expert_offsets: one local expert \(got 2\)"):
        be.moe_gemm_sorted(a, two.gate, None, None, out, False)
    with pytest.raises(ValueError, match=r"each of the 3 output rows \(got 1\)"):
        be.moe_gemm_sorted(a[:1], one.gate, None, None, out, False)


class _Declaring(NumpyBackend):
    """A NumPy backend whose ops would need scratch of their own: a counter and some partial sums, declared for the
    workspace; ``bind`` records what it was handed."""

    def __init__(self) -> None:
        self.handed: list[dict] = []

    def buffers(self, cfg, levers):
        return (Buffer("done", np.dtype(np.uint32), lambda r: 4, zeroed=True, stack="backend scratch", note="counters"),
                Buffer("sums", np.dtype(np.float32), lambda r: 8 * r, stack="backend scratch", note="partial sums"))

    def bind(self, scratch):
        super().bind(scratch)
        self.handed.append(dict(scratch))


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-layer"])
def test_a_backends_scratch_is_made_once_by_the_workspace_and_bound(shared: bool) -> None:
    """What a backend declares is made with the workspaces, once for the stack in either mode (zeroed where it asked),
    handed to it by ``bind``, left out of a workspace's own bytes and reported on its own line."""
    be, c = _Declaring(), _glm_tp2_ep2()
    buffers = (*site_buffers(c), *be.buffers(c, None))
    pool = workspace_pool(be, buffers, 16, 3, shared)
    assert len({id(ws) for ws in pool}) == (1 if shared else 3)
    assert len(be.handed) == 1 and sorted(be.handed[0]) == ["done", "sums"] and be.bound is pool[0].stack
    done, sums = be.handed[0]["done"], be.handed[0]["sums"]
    assert done.dtype == np.uint32 and (done == 0).all() and sums.size == 8 * 16
    for ws in pool:
        assert ws.view("done", 4) is not None and np.shares_memory(ws.view("sums", 128), sums)
        assert ws.nbytes == _total(c, 16)
    lines = footprint_lines(buffers, 16, layers=3, shared=shared)
    assert lines[-1] == f"backend scratch: {fmt_bytes(4 * 4 + 8 * 16 * 4)} (counters; partial sums)"
    assert stack_bytes(buffers, 16) == 4 * 4 + 8 * 16 * 4


def test_declarations_of_one_name_are_one_buffer_as_large_as_the_largest() -> None:
    a = Buffer("x", np.dtype(np.int32), lambda r: r)
    b = Buffer("x", np.dtype(np.int32), lambda r: 3 * r, zeroed=True)
    (m,) = merged([a, b, Buffer("x", np.dtype(np.int32), lambda r: 2)])
    assert m.elements(5) == 15 and m.elements(1) == 3 and m.zeroed
    with pytest.raises(ValueError, match="'x' declared as int32 per-site and as float32 per-site"):
        merged([a, Buffer("x", np.dtype(np.float32), lambda r: r)])
    with pytest.raises(ValueError, match="'x' declared as int32 per-site and as int32 stack"):
        merged([a, Buffer("x", np.dtype(np.int32), lambda r: r, stack="scratch")])


def test_a_buffer_nobody_declared_is_named() -> None:
    ws = workspace(_glm_tp2_ep2(), 2)
    assert not ws.fits("w_bf16", 1)
    with pytest.raises(ValueError, match="'w_bf16' was not declared for this workspace"):
        ws.view("w_bf16", 4)


def test_a_stack_runs_on_its_own_scratch_when_another_was_built_on_its_backend() -> None:
    """Two stacks on one backend (as benches and tests build them): the later one's workspaces bind the backend to
    theirs, and a call of the first binds it back to its own, which its graphs then capture; no call rebinds
    needlessly."""
    model = tiny_model()
    be, full = _Declaring(), random_weights(model, seed=3)
    first = build_stack(full, model, max_rows=4, be=be)
    second = build_stack(full, model, max_rows=4, be=be)
    assert len(be.handed) == 2 and be.bound is second.workspaces[0].stack
    x = random_x(4, 2, model.hidden_size)
    first.step(x)
    assert be.bound is first.workspaces[0].stack and len(be.handed) == 3
    first.site_output(0, x)
    assert len(be.handed) == 3
    second.site_output(1, x)
    assert be.bound is second.workspaces[0].stack and len(be.handed) == 4

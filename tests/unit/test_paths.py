"""Every routed-expert dispatch path gives the same site outputs on one NumPy stack, and they all
agree with an independent float64 evaluation; the chained step matches a float64 chain."""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.config.model import RankLayout
from glm_ep.config.topology import PathLevers
from glm_ep.mlp.dispatch import ExpertDispatch, ExpertShape
from glm_ep.mlp.site import MoeSite, Nvfp4DenseSite

from helpers import (CapturingNumpy, RefParams, assert_ulps, build_stack, random_weights, random_x, ref64_layers,
                     rel_l2, route_margins64, site64, step64, tiny_model)

MAX_ROWS = 32
#: path name -> the levers that select it (rows permitting)
VARIANTS = {
    "decode": PathLevers(row_batch=False, prefill_gemm=False),  # one grouped GEMV per row
    "union": PathLevers(prefill_gemm=False),  # union table, row groups of <= 8
    "sorted": PathLevers(prefill_gemm_min_rows=9),  # sort by expert + grouped GEMM
    "host": PathLevers(host_dispatch=True),
}


@pytest.fixture(scope="module", params=[True, False], ids=["renorm", "no-renorm"])
def setup(request):
    """The tiny model with ``norm_topk_prob`` true (GLM's) and false: the routed weights are then the
    unbiased scores themselves, scaled (about 8 times the renormalised ones at top-8)."""
    model = tiny_model(norm_topk_prob=request.param)
    assert model.norm_topk_prob is request.param
    full = random_weights(model, seed=7, bias_spread=0.05)
    return model, full, ref64_layers(full), RefParams.of(model)


def _expected_paths(rows: int) -> dict[str, str]:
    if rows == 1:
        return {"decode": "decode", "union": "decode", "sorted": "decode", "host": "host"}
    if rows <= 8:
        return {"decode": "decode", "union": "union", "sorted": "union", "host": "host"}
    return {"decode": "decode", "union": "union", "sorted": "sorted", "host": "host"}


def test_default_levers_choose_the_design_paths() -> None:
    model = tiny_model()
    d = build_stack(random_weights(model, seed=1), model, max_rows=300).sites[1].experts
    crossover = PathLevers().prefill_gemm_min_rows
    assert [d.path_for(r) for r in (1, 2, 8, 9, crossover - 1)] == ["decode", "union", "union", "union", "union"]
    assert [d.path_for(r) for r in (crossover, 300)] == ["sorted", "sorted"]
    # a union table holds rows * top_k <= 64 ids: at top-16 a group is at most 4 rows wide, so
    # 5 and 8 rows run as groups of 3 + 2 and 4 + 4
    wide = tiny_model(num_experts_per_tok=16)
    dw = build_stack(random_weights(wide, seed=1), wide).sites[1].experts
    assert dw.group_cap == 4
    assert [dw.path_for(r) for r in (2, 4, 5, 8)] == ["union", "union", "union", "union"]
    narrow = build_stack(random_weights(wide, seed=1), wide, levers=PathLevers(row_batch_max=4))
    assert [narrow.sites[1].experts.path_for(r) for r in (5, 8, 9)] == ["union", "union", "union"]
    tight = build_stack(random_weights(model, seed=1), model, levers=PathLevers(union_max_ids=16))
    assert tight.sites[1].experts.path_for(2) == "union" and tight.sites[1].experts.path_for(3) == "decode"
    # a dense FFN stored NVFP4 is one expert: every row group would sweep all of it, so the grouped GEMM from 9 rows
    layer, nv = model.mlp_layer_types.index("dense"), random_weights(model, seed=1, dense_nvfp4=True)
    dense = build_stack(nv, model, max_rows=300).sites[layer].dispatch
    assert [dense.path_for(r) for r in (1, 8, 9, 31, 32)] == ["decode", "union", "sorted", "sorted", "sorted"]
    late = build_stack(nv, model, levers=PathLevers(nvfp4_dense_gemm_min_rows=32)).sites[layer].dispatch
    assert [late.path_for(r) for r in (9, 31, 32)] == ["union", "union", "sorted"]
    # ... and its projections dequantized to bf16 from nvfp4_dense_dequant_min_rows (never with 0, never routed)
    d = PathLevers().nvfp4_dense_dequant_min_rows
    assert [dense.path_for(r) for r in (d - 1, d, 300)] == ["sorted", "dequant", "dequant"]
    early = build_stack(nv, model, levers=PathLevers(nvfp4_dense_dequant_min_rows=9)).sites[layer].dispatch
    assert [early.path_for(r) for r in (1, 8, 9)] == ["decode", "union", "dequant"]
    off = build_stack(nv, model, max_rows=300, levers=PathLevers(nvfp4_dense_dequant_min_rows=0)).sites[layer].dispatch
    assert off.path_for(300) == "sorted"
    routed = build_stack(nv, model, levers=PathLevers(nvfp4_dense_dequant_min_rows=9)).sites[1].experts
    assert routed.path_for(300) == "sorted"


def test_a_dense_ffn_stored_nvfp4_is_a_site_of_its_own() -> None:
    """An NVFP4 dense layer is an ``Nvfp4DenseSite`` whose dispatch runs one expert of the rank's dense width that
    every row chooses (no site geometry posing as a one-expert MoE); it refuses a routed dispatch, and a routed
    dispatch refuses to run every row through one expert."""
    model = tiny_model()
    layer, nv = model.mlp_layer_types.index("dense"), random_weights(model, seed=1, dense_nvfp4=True)
    stack = build_stack(nv, model)
    site, cfg = stack.sites[layer], stack.cfg
    assert isinstance(site, Nvfp4DenseSite) and not site.sparse and isinstance(stack.sites[1], MoeSite)
    assert site.dispatch.shape == ExpertShape(cfg.hidden, cfg.local_dense_intermediate, 1, 1, cfg.swiglu_limit)
    assert not hasattr(cfg, "dense_as_expert")
    routed = ExpertDispatch.routed(stack.be, cfg, PathLevers())
    with pytest.raises(ValueError, match=r"Nvfp4DenseSite: a dispatch of ExpertShape\(.*num_experts=32, top_k=8.*"
                                         r"expected the dense FFN's"):
        Nvfp4DenseSite(stack.be, stack.comm, cfg, site.mlp, routed)
    x = random_x(3, 4, model.hidden_size)
    with pytest.raises(ValueError, match="every_row: a dispatch of one expert chosen once a row, not 32 experts top-8"):
        routed.every_row(x, site.mlp, stack.workspaces[layer], np.empty((4, model.hidden_size), x.dtype))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 20])
def test_all_paths_agree_and_match_float64(setup, rows: int) -> None:
    model, full, ref, p = setup
    x = random_x(100 + rows, rows, model.hidden_size)
    outs: dict[str, list[np.ndarray]] = {}
    ids: dict[str, list[np.ndarray]] = {}
    for name, levers in VARIANTS.items():
        stack = build_stack(full, model, levers=levers, max_rows=MAX_ROWS)
        assert stack.sites[1].experts.path_for(rows) == _expected_paths(rows)[name], name
        outs[name], ids[name] = [], []
        for i in range(len(full)):
            outs[name].append(stack.site_output(i, x).copy())
            if i in model.sparse_layers:
                ids[name].append(stack.workspaces[i].view("ids", rows, 8).copy())
    for i in range(len(full)):
        want = site64(ref[i], p, x)
        for name in VARIANTS:
            y = outs[name][i]
            assert_ulps(y, outs["decode"][i], f"{name} vs decode, {rows} rows, site {i}")
            assert rel_l2(y, want) < 1e-2, (rows, i, name, rel_l2(y, want))
    for name in VARIANTS:
        for a, b in zip(ids[name], ids["decode"]):
            np.testing.assert_array_equal(a, b)


def test_a_row_does_not_depend_on_its_batch(setup) -> None:
    model, full, _, _ = setup
    x = random_x(200, 20, model.hidden_size)
    single = build_stack(full, model, max_rows=MAX_ROWS)
    alone = [[single.site_output(i, x[r:r + 1]).copy() for r in range(20)] for i in range(len(full))]
    assert np.isfinite(np.asarray(alone, np.float32)).all()  # bf16 steps take NaN against NaN as equal
    for name, levers in VARIANTS.items():
        stack = build_stack(full, model, levers=levers, max_rows=MAX_ROWS)
        for i in range(len(full)):
            batch = stack.site_output(i, x).copy()
            for r in (0, 7, 8, 19):
                assert_ulps(batch[r:r + 1], alone[i][r], f"{name}, site {i}, row {r} in a batch vs alone")


@pytest.mark.parametrize("rows", [1, 4, 20])
def test_shared_expert_beside_the_router_or_after_the_experts(setup, rows: int) -> None:
    """The shared expert's gate/up run beside the router where the workspace holds its activations
    past the routed experts' (a roomy workspace), after the experts where it does not (a workspace
    of exactly ``rows`` rows, for the tiny model): the site output is the same bytes."""
    model, full, _, _ = setup
    x = random_x(500 + rows, rows, model.hidden_size)
    roomy, tight = build_stack(full, model, max_rows=MAX_ROWS), build_stack(full, model, max_rows=rows)
    for i in model.sparse_layers:
        early = roomy.sites[i].route(x, roomy.workspaces[i]).shared
        assert early is not None, f"site {i}: {MAX_ROWS} workspace rows hold {rows} rows' shared activations"
        assert tight.sites[i].route(x, tight.workspaces[i]).shared is None, f"site {i}"
        assert_ulps(roomy.site_output(i, x), tight.site_output(i, x), f"site {i}, shared early vs late", ulps=0)


def test_stale_workspace_bytes_never_leak_between_calls(setup) -> None:
    model, full, _, _ = setup
    stack = build_stack(full, model, levers=VARIANTS["sorted"], max_rows=MAX_ROWS)
    x_big, x_small = random_x(300, 20, model.hidden_size), random_x(301, 3, model.hidden_size)
    for i in range(len(full)):
        fresh = build_stack(full, model, max_rows=MAX_ROWS).site_output(i, x_small).copy()
        assert np.isfinite(fresh.astype(np.float32)).all()  # bf16 steps take NaN against NaN as equal
        stack.site_output(i, x_big)  # fills the scratch with a wider call's bytes first
        assert_ulps(stack.site_output(i, x_small), fresh, f"site {i} after a wider call")


@pytest.fixture(scope="module")
def contractive():
    """A stack whose sites change h by ~40% over the chain, so bf16 rounding is not amplified."""
    model = tiny_model()
    full = random_weights(model, seed=9, out_gain=0.04, bias_spread=0.3)
    ref, p = ref64_layers(full), RefParams.of(model)
    # top-k is discontinuous: take rows whose float64 routing is clear of ties at every site
    pool = random_x(400, 96, model.hidden_size)
    clear = route_margins64(ref, p, pool) > 0.01
    assert clear.sum() >= 24
    return model, full, ref, p, pool[clear]


@pytest.mark.parametrize("rows,levers", [(1, PathLevers()), (4, PathLevers()), (20, VARIANTS["union"]),
                                         (20, VARIANTS["sorted"])], ids=["decode", "verify", "groups", "sorted"])
def test_chained_step_matches_float64_chain(contractive, rows: int, levers: PathLevers) -> None:
    model, full, ref, p, pool = contractive
    x = pool[:rows] if rows < 20 else pool[-rows:]
    want = step64(ref, p, x)
    assert rel_l2(x, want) > 0.2  # the sites do change h: a step that skipped them would fail
    y = build_stack(full, model, levers=levers, max_rows=MAX_ROWS).step(x).copy()
    assert rel_l2(y, want) < 1e-2, rel_l2(y, want)
    # one workspace for the stack or one per layer: the same bytes
    private = build_stack(full, model, levers=levers, max_rows=MAX_ROWS, shared_workspace=False)
    assert_ulps(private.step(x), y, "a workspace per layer vs shared", ulps=0)
    # the step is h = h + site(h), layer after layer, each add rounded to bf16
    stack = build_stack(full, model, levers=levers, max_rows=MAX_ROWS)
    h = x.copy()
    for i in range(len(full)):
        h = (h.astype(np.float32) + stack.site_output(i, h).astype(np.float32)).astype(x.dtype)
    assert_ulps(h, y, "site by site vs step", ulps=0)


@pytest.mark.parametrize("rows", [1, 2])
def test_one_row_sites_end_inside_the_routed_down_step(setup, monkeypatch, rows: int) -> None:
    """At one row (with the shared activations beside the router) the routed experts leave their down
    projection to the combine, which hands it, the shared down projection and the combine to
    ``moe_down_shared_combine`` and does not combine again; at two rows the site combines, and so does a
    workspace too tight for the shared activations beside the router (its experts end with their own down
    projection). The output is the same bytes either way."""
    from glm_ep.backend.numpy_backend import NumpyBackend

    model, full, _, _ = setup
    calls: list[str] = []
    for name in ("moe_down_shared_combine", "shared_down_combine", "combine"):
        def spy(self, *a, _real=getattr(NumpyBackend, name), _name=name, **k):
            calls.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(NumpyBackend, name, spy)
    x = random_x(600 + rows, rows, model.hidden_size)
    roomy, tight = build_stack(full, model, max_rows=MAX_ROWS), build_stack(full, model, max_rows=rows)
    for i in model.sparse_layers:
        calls.clear()
        got = roomy.site_output(i, x).copy()
        want = ["moe_down_shared_combine", "shared_down_combine", "combine"] if rows == 1 else \
            ["shared_down_combine", "combine"]
        assert calls == want, f"site {i}, {rows} rows: {calls}"
        calls.clear()
        assert_ulps(got, tight.site_output(i, x), f"site {i}, {rows} rows", ulps=0)
        assert calls == ["shared_down_combine", "combine"], f"site {i}, {rows} rows, tight workspace: {calls}"


@pytest.mark.parametrize("rows", [1, 5, 12, 20])
def test_nvfp4_dense_site_on_every_path(rows: int) -> None:
    """A dense FFN stored NVFP4 runs as one expert that every row chooses: the same outputs on every
    routed path up to rounding order (NumPy sums a batch's products in another order than one row's: a
    gate or up element that rounds the other way moves its row's outputs by a few ulps), close to
    float64, whatever stale ids the workspace holds."""
    model = tiny_model()
    full = random_weights(model, seed=9, dense_nvfp4=True)
    layer = model.mlp_layer_types.index("dense")
    x = random_x(300 + rows, rows, model.hidden_size)
    outs: dict[str, np.ndarray] = {}
    # and its projections dequantized to bf16 into a scratch (from 9 rows with the lever at its floor)
    variants = {**VARIANTS, "dequant": PathLevers(nvfp4_dense_dequant_min_rows=9)}
    paths = {**_expected_paths(rows), "dequant": "dequant" if rows >= 9 else _expected_paths(rows)["union"]}
    for name, levers in variants.items():
        stack = build_stack(full, model, levers=levers, max_rows=MAX_ROWS)
        site = stack.sites[layer]
        assert site.dispatch.path_for(rows) == paths[name], name
        stack.workspaces[layer].view("ids", MAX_ROWS, model.num_experts_per_tok)[...] = 12345
        outs[name] = stack.site_output(layer, x).copy()
    want = site64(ref64_layers(full)[layer], RefParams.of(model), x)
    for name, y in outs.items():
        assert rel_l2(y, outs["decode"]) < 1e-3, (rows, name, rel_l2(y, outs["decode"]))
        assert rel_l2(y, want) < 1e-2, (rows, name, rel_l2(y, want))


def test_one_site_calls_replay_a_graph_per_site_and_width() -> None:
    """``site_output`` (the library's ``site``, ``forward``) at 1..8 rows on a backend that captures: one capture
    per (site, rows), replays that compute each new input's output (as the eager call does), none past 8 rows,
    none with ``graph_sites = false``. The capture here records the call and replays it by calling it again."""
    model = tiny_model()
    full = random_weights(model, seed=5, dense_nvfp4=True)
    eager = build_stack(full, model, max_rows=MAX_ROWS)
    for levers, wanted in ((PathLevers(), 2 * len(full)), (PathLevers(graph_sites=False), 0)):
        be = CapturingNumpy()
        stack = build_stack(full, model, levers=levers, max_rows=MAX_ROWS, be=be)
        for call in range(3):
            for rows in (1, 4, 12):
                x = random_x(1000 * call + rows, rows, model.hidden_size)
                for i in range(len(full)):
                    got = stack.site_output(i, x).copy()
                    want = eager.site_output(i, x).copy()
                    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16), err_msg=f"{i} {rows}")
        assert be.captured == wanted, (levers, be.captured)
        assert sorted(stack._site_graphs) == ([(i, r) for i in range(len(full)) for r in (1, 4)] if wanted else [])
        be.inside = True  # an engine's own capture around the calls, of a width not captured yet: eager ops
        x = random_x(7, 3, model.hidden_size)
        for i in range(len(full)):
            got, want = stack.site_output(i, x).copy(), eager.site_output(i, x).copy()
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        assert stack.step(x) is not None and be.captured == wanted and (3 not in stack._graphs)


#: a dense width of 2048 (1024 per rank at tp = 2): past the routed experts' top_k * moe_intermediate = 512
WIDE_DENSE = 2048


@pytest.mark.parametrize("dense_nvfp4", [False, True], ids=["bf16", "nvfp4"])
@pytest.mark.parametrize("rows", [1, 5, 20])
def test_a_dense_ffn_wider_than_the_routed_activations(rows: int, dense_nvfp4: bool) -> None:
    """``intermediate_size / tp`` larger than ``top_k * moe_intermediate_size`` (every other test's dense FFN is
    narrower): the activation buffers hold the dense FFN's rows, on every path, whole (tp 1) and as the sum of
    the two TP ranks' partials (tp = ep = 2), close to float64; the sparse sites of that model too."""
    model = tiny_model(intermediate_size=WIDE_DENSE)
    assert model.intermediate_size // 2 > model.num_experts_per_tok * model.moe_intermediate_size
    full = random_weights(model, seed=13, dense_nvfp4=dense_nvfp4)
    ref, p = ref64_layers(full), RefParams.of(model)
    assert ref[0].kind == "dense" and ref[0].mlp[0].shape == (WIDE_DENSE, model.hidden_size)
    x = random_x(700 + rows, rows, model.hidden_size)
    want = [site64(layer, p, x) for layer in ref]
    for name, levers in VARIANTS.items():
        whole = build_stack(full, model, levers=levers, max_rows=MAX_ROWS)
        halves = [build_stack(full, model, RankLayout(2, r, 2, 2), levers=levers, max_rows=MAX_ROWS) for r in (0, 1)]
        for i in range(len(full)):
            y = whole.site_output(i, x).copy()
            assert np.isfinite(y.astype(np.float32)).all(), (name, i)
            assert rel_l2(y, want[i]) < 1e-2, (name, "tp 1", i, rel_l2(y, want[i]))
            summed = sum(h.site_output(i, x).astype(np.float64) for h in halves)
            assert rel_l2(summed, want[i]) < 1e-2, (name, "tp 2", i, rel_l2(summed, want[i]))

"""The host side of ``glm-ep bench``'s stage table (no GPU): the recorder keeps a sparse site's ops as the levers
chose them, replaying them reproduces the site exactly, their bytes add up to the site's, and the table."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from glm_ep.bench.common import sparse_bytes
from glm_ep.bench.stages import (LABELS, ONE_CALL, Op, OpRecorder, label, splittable, stage_bytes, stage_lines,
                                 stage_names)
from glm_ep.config.topology import PathLevers
from glm_ep.mlp.dispatch import ExpertDispatch

from helpers import build_stack, random_weights, random_x, tiny_model

MODEL = tiny_model()


@pytest.fixture(scope="module")
def stack():
    return build_stack(random_weights(MODEL, seed=3), MODEL, max_rows=8)


def _recorded(stack, levers=PathLevers()):
    site = next(s for s in stack.sites if s.sparse)
    rec = OpRecorder(site.be)
    return rec, replace(site, be=rec, experts=ExpertDispatch.routed(rec, site.cfg, levers))


@pytest.mark.parametrize("rows, ops", [
    (1, ["route", "moe_gate_up_act", "combine_site"]),
    (3, ["route", "union_table", "moe_gate_up_act_union", "moe_gemv_union", "combine_site"]),
])
def test_the_recorded_ops_replay_the_site_exactly_and_read_its_bytes(stack, rows, ops):
    rec, site = _recorded(stack)
    ws = stack.workspaces[0]
    x = random_x(rows, rows, MODEL.hidden_size)
    want = site(x, ws, np.zeros((rows, MODEL.hidden_size), x.dtype)).copy()
    out = np.full((rows, MODEL.hidden_size), np.nan, x.dtype)
    recorded = rec.record(lambda: site(x, ws, out))
    assert [o.name for o in recorded] == ops
    np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))
    out[:] = np.nan
    for op in recorded:  # the same ops, replayed alone in order: the same output, bit for bit
        op()
    np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))
    ids = next(o.args[5] for o in recorded if o.name == "route")
    union = len(np.unique(ids))
    assert sum(stage_bytes(MODEL, o, union) for o in recorded) == sparse_bytes(MODEL, union)
    for o in recorded:  # a stage's parts read what it reads (on NumPy every op runs its parts apart)
        assert sum(stage_bytes(MODEL, p, union) for p in o.leaves()) == stage_bytes(MODEL, o, union), o.name
    assert splittable([o.name for o in recorded])
    combine = recorded[-1]
    assert label(combine) == ("routed down + shared down + combine" if rows == 1 else LABELS["combine_site"])
    assert rec.record(lambda: None) == []


def test_outside_a_record_the_recorder_is_the_backend(stack):
    rec, site = _recorded(stack)
    be = next(s for s in stack.sites if s.sparse).be
    assert rec.name == be.name and rec.zero == be.zero  # the backend's own attributes and bound methods
    a = np.ones(3, np.float32)
    assert [o.name for o in rec.record(lambda: rec.zero(a))] == ["zero"] and not a.any()
    x = random_x(0, 2, MODEL.hidden_size)
    site(x, stack.workspaces[0], np.zeros((2, MODEL.hidden_size), x.dtype))  # not recording: nothing kept
    assert rec._ops is None


def test_the_recorder_keeps_what_each_op_runs_of_the_backend_and_leaves_it_as_it_was(stack):
    """Inside a record, the methods the backend calls on itself are kept as each op's parts (``Op.leaves``: what
    the op queues), each replayable alone; after it, even one that raised, the backend has no attribute of the
    recorder's left."""
    rec, site = _recorded(stack)
    be, ws = rec._be, stack.workspaces[0]
    before = dict(vars(be))
    x = random_x(1, 1, MODEL.hidden_size)
    ops = rec.record(lambda: site(x, ws, np.zeros((1, MODEL.hidden_size), x.dtype)))
    route = ops[0]
    assert [p.name for p in route.leaves()][:2] == ["router_logits", "router_topk"]  # NumPy runs them apart
    assert all(not leaf.parts for leaf in route.leaves()) and Op("zero", be.zero, (), {}).leaves()[0].name == "zero"
    logits = route.leaves()[0].args[2]
    want = logits.copy()
    logits[:] = np.nan
    route.leaves()[0]()  # the router's logits, replayed alone
    np.testing.assert_array_equal(logits, want)
    assert vars(be) == before

    def fails():
        rec.zero(np.ones(2, np.float32))
        raise RuntimeError("a site that fails mid-call")

    with pytest.raises(RuntimeError, match="fails mid-call"):
        rec.record(fails)
    assert vars(be) == before and rec._ops is None
    with pytest.raises(RuntimeError, match="already recording"):  # a record does not nest
        rec.record(lambda: rec.record(lambda: None))
    assert vars(be) == before
    own = lambda a: None  # noqa: E731 - an instance's own attribute of a method's name is put back
    be.zero = own
    try:
        assert [o.name for o in rec.record(lambda: rec.zero(np.ones(2, np.float32)))] == ["zero"]
        assert vars(be)["zero"] is own
    finally:
        del be.zero


def test_sites_of_one_width_must_queue_the_same_ops(stack):
    rec, site = _recorded(stack)
    ws = stack.workspaces[0]
    one = rec.record(lambda: site(random_x(1, 1, MODEL.hidden_size), ws, np.zeros((1, MODEL.hidden_size), "f4")))
    two = rec.record(lambda: site(random_x(2, 2, MODEL.hidden_size), ws, np.zeros((2, MODEL.hidden_size), "f4")))
    assert stage_names([one, one]) == [o.name for o in one]
    with pytest.raises(ValueError, match="sites of one width queued different ops"):
        stage_names([one, two])


def test_an_op_queued_twice_is_not_split(stack):
    """Two row groups (row_batch_max 2 at 4 rows): each group's union table overwrites the one before in the
    workspace, so a replay alone would time only the last group's; the bench leaves such a width whole."""
    rec, site = _recorded(stack, PathLevers(row_batch_max=2))
    ws = stack.workspaces[0]
    ops = rec.record(lambda: site(random_x(4, 4, MODEL.hidden_size), ws, np.zeros((4, MODEL.hidden_size), "f4")))
    names = [o.name for o in ops]
    assert names.count("union_table") == 2 and not splittable(names)


def test_the_stage_table():
    stages = [{"rows": 1, "union": 8, "site_us": 74.5, "stages": [
        {"op": "route", "label": LABELS["route"], "us": 13.0, "bytes": 36_000_000},
        {"op": "moe_gate_up_act", "label": LABELS["moe_gate_up_act"], "us": 34.0, "bytes": 75_500_000},
        {"op": "combine_site", "label": "routed down + shared down + combine", "us": 27.5, "bytes": 54_500_000}]},
        {"rows": 2, "union": 16, "site_us": 130.0, "stages": [
            {"op": "union_table", "label": LABELS["union_table"], "us": 3.0, "bytes": 0}]},
        {"rows": 16, "union": 90, "site_us": 640.0, "stages": [
            {"op": "route", "label": "router + top-k", "us": 50.0, "bytes": 3_000_000, "parts": [
                {"op": "router_logits", "label": "router logits", "us": 30.0, "bytes": 3_000_000},
                {"op": "router_topk", "label": "top-k", "us": 19.0, "bytes": 0}]}]},
        {"rows": 8, "union": 57, "site_us": 430.0, "stages": [], "note": "the call queues route, union_table, "
         "union_table"}]
    text = "\n".join(stage_lines(stages, {"launches": 64, "dependent_us": 1.25, "plain_us": 2.5}, 3000.0))
    assert "| 1 | 74.5 | router + top-k 13.0 (92%); routed gate + up + SwiGLU 34.0 (74%); " \
           "routed down + shared down + combine 27.5 (66%) | 74.5 | +0.0 |" in text
    assert "| 2 | 130.0 | union table 3.0 | 3.0 | +127.0 |" in text  # no bytes: no percentage
    # a stage's parts in brackets, each with its own share of the copy bandwidth; the sum is the stages' alone
    assert "| 16 | 640.0 | router + top-k 50.0 (2%) [router logits 30.0 (3%), top-k 19.0] | 50.0 | +590.0 |" in text
    assert "1.25 µs as programmatic dependents, 2.50 µs plain" in text
    assert "| 8 | 430.0 | not split: the call queues route, union_table, union_table | — | — |" in text
    assert "plain launches" not in text  # no row timed the site with plain launches: no such column
    off = "\n".join(stage_lines(stages, {"launches": 64, "dependent_us": None, "plain_us": 2.5}, 3000.0))
    assert "programmatic dependent launch off here (levers.pdl = false, or before sm_90), 2.50 µs plain" in off
    assert stage_lines([], None, 3000.0) == []


@pytest.mark.parametrize("rows, ops, router", [
    (16, ["route", "sort_by_expert", "moe_experts_sorted", "combine_site"], "router + top-k + shared gate + up"),
    (64, ["route", "sort_by_expert", "moe_experts_sorted", "gate_up_act", "combine_site"], "router + top-k"),
])
def test_prefill_stages_replay_the_grouped_path_and_read_its_bytes(rows, ops, router):
    """``bench --prefill --stages``'s rows (``prefill._stages``): a wide call on the grouped GEMM records the router,
    the sort, the routed experts, the shared expert and the combine, each timed alone, then each stage's parts;
    replayed in order (each twice, as the timer does) into poisoned buffers (the output and the workspace) they give
    the site's output bit for bit, and the stages' bytes are the site's (the routed experts' union read once). The
    router's label says whether the shared expert's gate and up ran beside it; its parts are the router's logits
    and top-k (and the shared gate + up's own), whose bytes add up to the router's."""
    from glm_ep.bench.prefill import _stages

    big = build_stack(random_weights(MODEL, seed=5), MODEL, max_rows=64)
    site = next(s for s in big.sites if s.sparse)
    rec = OpRecorder(site.be)
    recorded = replace(site, be=rec, experts=ExpertDispatch.routed(rec, site.cfg, PathLevers(prefill_gemm_min_rows=9)))
    ws = big.workspaces[0]
    x = random_x(rows, rows, MODEL.hidden_size)
    want = site(x, ws, np.zeros((rows, MODEL.hidden_size), x.dtype)).copy()
    out = np.zeros((rows, MODEL.hidden_size), x.dtype)
    timed: list[str] = []

    def timer(op):
        if not timed:  # before the first replay: the output and every workspace buffer the recording call wrote,
            out[:] = np.nan  # poisoned, so each op's replay must write what the next one reads
            for a in ws._flat.values():
                a.view(np.uint8)[:] = 0xFF
        timed.append(op.name)
        op()
        op()
        return 2.5

    row = _stages(rec, recorded, x, ws, out, 10.0, MODEL, site.be, timer)
    parts = [p["op"] for s in row["stages"] for p in s.get("parts", [])]
    assert [s["op"] for s in row["stages"]] == ops == timed[:len(ops)] and row["site_us"] == 10.0
    assert timed[len(ops):] == parts and row["rows"] == rows  # then each stage's parts, alone
    assert [s["label"] for s in row["stages"]] == [router] + [LABELS[o] for o in ops[1:]]
    assert all(s["us"] == 2.5 for s in row["stages"])
    np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))
    assert sum(s["bytes"] for s in row["stages"]) == sparse_bytes(MODEL, row["union"])
    route = row["stages"][0]
    assert [p["label"] for p in route["parts"][:2]] == ["router logits", "top-k"]
    assert len(route["parts"]) == (2 if router == "router + top-k" else 5)  # + the shared gate, up and SwiGLU
    for s in row["stages"]:  # each stage's parts read what the stage reads
        if s.get("parts"):
            assert sum(p["bytes"] for p in s["parts"]) == s["bytes"], s["op"]
    text = "\n".join(stage_lines([row], None, 3000.0, ONE_CALL))
    assert "[router logits 2.5 (" in text and ", top-k 2.5" in text
    assert "one call at a time on its GPU time only" in text
    assert f"| {rows} | 10.0 | {router} 2.5 (" in text and "; sort by expert 2.5; " in text  # no bytes: no %


def test_the_stage_table_with_the_site_on_plain_launches():
    """Where a row also timed the whole site with its kernels launched plain (``site_plain_us``: the prefill bench,
    where the backend launches programmatic dependents), the table gets a last column and says what it is; a row
    without that figure shows a dash there, and a split row and a row left whole both end in it."""
    stages = [{"rows": 256, "union": 284, "site_us": 2187.0, "site_plain_us": 2240.5, "stages": [
        {"op": "moe_experts_sorted", "label": LABELS["moe_experts_sorted"], "us": 2000.0, "bytes": 0}]},
        {"rows": 512, "union": 288, "site_us": 2618.0, "site_plain_us": None, "stages": [
            {"op": "moe_experts_sorted", "label": LABELS["moe_experts_sorted"], "us": 2500.0, "bytes": 0}]},
        {"rows": 8, "union": 57, "site_us": 430.0, "site_plain_us": 441.0, "stages": [], "note": "twice"}]
    text = "\n".join(stage_lines(stages, None, 3000.0, ONE_CALL))
    assert "| rows | site µs | stages: µs (% of copy bw) | sum of stages µs | site − sum µs | site, plain launches µs |" \
        in text and "|---:|---:|---|---:|---:|---:|" in text
    assert f"| 256 | 2187.0 | {LABELS['moe_experts_sorted']} 2000.0 | 2000.0 | +187.0 | 2240.5 |" in text
    assert f"| 512 | 2618.0 | {LABELS['moe_experts_sorted']} 2500.0 | 2500.0 | +118.0 | — |" in text
    assert "| 8 | 430.0 | not split: twice | — | — | 441.0 |" in text
    assert "launched plain instead of each as a programmatic dependent" in text
    for line in text.splitlines():  # every row of the table has the header's columns
        if line.startswith("| "):
            assert line.count("|") == 7, line


class _Backend:
    def __init__(self, pdl: bool):
        self.pdl = pdl


@pytest.mark.parametrize("fails", [False, True])
def test_with_plain_launches_turns_pdl_off_for_the_call_only(fails):
    """``common.with_plain_launches``: the call runs with the backend's ``pdl`` off and the lever is back on after,
    also where the call raises."""
    from glm_ep.bench.common import with_plain_launches

    be, seen = _Backend(True), []

    def call() -> None:
        seen.append(be.pdl)
        if fails:
            raise RuntimeError("call failed")

    plain = with_plain_launches(be, call)
    assert seen == [] and be.pdl is True  # nothing runs until the call
    if fails:
        with pytest.raises(RuntimeError, match="call failed"):
            plain()
    else:
        plain()
    assert seen == [False] and be.pdl is True


@pytest.mark.parametrize("was, on", [(True, False), (False, True), (True, True)])
def test_backend_pdl_sets_the_lever_in_the_block_and_puts_it_back(was, on):
    """``common.backend_pdl``: the backend's ``pdl`` is ``on`` inside the block and what it was after, also where the
    block raises."""
    from glm_ep.bench.common import backend_pdl

    be = _Backend(was)
    with backend_pdl(be, on):
        assert be.pdl is on
    assert be.pdl is was
    with pytest.raises(RuntimeError, match="inside"):
        with backend_pdl(be, on):
            raise RuntimeError("inside")
    assert be.pdl is was


class _Stream:
    def __init__(self):
        self.synced = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        self.synced += 1


def _fake_timer(monkeypatch, calls: list, times: dict):
    """``common.time_gpu_us`` replaced: it runs the call once (as one timed call does) and returns the next of the
    call's listed times."""
    from glm_ep.bench import common

    def fake(cp, stream, fn, repeats=5, warmup=2, hold_us=3000.0):
        assert (repeats, warmup) == (1, 0)  # one call a round, the warm-up done before the rounds
        fn()
        return times[calls[-1]].pop(0)

    monkeypatch.setattr(common, "time_gpu_us", fake)


def test_alternating_gpu_us_turns_the_order_every_round(monkeypatch):
    """``common.alternating_gpu_us``: each call warmed up first, then rounds of one timed call each whose order turns
    every round, and each call's median over its own rounds."""
    from glm_ep.bench.common import alternating_gpu_us

    calls: list[str] = []
    times = {"a": [10.0, 30.0, 20.0, 99.0], "b": [1.0, 2.0, 3.0, 4.0]}
    _fake_timer(monkeypatch, calls, times)
    a, b = (lambda: calls.append("a")), (lambda: calls.append("b"))
    assert alternating_gpu_us(None, _Stream(), [a, b], rounds=4, warmup=2) == [25.0, 2.5]
    assert calls == ["a", "a", "b", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]


def test_site_and_plain_us_times_the_plain_twin_only_where_the_backend_has_pdl(monkeypatch):
    """``common.site_and_plain_us``: with programmatic launches, the call and its plain twin alternate (the twin's
    calls run with ``pdl`` off); without, the call alone and no plain figure."""
    from glm_ep.bench.common import site_and_plain_us

    be, calls = _Backend(True), []
    times = {True: [5.0] * 6, False: [7.0] * 6}
    _fake_timer(monkeypatch, calls, times)
    assert site_and_plain_us(None, _Stream(), be, lambda: calls.append(be.pdl)) == (5.0, 7.0)
    assert calls[:2] == [True, False] and calls[2:4] == [True, False] and calls[4:6] == [False, True]
    assert be.pdl is True
    off, calls[:] = _Backend(False), []
    times[False] = [3.0] * 6
    assert site_and_plain_us(None, _Stream(), off, lambda: calls.append(off.pdl)) == (3.0, None)
    assert calls == [False] * 7  # one warm-up and six rounds, all plain


def test_settle_waits_for_the_stream_then_idles(monkeypatch):
    """``common.settle``: the stream drained first, then the card left idle for the given seconds."""
    from glm_ep.bench import common

    slept: list[float] = []
    monkeypatch.setattr(common.time, "sleep", slept.append)
    stream = _Stream()
    common.settle(stream, 0.25)
    assert stream.synced == 1 and slept == [0.25]
    common.settle(stream)
    assert slept == [0.25, common.SETTLE_S] and common.SETTLE_S > 0


def test_the_cupy_gemm_rate_queues_its_product_on_the_timed_stream():
    """Without a PyTorch peer the prefill bench takes its bf16 rate from ``cupy_gemm_tflops``: every product it
    times must be queued on the stream whose events time it (CuPy queues on its current stream), and the rate is
    2 n^3 over the time those events give."""
    from types import SimpleNamespace

    from glm_ep.bench.common import cupy_gemm_tflops

    class Stream:
        def __init__(self, name):
            self.name, self.queued_us = name, 0.0

        def __enter__(self):
            current.append(self)

        def __exit__(self, *exc):
            current.pop()

        def synchronize(self):
            pass

    default, timed = Stream("default"), Stream("timed")
    current = [default]

    class Event:
        def record(self, stream):
            self.at = stream.queued_us

        def synchronize(self):
            pass

    def matmul(a, b, out):
        current[-1].queued_us += 1000.0  # one product: 1 ms of GPU time on the stream it was queued on

    cp = SimpleNamespace(ones=lambda shape, dtype: None, empty=lambda shape, dtype: None, matmul=matmul,
                         cuda=SimpleNamespace(Event=Event, get_elapsed_time=lambda s, e: (e.at - s.at) / 1e3))
    n = 1024
    rate = cupy_gemm_tflops(cp, timed, n)
    assert timed.queued_us > 0 and default.queued_us == 0, "a product was queued off the timed stream"
    assert rate == pytest.approx(2 * n ** 3 / 1e-3 / 1e12), rate

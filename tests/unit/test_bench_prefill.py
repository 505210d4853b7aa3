"""The host side of ``glm-ep bench --prefill`` (no GPU): the crossover rule the lever is set from,
and the results table rendered from a recorded run."""

from __future__ import annotations

import json
from pathlib import Path

from glm_ep.bench.common import card_tag
from glm_ep.bench.prefill import WIDTHS, crossover, lever_advice, render, result_stem
from glm_ep.config.topology import PathLevers

RECORDED = Path(__file__).resolve().parents[2] / "docs" / "perf" / "prefill_h200.json"


def sweep(*pairs):
    return [{"rows": r, "union_us": u, "sorted_us": s} for r, u, s in pairs]


def test_crossover_is_where_the_grouped_gemm_stops_losing():
    assert crossover(sweep((9, 1.0, 2.0), (16, 2.0, 1.5), (32, 3.0, 1.0))) == 16
    # a win below a later loss does not count: the grouped path must never be slower from there on
    assert crossover(sweep((9, 2.0, 1.0), (16, 1.0, 2.0), (32, 3.0, 1.0))) == 32
    assert crossover(sweep((9, 1.0, 2.0), (16, 1.0, 2.0))) is None


def test_render_recorded_run():
    data = json.loads(RECORDED.read_text())
    text = render(data["meta"], data)
    for r in data["widths"]:
        assert f"| {r['rows']} | {r['sparse_us']:.1f} | {r['path']} |" in text
    assert f"crossover at **{data['meta']['crossover']} rows**" in text
    assert text.count("★") == len(data["widths"])  # one best variant per width


def test_a_partial_run_names_its_own_files():
    """The default widths write PREFILL_<CARD>.md / prefill_<card>.json / prefill_<card>.png; other --rows their own
    stem, so a run of two widths never overwrites the full table, and one card's run never another card's."""
    assert result_stem(list(WIDTHS), "h100") == "prefill_h100"
    assert result_stem([1024, 4096], "h200") == "prefill_h200_1024_4096"
    assert result_stem([16], "h100").upper() == "PREFILL_H100_16"


def test_card_tags_name_results_files():
    assert card_tag("NVIDIA H100 80GB HBM3") == "h100" and card_tag("NVIDIA H200") == "h200"
    assert card_tag("NVIDIA GB10") == "gb10" and card_tag("") == "gpu"


def test_render_nvfp4_dense_sweep():
    """The dense FFN stored NVFP4: each path per swept width, the crossover (row groups against the grouped GEMM
    with its K split) and the byte floor over the fastest; a run without the sweep renders without it."""
    data = json.loads(RECORDED.read_text())
    assert f"NVFP4: row groups vs grouped GEMM — crossover at **{data['meta']['nvfp4_crossover']} rows**" in \
        render(data["meta"], data)
    assert "NVFP4: row groups" not in render(data["meta"], {**data, "nvfp4_sweep": []})
    data["nvfp4_sweep"] = [{"rows": 9, "union_us": 200.0, "sorted_nosplit_us": 260.0, "sorted_us": 50.0},
                           {"rows": 16, "union_us": 225.0, "sorted_nosplit_us": 270.0, "sorted_us": 40.0}]
    data["meta"].update(nvfp4_dense_floor_us=20.0, nvfp4_crossover=crossover(data["nvfp4_sweep"]))
    text = render(data["meta"], data)
    assert "NVFP4: row groups vs grouped GEMM — crossover at **9 rows** (byte floor 20.0 µs)" in text
    assert "| 9 | 200.0 | 260.0 | 50.0 | — | 0.40 |" in text and "| 16 | 225.0 | 270.0 | 40.0 | — | 0.50 |" in text
    assert "bf16 weights (cuBLAS)" not in text


def test_render_nvfp4_dequant_crossover():
    """With the dequantized path timed: its column, its crossover against the grouped GEMM (over the widths where
    both ran; row groups are not timed at the widest) and the floor over the fastest of the four."""
    data = json.loads(RECORDED.read_text())
    data["nvfp4_sweep"] = [
        {"rows": 128, "union_us": 900.0, "sorted_nosplit_us": 170.0, "sorted_us": 160.0, "dequant_us": 190.0},
        {"rows": 256, "union_us": 1800.0, "sorted_nosplit_us": 320.0, "sorted_us": 300.0, "dequant_us": 230.0},
        {"rows": 512, "sorted_nosplit_us": 600.0, "sorted_us": 580.0, "dequant_us": 300.0}]
    meta = {**data["meta"], "nvfp4_dense_floor_us": 23.0, "nvfp4_crossover": crossover(data["nvfp4_sweep"]),
            "nvfp4_dequant_crossover": crossover(data["nvfp4_sweep"], "sorted_us", "dequant_us")}
    assert meta["nvfp4_crossover"] == 128 and meta["nvfp4_dequant_crossover"] == 256
    text = render(meta, data)
    assert "grouped GEMM vs bf16 weights (cuBLAS) — crossover at **256 rows**" in text
    assert "| 256 | 1800.0 | 320.0 | 300.0 | 230.0 | 0.10 |" in text
    assert "| 512 | — | 600.0 | 580.0 | 300.0 | 0.08 |" in text
    assert "dequantized to bf16 (" not in text
    meta.update(dequant_us=40.0, dequant_gbs=2575.0, copy_gbs=4300.0)
    assert "One projection dequantized to bf16 (40.0 µs, 2575 GB/s read + written, 60% of copy)" in render(meta, data)


def test_the_crossover_names_the_lever_that_takes_it():
    """A card whose sweep crosses away from the built-in default is told the topology line that takes its crossover;
    one that crosses at the default, or nowhere, is told nothing; a crossover inside the row groups' widths is
    raised to the lever's floor."""
    default = PathLevers().prefill_gemm_min_rows
    assert lever_advice(default) == [] and lever_advice(None) == []
    assert "`prefill_gemm_min_rows = 12`" in lever_advice(12)[0] and f"is {default};" in lever_advice(12)[0]
    assert "`prefill_gemm_min_rows = 9`" in lever_advice(4)[0]
    data = json.loads(RECORDED.read_text())
    text = render({**data["meta"], "crossover": 12}, data)
    assert "`prefill_gemm_min_rows = 12`" in text
    assert "prefill_gemm_min_rows" not in render({**data["meta"], "crossover": default}, data)


def test_render_the_stage_table():
    """A run with the stage table (``--stages``) renders it before the sparse site's table, saying how it was timed;
    a run without it, without."""
    data = json.loads(RECORDED.read_text())
    assert "Where the sparse site's time goes" not in render(data["meta"], data)
    data["stages"] = [{"rows": 16, "union": 90, "site_us": 640.0, "note": "", "stages": [
        {"op": "sort_by_expert", "label": "sort by expert", "us": 5.0, "bytes": 0},
        {"op": "moe_experts_sorted", "label": "routed experts (grouped GEMM: gate + up + SwiGLU, down)", "us": 600.0,
         "bytes": 1_200_000_000}]}]
    text = render(data["meta"], data)
    stages, site = text.index("## Where the sparse site's time goes"), text.index("## Sparse site (router")
    assert stages < site
    assert "one call at a time on its GPU time only" in text[stages:site]
    assert "| 16 | 640.0 | sort by expert 5.0; routed experts (grouped GEMM: gate + up + SwiGLU, down) 600.0 (" \
           in text[stages:site]


def test_one_calls_gpu_time_holds_the_stream_and_flushes_the_l2():
    """``time_gpu_us`` on a stand-in CuPy: per timed call, the spin, the L2 flush (a kernel reading FLUSH_BYTES,
    never a fill, which would leave the L2 dirty), the start event, the call, the end event, in that order on the
    given stream; a call the host queued past the hold (its start event already done) is
    timed again with twice the hold; the median in µs."""
    from types import SimpleNamespace

    import numpy as np

    from glm_ep.bench import common

    log: list = []
    done = iter([True, False, False, False])  # the first timed call outran its hold

    class Event:
        def record(self, stream):
            log.append(("event", stream))

        @property
        def done(self):
            return next(done)

        def synchronize(self):
            pass

    class Stream:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    stream = Stream()
    on = []  # the stream each kernel was queued on
    kernels = {"bench_spin": lambda grid, block, args, stream=None: (log.append(("spin", int(args[0]))),
                                                                       on.append(stream)),
               # the flush reads its buffer (16 bytes an element) and writes none of it: no fill of it is queued
               "bench_flush": lambda grid, block, args, stream=None: (log.append(("flush", 16 * int(args[1]))),
                                                                        on.append(stream))}
    cp = SimpleNamespace(RawKernel=lambda src, name: kernels[name], uint8=np.uint8,
                         empty=lambda n, dtype: SimpleNamespace(nbytes=n, fill=lambda v: log.append(("fill", n))),
                         cuda=SimpleNamespace(Event=Event, get_elapsed_time=lambda a, b: 0.25))
    us = common.time_gpu_us(cp, stream, lambda: log.append(("call",)), repeats=3, warmup=1, hold_us=1000.0)
    assert us == 250.0
    calls = [e for e in log if e[0] != "event"]
    assert calls[0] == ("call",)  # the warm-up
    holds = [e[1] for e in calls if e[0] == "spin"]
    assert holds == [1_000_000, 2_000_000, 2_000_000, 2_000_000]  # ns: doubled once, after the call that outran it
    timed = log[1:]
    for k in range(4):  # spin, flush, start, call, end
        assert [e[0] for e in timed[5 * k:5 * k + 5]] == ["spin", "flush", "event", "call", "event"]
    assert all(e[1] is stream for e in log if e[0] == "event")
    assert ("flush", common.FLUSH_BYTES) in log and not any(e[0] == "fill" for e in log)
    assert len(on) == 8 and all(s is stream for s in on)  # the spins and the flushes on the timed stream

"""The host side of ``glm-ep bench --prefill`` (no GPU): the crossover rule the lever is set from,
and the results table rendered from a recorded run."""

from __future__ import annotations

import json
from pathlib import Path

from glm_ep.bench.prefill import WIDTHS, crossover, render, result_stem

RECORDED = Path(__file__).resolve().parent.parent / "docs" / "perf" / "prefill.json"


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
    """The default widths write PREFILL.md / prefill.json / prefill.png; other --rows their own stem, so a run of two
    widths never overwrites the full table."""
    assert result_stem(list(WIDTHS)) == "prefill"
    assert result_stem([1024, 4096]) == "prefill_1024_4096"
    assert result_stem([16]) == "prefill_16" and result_stem([16]).upper() == "PREFILL_16"

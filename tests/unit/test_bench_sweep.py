"""The host side of ``glm-ep bench --sweep`` (no GPU): the union ring's crossover rule, the tables rendered from a
run's results, and the flags refused before any device is touched."""

from __future__ import annotations

import subprocess
import sys

from glm_ep.bench.sweep_dense import ENGINES, captured, fastest, render_dense, weight_copies
from glm_ep.bench.sweep_ring import UNION_VARIANTS, render_ring, render_union, ring_up_to
from glm_ep.errors import EXIT_USER

from helpers import REPO

META = {"device": "NVIDIA H200", "copy_gbs": 4000.0, "command": "glm-ep bench --sweep x",
        "date": "2026-12-06 10:00 UTC", "python": "3.12"}
BLOCKS, RING, RING4 = (name for name, _ in UNION_VARIANTS[:3])


def union_rows(*triples):
    """Rows of a union sweep: the block kernels ``b``, every ring geometry ``u`` but slab 4 (``u + 1``)."""
    return [{"rows": r, "union": 8 * r,
             **{name: b if levers.get("union_max_rows") == 0 else u + (name == RING4) for name, levers in UNION_VARIANTS}}
            for r, b, u in triples]


def test_the_union_ring_serves_up_to_the_last_width_it_never_loses():
    assert ring_up_to(union_rows((2, 110.0, 104.0), (3, 165.0, 158.0), (4, 208.0, 206.0), (5, 260.0, 282.0)),
                      BLOCKS, RING) == 4
    # a loss at 3 rows ends it there, whatever comes after
    assert ring_up_to(union_rows((2, 110.0, 104.0), (3, 150.0, 158.0), (4, 260.0, 206.0)), BLOCKS, RING) == 2
    assert ring_up_to(union_rows((2, 100.0, 104.0), (3, 200.0, 158.0)), BLOCKS, RING) == 0  # level counts as a win
    assert ring_up_to(union_rows((3, 165.0, 165.0), (2, 110.0, 104.0)), BLOCKS, RING) == 3  # rows in any order


def test_render_union():
    rows = union_rows((2, 110.0, 104.0), (8, 391.0, 446.5))
    meta = {**META, "layers": 4, "experts": 288, "top_k": 8, "expert_bytes": 14_155_776,
            "variants": [n for n, _ in UNION_VARIANTS],
            "ring_up_to": ring_up_to(rows, BLOCKS, RING)}
    text = render_union({"meta": meta, "rows": rows})
    assert "never slower than the block kernels up to **2 rows** (`ring_union_max_rows`)" in text
    # 16 experts x 14.16 MB in 104 us at 4000 GB/s: 54%
    assert ("| 2 | 16 | 110.0 (51%) | 104.0 (54%) | 105.0 (54%) | 104.0 (54%) | 104.0 (54%) | 104.0 (54%) | "
            "110.0 (51%) | 104.0 (54%) |") in text
    assert text.startswith("# glm-ep bench --sweep union: NVIDIA H200")
    assert "The union of R rows (8 experts a row, drawn from all 288) over 4 layers" in text
    assert "alone" not in text  # a run without the per-projection times (before they were taken) renders as it did
    for row in rows:  # each projection alone: its own table, over its own share of the bytes
        for name, _ in UNION_VARIANTS:
            row[f"{name} | glu"], row[f"{name} | down"] = 70.0, 35.0
    text = render_union({"meta": meta, "rows": rows})
    glu = text.index("Gate + up + SwiGLU alone")
    down = text.index("The down projection alone")
    assert glu < down
    # 16 experts x 2/3 x 14.16 MB in 70 us at 4000 GB/s: 54%; the down's third in 35 us: 54%
    assert "| 2 | " + " | ".join(["70.0 (54%)"] * len(UNION_VARIANTS)) + " |" in text[glu:down]
    assert "| 2 | " + " | ".join(["35.0 (54%)"] * len(UNION_VARIANTS)) + " |" in text[down:]


def test_render_ring():
    row = {"variant": "ring, as shipped", "glu_us": 31.5, "down_us": 17.0, "both_us": 48.0, "tail_us": 25.9,
           "glu_bytes": 75_497_472, "down_bytes": 37_748_736, "tail_bytes": 37_748_736 + 16_777_216}
    one = {"variant": "as shipped", "glu_us": 30.6, "down_us": 17.1}
    meta = {**META, "layers": 8, "one_glu_bytes": 56_623_104, "one_down_bytes": 28_311_552}
    text = render_ring({"meta": meta, "rows": [row], "one_expert": [one]})
    assert "| ring, as shipped | 31.5 (60%) | 17.0 (56%) | 48.0 (59%) | 25.9 (53%) |" in text
    assert "| as shipped | 30.6 (46%) | 17.1 (41%) |" in text


def test_render_dense_marks_the_fastest_engine_and_the_shipped_rate():
    r = {"shape": "dense down", "rows": 9, "bytes": 100_663_296, "wstream": 39.4, "cublas": 29.6,
         "shipped": 29.9}
    assert fastest(r) == "cublas"  # the dispatch's own time is not an engine
    assert fastest({**r, "shipped": 1.0}) == "cublas"
    text = render_dense({"meta": META, "results": [r]})
    assert "## dense down" in text and "| rows | " + " | ".join(ENGINES) + " | TB/s |" in text
    assert "| 9 | — | 39.4 | 29.6 ★ | — | 29.9 | 3.37 |" in text
    text = render_dense({"meta": META, "results": [{**r, "eager": ["cublas"]}]})
    assert "| 9 | — | 39.4 | 29.6† ★ | — | 29.9 | 3.37 |" in text and "† back-to-back eager calls (past 8 rows" in text


def test_dense_sweep_streams_its_weights_and_graphs_what_a_step_can_capture():
    """Copies of a shape's weights that together pass three L2s (at least two): the shared expert's 33 MB gate + up
    on an H100's 50 MB L2 takes five, the dense FFN's 201 MB two. At the 1..8 rows a step captures every engine is
    timed as a graph but cuBLAS; past them every engine eagerly, as a job calls them."""
    assert weight_copies(2 * 2048 * 4096 * 2, 50 * 2**20) == 5
    assert weight_copies(2 * 12288 * 4096 * 2, 50 * 2**20) == 2
    assert weight_copies(3 * 2**20, 3 * 2**20) == 3
    assert [e for e in ENGINES if captured(e, 8)] == ["gemv", "wstream", "shipped"]
    assert [e for e in ENGINES if captured(e, 9)] == []


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glm_ep", "bench", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_sweep_flags_are_checked_before_any_device():
    r = _bench("--sweep", "ring", "--rows", "4")
    assert r.returncode == EXIT_USER and "--rows sets the widths of --prefill and --sweep dense" in r.stderr, r.stderr
    r = _bench("--prefill", "--sweep", "dense")
    assert r.returncode == EXIT_USER and "not allowed with argument" in r.stderr, r.stderr
    r = _bench("--sweep", "pdl")
    assert r.returncode == EXIT_USER and "invalid choice: 'pdl'" in r.stderr, r.stderr


def test_stages_without_prefill_is_refused():
    r = _bench("--stages")
    assert r.returncode == EXIT_USER and "expected --prefill --stages" in r.stderr, r.stderr


def test_gemm_stages_without_prefill_is_refused():
    r = _bench("--gemm-stages")
    assert r.returncode == EXIT_USER and "expected --prefill --gemm-stages" in r.stderr, r.stderr

"""pyflakes over the package, the tests and the tools: undefined names, unused imports and the like, also in the
code only a GPU runs (the CUDA backend, the benches, the device tools), which CI cannot execute."""

from __future__ import annotations

import io
from pathlib import Path

from pyflakes.api import checkRecursive
from pyflakes.reporter import Reporter

REPO = Path(__file__).resolve().parents[2]


def test_pyflakes_finds_nothing():
    out, err = io.StringIO(), io.StringIO()
    found = checkRecursive([str(REPO / d) for d in ("glm_ep", "tests", "tools")], Reporter(out, err))
    assert found == 0 and not err.getvalue(), f"pyflakes:\n{out.getvalue()}{err.getvalue()}"


def test_pyflakes_would_report_an_undefined_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    return undefined_name\n")
    out = io.StringIO()
    assert checkRecursive([str(bad)], Reporter(out, io.StringIO())) == 1
    assert "undefined name 'undefined_name'" in out.getvalue()

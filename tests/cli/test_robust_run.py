"""``glm-ep run``'s check never prints PASS over a non-finite number, and FAIL has its own exit code."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from glm_ep.check.verdict import Verdict, max_propagating_nan
from glm_ep.errors import EXIT_FAIL, EXIT_USER

from cli_jobs import copy_checkpoint, glm_ep, set_bits, write_topology

NAN_BF16 = 0x7FC0


def test_max_propagates_nan_wherever_it_sits() -> None:
    assert max([0.0, math.nan]) == 0.0  # what a plain max does
    for values in ([0.0, math.nan], [math.nan, 0.5], [0.1, math.nan, 0.2]):
        assert math.isnan(max_propagating_nan(values))
    assert max_propagating_nan([0.25, 0.5]) == 0.5 and max_propagating_nan([]) == 0.0


@pytest.mark.parametrize("change", [dict(nonfinite=1), dict(site_err=math.nan), dict(step_err=math.nan),
                                    dict(ranks_agree=False), dict(site_err=0.02)],
                         ids=["nonfinite", "nan-site-error", "nan-step-error", "ranks-differ", "over-bound"])
def test_verdict_fails_on_each_fault(change: dict) -> None:
    good = dict(site_err=3e-3, step_err=0.0, nonfinite=0, ranks_agree=True, site_calls=8)
    assert Verdict(**good).ok and Verdict(**good).lines()[-1] == "PASS"
    bad = Verdict(**dict(good, **change))
    assert not bad.ok and bad.lines()[-1] == "FAIL"


def test_run_fails_with_its_own_exit_code_when_outputs_are_nan(tiny_checkpoint, tmp_path) -> None:
    """A NaN weight let through by ``check_weights = false`` makes every output NaN: FAIL, exit 3."""
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "tiny")
    set_bits(ckpt, "model.layers.0.mlp.gate_proj.weight", (..., 0), NAN_BF16)
    topo = write_topology(tmp_path / "lax.toml", world=2, tp=2, ep=2, check_weights=False)
    r = glm_ep(2, "run", "--model", str(ckpt), "--topology", str(topo), "--prefill", "9", "--decode", "2",
               "--verify", "3")
    assert r.returncode == EXIT_FAIL, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "FAIL" and "PASS" not in lines
    assert "max relative L2 error of a site vs float64 = nan" in r.stdout, r.stdout[-2000:]
    nonfinite = re.search(r"^check: NaN/Inf values in the outputs: (\d+) \(expected 0; the first from finite inputs at "
                          r"layer 0\)$", r.stdout, re.M)
    assert nonfinite and int(nonfinite[1]) >= (9 + 2 + 3) * 128, r.stdout[-2000:]  # every step output value
    assert "Traceback" not in r.stderr


def test_user_error_exit_code_is_distinct_from_fail(tmp_path: Path) -> None:
    r = glm_ep(2, "run", "--model", str(tmp_path / "nowhere"))
    assert r.returncode == EXIT_USER != EXIT_FAIL, r.stderr[-2000:]

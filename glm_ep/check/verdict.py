"""``glm-ep run``'s check: PASS only when every number is finite and close, on every rank alike.

Each site of every call is held against float64 on the input that site actually saw (a
free-running float64 chain would drift onto other experts at router near-ties) — every site and
row, or the sample of a ``CheckPlan`` — the timed step's output against the site-by-site chain,
and the ranks' outputs against each other, bitwise. Errors propagate NaN: a NaN error or a NaN/Inf
output is a FAIL, never dropped by a ``max``. The checked layers are shared out over the ranks, so
no rank waits long on another at the verdict.

The float64 memory is measured with ``tracemalloc`` over the evaluation: the peak of what it
allocated and still held (NumPy reports its buffers there, and every weight read is a NumPy or
Python buffer), which is the check's own memory. The process's ``maxrss`` would not show it: the
runtime's load has already set that high-water mark.
"""

from __future__ import annotations

import hashlib
import tracemalloc
from dataclasses import dataclass
from typing import Sequence

import ml_dtypes
import numpy as np

from glm_ep.check.plan import CheckPlan
from glm_ep.checkpoint.finite import nonfinite_mask
from glm_ep.dist.ranks import Ranks
from glm_ep.check.reference import Reference, rel_l2
from glm_ep.mlp.workspace import fmt_bytes

BF16 = ml_dtypes.bfloat16
REL_L2_BOUND = 1e-2

#: one call's site-by-site chain: (input, output) of each site, on the host
Trace = Sequence[tuple[np.ndarray, np.ndarray]]


def max_propagating_nan(values: Sequence[float]) -> float:
    """The largest value, NaN if any is NaN (Python's ``max`` drops a NaN that is not first)."""
    return float(np.max(np.asarray(values, dtype=np.float64), initial=0.0))


@dataclass(frozen=True)
class Verdict:
    site_err: float  # worst relative L2 error of a site vs float64
    step_err: float  # worst relative L2 error of a timed step vs its site-by-site chain
    nonfinite: int  # NaN/Inf values in the step outputs and the site outputs
    ranks_agree: bool  # every rank holds the same step outputs, bit for bit
    site_calls: int
    checked: str = ""  # what the float64 evaluation covered (``CheckPlan.checked``)
    peak_bytes: int = 0  # measured float64 memory of the rank that used most
    estimate_bytes: int = 0
    overflow_layer: int | None = None  # the first layer of a chain whose output went non-finite from finite input

    @property
    def ok(self) -> bool:
        return (self.nonfinite == 0 and self.ranks_agree and self.site_err < REL_L2_BOUND
                and self.step_err < REL_L2_BOUND)

    def lines(self) -> list[str]:
        return [f"check: max relative L2 error of a site vs float64 = {self.site_err:.3e} (bound {REL_L2_BOUND:g}, "
                f"{self.site_calls} site calls)",
                f"check: timed step vs site-by-site chain: relative L2 {self.step_err:.3e} (bound {REL_L2_BOUND:g})",
                f"check: NaN/Inf values in the outputs: {self.nonfinite} (expected 0"
                + (f"; the first from finite inputs at layer {self.overflow_layer})" if self.overflow_layer is not None
                   else ")"),
                f"check: ranks hold identical outputs: {'yes' if self.ranks_agree else 'NO'}",
                f"check: float64 {self.checked}; memory peak {fmt_bytes(self.peak_bytes)} per rank measured "
                f"(tracemalloc, the largest rank; estimate {fmt_bytes(self.estimate_bytes)})",
                "PASS" if self.ok else "FAIL"]


def check_run(model_dir: str, plan: CheckPlan, steps: Sequence[np.ndarray], traces: Sequence[Trace], ranks: Ranks,
              check_weights: bool = True, loaded: dict[str, tuple[int, int, int]] | None = None) -> Verdict:
    """The verdict on the timed step outputs ``steps`` and each call's ``traces``, agreed by all ranks;
    the float64 sites are those of ``plan``. ``loaded``: the ``Checkpoint.stamps`` of the load, so a checkpoint
    rewritten since is refused as such (agreed, a CheckpointError) rather than checked."""
    site_errs, peak = ranks.agree("float64 reference", lambda: _float64_errors(model_dir, plan, traces, ranks.rank,
                                                                               check_weights, loaded))
    step_errs = []
    for y_step, trace in zip(steps, traces):
        h_last, y_last = trace[-1]
        chain_out = (h_last.astype(np.float32) + y_last.astype(np.float32)).astype(BF16)
        step_errs.append(rel_l2(y_step, chain_out))
    nonfinite = sum(int(np.count_nonzero(nonfinite_mask(y))) for y in steps)
    nonfinite += sum(int(np.count_nonzero(nonfinite_mask(y))) for trace in traces for _, y in trace)
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(y).tobytes() for y in steps)).hexdigest()
    every = ranks.allgather("check verdict", (max_propagating_nan(site_errs), max_propagating_nan(step_errs),
                                              nonfinite, digest, peak))
    return Verdict(site_err=max_propagating_nan([e[0] for e in every]),
                   step_err=max_propagating_nan([e[1] for e in every]),
                   nonfinite=max(e[2] for e in every),
                   ranks_agree=len({e[3] for e in every}) == 1,
                   site_calls=plan.site_calls, checked=plan.checked(), peak_bytes=max(e[4] for e in every),
                   estimate_bytes=plan.estimate_bytes, overflow_layer=first_overflow(traces))


def first_overflow(traces: Sequence[Trace]) -> int | None:
    """The first layer, over the calls' site-by-site chains, whose output holds NaN or Inf in a row whose input to
    it was finite (where the chain overflowed; later layers only carry it on); None if none."""
    found = [i for trace in traces for i, (h, y) in enumerate(trace)
             if (nonfinite_mask(y).any(axis=1) & ~nonfinite_mask(h).any(axis=1)).any()]
    return min(found) if found else None


def _float64_errors(model_dir: str, plan: CheckPlan, traces: Sequence[Trace], rank: int, check_weights: bool,
                    loaded: dict[str, tuple[int, int, int]] | None) -> tuple[list[float], int]:
    """This rank's share of the plan: each checked site's error over its checked rows, and the
    peak memory (bytes) the evaluation allocated."""
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        with Reference(model_dir, check_finite=check_weights, resident=plan.mode == "full", loaded=loaded) as ref:
            errs = []
            for trace, rows in zip(traces, plan.rows):
                picked = list(rows)
                for i in plan.layers_of(rank):
                    x, y = trace[i]
                    errs.append(rel_l2(y[picked], ref.site(i, x[picked])))
            ref.check_unchanged()  # nor rewritten while the check read it
        return errs, tracemalloc.get_traced_memory()[1] - base
    finally:
        if not tracing:
            tracemalloc.stop()

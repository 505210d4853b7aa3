"""``glm-ep run``'s check: PASS only when every number is finite and close, on every rank alike.

Each site of every call is held against float64 on the input that site actually saw (a
free-running float64 chain would drift onto other experts at router near-ties), the timed step's
output against the site-by-site chain, and the ranks' outputs against each other, bitwise. Errors
propagate NaN: a NaN error or a NaN/Inf output is a FAIL, never dropped by a ``max``. The float64
sites are shared out over the ranks by layer, so no rank waits long on another at the verdict.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import ml_dtypes
import numpy as np

from glm_ep.finite import nonfinite_mask
from glm_ep.parallel import Ranks
from glm_ep.reference import Reference, rel_l2

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

    @property
    def ok(self) -> bool:
        return (self.nonfinite == 0 and self.ranks_agree and self.site_err < REL_L2_BOUND
                and self.step_err < REL_L2_BOUND)

    def lines(self) -> list[str]:
        return [f"check: max relative L2 error of a site vs float64 = {self.site_err:.3e} (bound {REL_L2_BOUND:g}, "
                f"{self.site_calls} site calls)",
                f"check: timed step vs site-by-site chain: relative L2 {self.step_err:.3e} (bound {REL_L2_BOUND:g})",
                f"check: NaN/Inf values in the outputs: {self.nonfinite} (expected 0)",
                f"check: ranks hold identical outputs: {'yes' if self.ranks_agree else 'NO'}",
                "PASS" if self.ok else "FAIL"]


def check_run(model_dir: str, steps: Sequence[np.ndarray], traces: Sequence[Trace], ranks: Ranks,
              check_weights: bool = True) -> Verdict:
    """The verdict on the timed step outputs ``steps`` and each call's ``traces``, agreed by all ranks."""
    n_layers = len(traces[0])
    mine = [i for i in range(n_layers) if i % ranks.size == ranks.rank]
    ref = ranks.agree("float64 reference load", lambda: Reference(model_dir, mine, check_finite=check_weights))
    site_errs = [rel_l2(trace[i][1], ref.site(i, trace[i][0])) for trace in traces for i in mine]
    step_errs = []
    for y_step, trace in zip(steps, traces):
        h_last, y_last = trace[-1]
        chain_out = (h_last.astype(np.float32) + y_last.astype(np.float32)).astype(BF16)
        step_errs.append(rel_l2(y_step, chain_out))
    nonfinite = sum(int(np.count_nonzero(nonfinite_mask(y))) for y in steps)
    nonfinite += sum(int(np.count_nonzero(nonfinite_mask(y))) for trace in traces for _, y in trace)
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(y).tobytes() for y in steps)).hexdigest()
    every = ranks.allgather("check verdict", (max_propagating_nan(site_errs), max_propagating_nan(step_errs),
                                              nonfinite, digest))
    return Verdict(site_err=max_propagating_nan([e[0] for e in every]),
                   step_err=max_propagating_nan([e[1] for e in every]),
                   nonfinite=max(e[2] for e in every),
                   ranks_agree=len({e[3] for e in every}) == 1,
                   site_calls=n_layers * len(traces))

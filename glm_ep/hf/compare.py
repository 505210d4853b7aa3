"""Two greedy generations from one prompt, held against each other: glm_ep's (``got``) and HF's own MLPs'
(``ref``).

Up to their first differing token both saw the same prefix, so their logits there are comparable: the largest
absolute difference and the relative L2 are taken over those steps (the differing one included). Where they part,
the difference is explained when HF's own logits for the two tokens are closer than the logits moved at that step
(the bf16 numerics then decide the near tie); the bf16 spacing at those logits is printed for scale. Top-k routing
is discontinuous: where HF's routers saw a near tie on the way (``margin``, the smallest gap between the k-th and
the (k+1)-th expert's selection score), glm_ep's bf16 numerics may choose the other expert, which moves that row's
MLP output, and the logits, by much more than rounding. Logits as far apart as two unrelated models' (relative L2
past ``UNRELATED_REL_L2``; independent logits of equal spread sit near sqrt(2)) explain nothing: most likely the two
models are not a pair (``--hf-model`` made from another checkpoint or seed), and the comparison says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


#: relative L2 of glm_ep's logits against HF's past which the two are not the same model: a routing flip of the tiny
#: model moved them by 0.31 on an H100 (docs/perf/GENERATE_H100.md), two unrelated models' sit near sqrt(2)
UNRELATED_REL_L2 = 0.75


def bf16_spacing(value: float) -> float:
    """The distance between neighbouring bf16 values at ``|value|`` (8 significant bits)."""
    magnitude = abs(value)
    if magnitude == 0 or not math.isfinite(magnitude):
        return 0.0 if magnitude == 0 else math.inf
    return 2.0 ** (math.floor(math.log2(magnitude)) - 7)


@dataclass(frozen=True)
class Comparison:
    """``tokens`` new tokens each; ``first_diff`` the index of the first that differs (None: none does);
    ``steps`` compared (through ``first_diff``); ``max_abs`` / ``rel_l2`` of glm_ep's logits against HF's over
    them; at ``first_diff``: HF's ``gap`` between its token's logit and glm_ep's token's, how far the logits
    ``moved`` there (largest absolute difference), and the ``bf16`` spacing at the larger of the two logits;
    ``margin`` the smallest routing margin of HF's routers over the compared steps (None: no sparse layer)."""

    tokens: int
    first_diff: int | None
    steps: int
    max_abs: float
    rel_l2: float
    gap: float | None = None
    moved: float | None = None
    bf16: float | None = None
    margin: float | None = None

    @property
    def unrelated(self) -> bool:
        """The logits as far apart as two unrelated models': not a pair, or not the same numbers at all."""
        return self.rel_l2 > UNRELATED_REL_L2

    @property
    def explained(self) -> bool:
        """No difference, or one where HF's gap between the two tokens is below how far the logits moved, the
        logits themselves no further apart than one model's numerics move them."""
        return not self.unrelated and (self.first_diff is None or self.gap <= self.moved)

    def lines(self) -> list[str]:
        where = f"logits over the {self.steps} step(s) with the same prefix"
        stats = f"{where}: max |difference| {self.max_abs:.3e}, relative L2 {self.rel_l2:.3e}"
        if self.margin is not None:
            stats += f"; smallest routing margin in HF's routers {self.margin:.3e}"
        if self.unrelated:
            return [f"compare: the logits are as far apart as two unrelated models' (relative L2 {self.rel_l2:.2f} "
                    f"over {self.steps} step(s), past {UNRELATED_REL_L2}): not explained by rounding; expected "
                    "--hf-model to be --model's pair (glm-ep synth --hf-model writes one, from the same seed)",
                    f"compare: {stats}"]
        if self.first_diff is None:
            return [f"compare: HF's own MLPs generate the same {self.tokens} tokens", f"compare: {stats}"]
        verdict = ("below how far the logits moved there: a near tie that bf16 rounding decides" if self.explained
                   else "above how far the logits moved there: not explained by rounding")
        return [f"compare: first difference at new token {self.first_diff} of {self.tokens}: HF's logits for the two "
                f"tokens differ by {self.gap:.3e}, {verdict} (max |difference| {self.moved:.3e}; bf16 spacing at "
                f"those logits {self.bf16:.3e})", f"compare: {stats}"]


def compare(ref_tokens: Sequence[int], ref_logits: Sequence[np.ndarray], got_tokens: Sequence[int],
            got_logits: Sequence[np.ndarray], margins: Sequence[float] = ()) -> Comparison:
    """``ref`` (HF's own MLPs) against ``got`` (glm_ep's): tokens, and per step the logits ``[vocab]`` that chose
    each; ``margins`` HF's smallest routing margin per step (empty: no sparse layer)."""
    n = min(len(ref_tokens), len(got_tokens))
    first = next((i for i in range(n) if ref_tokens[i] != got_tokens[i]), None)
    steps = n if first is None else first + 1
    ref_SV = np.stack([np.asarray(v, np.float64) for v in ref_logits[:steps]])
    got_SV = np.stack([np.asarray(v, np.float64) for v in got_logits[:steps]])
    diff_SV = np.abs(got_SV - ref_SV)
    rel = float(np.linalg.norm(got_SV - ref_SV) / max(np.linalg.norm(ref_SV), 1e-300))
    margin = min(margins[:steps], default=math.inf)
    margin = margin if math.isfinite(margin) else None
    if first is None:
        return Comparison(n, None, steps, float(diff_SV.max()), rel, margin=margin)
    ours, theirs = ref_SV[first, got_tokens[first]], ref_SV[first, ref_tokens[first]]
    return Comparison(n, first, steps, float(diff_SV.max()), rel, gap=float(theirs - ours),
                      moved=float(diff_SV[first].max()), bf16=bf16_spacing(max(abs(ours), abs(theirs))), margin=margin)

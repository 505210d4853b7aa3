"""Greedy generation through a transformers ``glm5_next`` causal LM, prefill and decode timed apart.

The loop is HF's own forward with HF's KV cache: the prompt in one call (prefill: its last position's logits give
the first new token), then one call per further token (decode). The argmax of each step's logits (ties: the lower
token id, as ``torch.argmax``) is the next input, so the host waits for every step: that wait is in the times.
On CUDA the device is synchronised before each call, so a step's time is its own.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from glm_ep.hf import deps


@dataclass
class Generation:
    """``tokens`` the new token ids; ``logits`` float32 ``[vocab]`` per new token where kept; the seconds of
    the prefill call and of all decode calls; ``margins`` per step where ``RouterMargins`` watched."""

    tokens: list[int]
    prefill_s: float
    decode_s: float
    logits: list[np.ndarray] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)


class RouterMargins:
    """Forward hooks on every HF ``Glm5NextTextTopkRouter`` of a model, collecting the smallest routing margin
    (the k-th minus the (k+1)-th selection score, ``sigmoid(logits) + e_score_correction_bias``) over the rows
    and layers of each forward; ``take`` returns it and starts the next one (inf: no router ran or k = E)."""

    def __init__(self, model: Any):
        hf = deps.glm5_next()
        self._smallest = np.inf
        self._hooks = [m.register_forward_hook(self._hook) for m in model.modules()
                       if isinstance(m, hf.Glm5NextTextTopkRouter)]

    def _hook(self, router: Any, inputs: Any, outputs: Any) -> None:
        logits_TE = outputs[0].float()
        if router.top_k >= logits_TE.shape[-1]:
            return
        choice_TE = logits_TE.sigmoid() + router.e_score_correction_bias.float()
        top_TK = choice_TE.topk(router.top_k + 1, dim=-1).values
        self._smallest = min(self._smallest, float((top_TK[:, -2] - top_TK[:, -1]).min()))

    def take(self) -> float:
        smallest, self._smallest = self._smallest, np.inf
        return smallest

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _sync(device: Any) -> None:
    if device.type == "cuda":
        deps.torch().cuda.synchronize(device)


def greedy(model: Any, prompt: list[int], new_tokens: int, keep_logits: bool = False,
           margins: RouterMargins | None = None) -> Generation:
    """``new_tokens`` greedy tokens after ``prompt`` from ``model`` (a ``Glm5NextForConditionalGeneration``, on
    the device of its parameters)."""
    torch = deps.torch()
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    # transformers renamed the KV cache argument past_key_values to cache (5.25 takes both): the name it has
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache, out = None, Generation([], 0.0, 0.0)
    with torch.no_grad():
        for step in range(new_tokens):
            _sync(device)
            t0 = time.perf_counter()
            result = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
            last_V = result.logits[0, -1]
            token = int(last_V.argmax())
            _sync(device)
            dt = time.perf_counter() - t0
            if step == 0:
                out.prefill_s = dt
            else:
                out.decode_s += dt
            out.tokens.append(token)
            if keep_logits:
                out.logits.append(last_V.float().cpu().numpy())
            if margins is not None:
                out.margins.append(margins.take())
            cache = result[cache_arg]  # the output names it as the forward does
            ids = torch.tensor([[token]], device=device)
    return out

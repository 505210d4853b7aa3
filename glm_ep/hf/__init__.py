"""glm_ep inside HF transformers' GLM-5.3 (``glm5_next``): ``attach`` serves a model's MLPs from glm_ep (``attached``),
``pair`` writes an HF model whose MLPs are a glm_ep checkpoint's, ``generate`` is ``glm-ep generate``'s job.
torch and transformers (the ``hf`` extra) are imported when first used (``deps``), never by ``import glm_ep``."""

from __future__ import annotations

from typing import Any


def attach(model: Any, mlp: Any) -> Any:
    """Serve every decoder layer's MLP of the transformers ``glm5_next`` ``model`` from ``mlp`` (``glm_ep.load``);
    returns ``model``. Collective. See ``glm_ep.hf.attached``."""
    from glm_ep.hf.attached import attach as attach_mlps

    return attach_mlps(model, mlp)

"""torch and HF transformers' ``glm5_next`` modules (the ``hf`` extra), imported on first use, with an error that
says how to install them where they are missing."""

from __future__ import annotations

from types import ModuleType

from glm_ep.errors import ConfigError

_INSTALL = "install the hf extra: pip install '.[hf]' from the glm_ep checkout"


def torch() -> ModuleType:
    try:
        import torch
    except ImportError as e:
        raise ConfigError(f"glm_ep.hf needs torch, which does not import ({e}); {_INSTALL}") from None
    return torch


def glm5_next() -> ModuleType:
    """``transformers.models.glm5_next.modeling_glm5_next``."""
    torch()
    try:
        from transformers.models.glm5_next import modeling_glm5_next
    except ImportError as e:
        raise ConfigError(f"glm_ep.hf needs HF transformers with the glm5_next model (5.23 or later), which does not "
                          f"import ({e}); {_INSTALL}") from None
    return modeling_glm5_next

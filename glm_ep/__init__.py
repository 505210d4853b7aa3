"""glm_ep: the MLP sites of GLM-5.3-Flash (HF ``glm5_next``) across MPI ranks.

Routed NVFP4 experts are sharded by expert-parallel rank, the dense FFN and the shared
expert by tensor-parallel rank, and one all-reduce per site sums the partials after the
combine. See ``docs/PLACEMENT.md`` for who computes and who reduces.

    mlp = glm_ep.load(model_dir, topology="h200-2")   # under mpiexec; see glm_ep.api
    y = mlp.site(3, x)                                 # x: bf16 [rows, hidden], NumPy/CuPy/torch
    h = mlp.step(x)
"""

__version__ = "0.1.0"

from glm_ep.api import GlmMlp, load  # noqa: E402 - after __version__, which setup.cfg reads
from glm_ep.errors import CheckpointError, ConfigError, GlmEpError, InputError  # noqa: E402
from glm_ep.dist.ranks import AgreedError  # noqa: E402
from glm_ep.config.topology import Topology  # noqa: E402

__all__ = ["AgreedError", "CheckpointError", "ConfigError", "GlmEpError", "GlmMlp", "InputError", "Topology", "load"]

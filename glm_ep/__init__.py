"""glm_ep: the MLP sites of GLM-5.3-Flash (HF ``glm5_next``) across MPI ranks.

Routed NVFP4 experts are sharded by expert-parallel rank, the dense FFN and the shared
expert by tensor-parallel rank, and one all-reduce per site sums the partials after the
combine. See ``docs/PLACEMENT.md`` for who computes and who reduces.
"""

__version__ = "0.1.0"

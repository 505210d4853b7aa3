"""The CUDA backend: ``CudaBackend`` and the kernel wrappers it launches through one cached loader.

| module        | what it holds                                                                |
|---------------|------------------------------------------------------------------------------|
| `backend`     | `CudaBackend`: every op of `Backend` on one stream, the path chosen by rows  |
| `loader`      | the `-D` constants, the one cached NVRTC loader, launch and argument checks  |
| `dense`       | bf16 projections: batch-M GEMV (1..8 rows), tensor-core GEMM (9..64), cuBLAS |
| `elementwise` | clamped SwiGLU, residual add, bf16 upcast, the routed + shared combine       |
| `route`       | router top-k, the union table of a row group, the sort by expert             |
| `nvfp4`       | the NVFP4 routed-expert GEMVs: pointer tables, decode ring, union sweeps     |
| `ring`        | `RingConfig`: the decode ring's frozen levers, its geometry, the fp16 check  |
| `grouped`     | the grouped NVFP4 prefill GEMM over expert-sorted rows, its tile variants    |
| `nccl`        | the NCCL all-reduce for ranks that each own a GPU                            |
| `pdl`         | programmatic dependent launch: `cuLaunchKernelEx` with the overlap attribute |

The kernel sources stay in ``glm_ep/kernels/*.cu``. Nothing here imports CuPy at import time.
"""

from glm_ep.backend.cuda.backend import CudaBackend
from glm_ep.backend.cuda.ring import RingConfig

__all__ = ["CudaBackend", "RingConfig"]

"""The CUDA backend: ``CudaBackend``, the kernel wrappers it launches through one cached loader, and the
kernel sources beside them (``kernels/*.cu``). Nothing here imports CuPy at import time.

| module          | what it holds                                                                |
|-----------------|------------------------------------------------------------------------------|
| `cuda_backend`  | `CudaBackend`: every op of `Backend` on one stream, the path chosen by rows  |
| `kernel_loader` | the `-D` constants, the one cached NVRTC loader, launch and argument checks  |
| `dense`         | bf16 projections: batch-M GEMV (1..8), warp-streaming GEMM (5..16), cuBLAS   |
| `elementwise`   | clamped SwiGLU, residual add, bf16 upcast, the routed + shared combine       |
| `route_kernels` | router top-k, the union table of a row group, the sort by expert             |
| `routed`        | the NVFP4 routed-expert GEMVs: pointer tables, decode ring, union sweeps     |
| `ring`          | `RingConfig`: the decode ring's frozen levers, its geometry, the fp16 check  |
| `grouped`       | the grouped NVFP4 prefill GEMM over expert-sorted rows, its tile variants    |
| `pdl`           | programmatic dependent launch: `cuLaunchKernelEx` with the overlap attribute |
| `scratch`       | the kernels' counters and partial sums, declared for the workspace to make   |

The NCCL all-reduce is ``glm_ep.dist.nccl``.
"""

from glm_ep.backend.cuda.cuda_backend import CudaBackend
from glm_ep.backend.cuda.ring import RingConfig

__all__ = ["CudaBackend", "RingConfig"]

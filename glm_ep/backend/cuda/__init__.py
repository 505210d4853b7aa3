"""The CUDA backend: ``CudaBackend`` and the kernel wrappers it launches through one cached loader.

| module      | what it holds                                                                  |
|-------------|--------------------------------------------------------------------------------|
| `backend`   | `CudaBackend`: every op of `Backend` on one stream, the path chosen by rows      |
| `loader`    | the `-D` constants, the one cached NVRTC loader, launch and argument checks     |
| `nvfp4`     | the NVFP4 routed-expert kernels: pointer tables, decode ring, grouped GEMM      |
| `nccl`      | the NCCL all-reduce for ranks that each own a GPU                               |

The kernel sources stay in ``glm_ep/kernels/*.cu``. Nothing here imports CuPy at import time.
"""

from glm_ep.backend.cuda.backend import CudaBackend

__all__ = ["CudaBackend"]

"""NCCL all-reduce for CUDA ranks that each own a GPU.

Bootstrapped over MPI: rank 0's NCCL unique id is broadcast with mpi4py, then every rank joins
the communicator. The bf16 sum runs in place on the backend's compute stream, so it orders after
the site's kernels with no host sync and can be recorded into the step's CUDA graph.

The host never waits inside ``all_reduce``; it waits at the next device sync, which the jobs run
under the collective deadline. When that deadline passes, ``abort`` (registered with it) aborts
the communicator, so kernels spinning on a stopped peer return before the MPI job is aborted.
"""

from __future__ import annotations

import os
from typing import Any

from glm_ep.dist.comm import Communicator
from glm_ep.dist.deadline import Deadline, guarded


class NcclComm(Communicator):
    capturable = True

    def __init__(self, mpi_comm: Any, backend: Any, deadline: Deadline | None = None):
        # NVLink multicast (NVLS) stays off: it can take a shared host's GPUs out of service
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        from cupy.cuda import nccl

        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        with guarded(deadline, "NCCL unique id broadcast"):
            uid = mpi_comm.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        with backend.device, guarded(deadline, "NCCL communicator init"):
            self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        if deadline:
            deadline.on_expiry(self.abort)
        self.stream = backend.stream
        self._bf16, self._sum = nccl.NCCL_BFLOAT16, nccl.NCCL_SUM

    def all_reduce(self, buf: Any, site: str = "all-reduce") -> Any:
        if str(buf.dtype) != "bfloat16" or not buf.flags.c_contiguous:
            raise ValueError(f"{site}: expected a contiguous bfloat16 buffer, got {buf.dtype} "
                             f"with strides {buf.strides}")
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._bf16, self._sum, self.stream.ptr)
        return buf

    def abort(self) -> None:
        """``ncclCommAbort``: pending NCCL kernels return and the communicator is freed."""
        self.comm.abort()

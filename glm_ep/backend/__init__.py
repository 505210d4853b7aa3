"""Backend and communicator construction: chosen once, at start-up, from the topology."""

from __future__ import annotations

from typing import Any

from glm_ep.backend.base import Backend
from glm_ep.comm import Communicator, MpiComm, SelfComm
from glm_ep.errors import ConfigError
from glm_ep.topology import Topology


def make_backend(topo: Topology, rank: int) -> Backend:
    if topo.backend == "cpu":
        from glm_ep.backend.numpy_backend import NumpyBackend

        return NumpyBackend()
    try:
        import cupy
    except ImportError as e:
        raise ConfigError(f"backend 'cuda' needs CuPy (pip install glm_ep[cuda12] or [cuda13]): {e}") from None
    try:
        visible = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device
        raise ConfigError(f"backend 'cuda': no usable CUDA device ({e})") from None
    from glm_ep.backend.cuda_backend import CudaBackend

    return CudaBackend(topo.device_of(rank, visible))


def make_comm(mpi_comm: Any, be: Backend, topo: Topology) -> Communicator:
    """NCCL for CUDA ranks on distinct GPUs (unless the topology says ``mpi``); MPI otherwise
    (host-staged for device arrays: NCCL refuses two ranks on one GPU)."""
    if mpi_comm.Get_size() == 1:
        return SelfComm()
    if be.name == "cpu":
        if topo.comm == "nccl":
            raise ConfigError("topology asks for comm = 'nccl' with backend 'cpu'; expected 'mpi' or 'auto'")
        return MpiComm(mpi_comm)
    devices = mpi_comm.allgather(be.device_key())
    distinct = len(set(devices)) == len(devices)
    if topo.comm == "nccl" and not distinct:
        raise ConfigError(f"topology asks for comm = 'nccl' but ranks share GPUs ({devices}); NCCL refuses "
                          "two ranks on one GPU: use comm = 'mpi' or 'auto'")
    if topo.comm != "mpi" and distinct:
        from glm_ep.backend.nccl import NcclComm

        return NcclComm(mpi_comm, be)
    return MpiComm(mpi_comm, to_host=be.to_host, from_host=be.copy_from_host)

"""Backends (NumPy reference, CUDA) and the communicator that goes with each."""

from __future__ import annotations

from typing import Any

from glm_ep.comm import Communicator, MpiComm
from glm_ep.deadline import Deadline, guarded
from glm_ep.errors import ConfigError


def make_backend(topology: Any, rank: int) -> Any:
    """The topology's backend for this rank: NumPy, or CUDA on ``topology.device_of(rank)``."""
    if topology.backend == "cpu":
        from glm_ep.backend.numpy_backend import NumpyBackend

        return NumpyBackend()
    try:
        import cupy

        visible = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # not installed, no driver, no device
        raise ConfigError(f"topology {topology.name!r} asks for backend = 'cuda', but CUDA is unusable here "
                          f"({type(e).__name__}: {e}); install cupy-cuda13x or use backend = 'cpu'") from None
    device = topology.device_of(rank, visible)
    if not 0 <= device < visible:
        raise ConfigError(f"rank {rank}: topology {topology.name!r} maps it to CUDA device {device}, but "
                          f"{visible} device(s) are visible")
    from glm_ep.backend.cuda_backend import CudaBackend

    return CudaBackend(device)


def make_comm(mpi_comm: Any, backend: Any, topology: Any, deadline: Deadline | None = None) -> Communicator:
    """The site all-reduce for this rank, decided identically on every rank.

    CPU ranks sum over MPI. CUDA ranks use NCCL when every rank has a GPU of its own (NCCL refuses
    two ranks on one device) and the topology does not ask for ``comm = "mpi"``; otherwise MPI
    with the buffers staged through the host. Waits on the other ranks are bounded by ``deadline``.
    """
    if backend.name == "cpu":
        return MpiComm(mpi_comm, deadline=deadline)
    with guarded(deadline, "GPU placement exchange"):
        bus_ids = mpi_comm.allgather(backend.pci_bus_id)
    own_gpus = len(set(bus_ids)) == len(bus_ids)
    if topology.comm == "nccl" and not own_gpus:
        raise ConfigError(f"topology {topology.name!r} asks for comm = 'nccl', but ranks share GPUs "
                          f"(PCI bus ids by rank: {bus_ids}); NCCL needs one GPU per rank, use comm = 'mpi'")
    if own_gpus and topology.comm != "mpi":
        from glm_ep.backend.nccl import NcclComm

        return NcclComm(mpi_comm, backend, deadline)
    return MpiComm(mpi_comm, to_host=backend.to_host, from_host=backend.from_host, deadline=deadline)

"""Where each rank runs: its node, its rank on that node, its GPU, and which all-reduce fits.

A node is one shared-memory domain (``MPI.COMM_TYPE_SHARED``), numbered by the lowest world rank
on it. Identical nodes report identical PCI bus ids (and may share a host name), so a GPU is told
apart by (node, bus id), never by its bus id alone. A rank's CUDA device is its node-local rank
unless the topology maps ranks to devices explicitly.

    mpirun -n 2 --host node0,node1 glm-ep run --topology gb10-2   # node-local rank 0 on each
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from glm_ep.errors import ConfigError
from glm_ep.dist.mpi_lib import import_mpi


@dataclass(frozen=True)
class Placement:
    rank: int  # world rank
    world: int
    node: int  # this rank's node: 0 .. nodes-1, in the order of each node's lowest world rank
    local_rank: int  # rank among the ranks of this node
    local_size: int
    host: str  # the node's processor name (for messages; ``node`` is the identity)


class NodeGpu(NamedTuple):
    """One rank's GPU as the ranks see it: the same ``bus_id`` on another node is another GPU."""

    node: int
    host: str
    bus_id: str


def discover(mpi_comm: Any, node_comm: Any | None = None) -> Placement:
    """This rank's placement. Collective over ``mpi_comm``: every rank calls it at the same point.

    ``node_comm`` stands in for the shared-memory split (a test splits one host into fake nodes).
    """
    MPI = import_mpi()
    rank = mpi_comm.Get_rank()
    split = node_comm is None
    if split:
        node_comm = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
        lowest = node_comm.allreduce(rank, op=MPI.MIN)
    finally:
        if split:
            node_comm.Free()
    lowest_by_rank = mpi_comm.allgather(lowest)
    node = sorted(set(lowest_by_rank)).index(lowest)
    return Placement(rank, mpi_comm.Get_size(), node, local_rank, local_size, MPI.Get_processor_name())


def device_index(devices: Sequence[int], placement: Placement, visible: int) -> int:
    """The rank's CUDA device: ``devices[world rank]`` where the topology lists them, else its
    node-local rank (modulo the visible devices: more ranks than GPUs on a node share them)."""
    if devices:
        device = devices[placement.rank]
    else:
        device = placement.local_rank % max(visible, 1)
    if not 0 <= device < visible:
        raise ConfigError(f"rank {placement.rank} (rank {placement.local_rank} of {placement.local_size} on "
                          f"{placement.host}) is mapped to CUDA device {device}, but {visible} device(s) are "
                          "visible there; fix the topology's devices list or CUDA_VISIBLE_DEVICES")
    return device


def shared_gpus(gpus: Sequence[NodeGpu]) -> dict[NodeGpu, list[int]]:
    """Each GPU that more than one rank runs on -> those ranks (ascending)."""
    ranks_of: dict[tuple[int, str], list[int]] = defaultdict(list)
    for rank, gpu in enumerate(gpus):
        ranks_of[(gpu.node, gpu.bus_id)].append(rank)
    return {gpus[ranks[0]]: ranks for ranks in ranks_of.values() if len(ranks) > 1}


def choose_comm(requested: str, gpus: Sequence[NodeGpu], topology: str) -> str:
    """``"nccl"`` or ``"mpi"`` for CUDA ranks, from every rank's GPU (the same on every rank).

    NCCL needs one GPU per rank; ``auto`` takes it whenever that holds, ``mpi`` never does, and
    ``nccl`` where ranks share a GPU is refused, naming them.
    """
    shared = shared_gpus(gpus)
    if requested == "nccl" and shared:
        where = "; ".join(f"ranks {', '.join(map(str, ranks))} on {gpu.host} GPU {gpu.bus_id}"
                          for gpu, ranks in shared.items())
        raise ConfigError(f"topology {topology!r} asks for comm = 'nccl', but ranks share a GPU ({where}); "
                          "NCCL needs one GPU per rank: use comm = 'mpi' or give each rank its own GPU")
    return "nccl" if requested != "mpi" and not shared else "mpi"

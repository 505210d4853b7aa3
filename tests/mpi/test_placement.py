"""Node-aware placement: node-local ranks, devices, and the NCCL-or-MPI decision.

The decision is tested on fake hosts (two identical GB10 nodes report the same PCI bus id); the
discovery runs under ``mpiexec -n 2`` on this one host, and on two fake nodes made by splitting it:

    mpiexec -n 2 python -m pytest --with-mpi -m mpi tests/mpi/test_placement.py
"""

from __future__ import annotations

import pytest

from glm_ep.backend import make_comm
from glm_ep.dist.comm import MpiComm
from glm_ep.errors import ConfigError
from glm_ep.dist.placement import NodeGpu, Placement, choose_comm, device_index, discover, shared_gpus
from glm_ep.config.topology import Topology

from helpers import agreed

BUS = "0000:0F:01.0"  # what both GB10 nodes report for their one GPU
TWO_GB10 = [NodeGpu(0, "spark-a", BUS), NodeGpu(1, "spark-b", BUS)]
ONE_GPU_TWO_RANKS = [NodeGpu(0, "h200", BUS), NodeGpu(0, "h200", BUS)]
ONE_HOST_TWO_GPUS = [NodeGpu(0, "h200", "0000:18:00.0"), NodeGpu(0, "h200", "0000:2A:00.0")]


@pytest.mark.parametrize("requested", ["auto", "nccl"])
def test_identical_nodes_with_the_same_bus_id_get_nccl(requested: str) -> None:
    assert shared_gpus(TWO_GB10) == {}
    assert choose_comm(requested, TWO_GB10, "gb10-2") == "nccl"


def test_the_node_not_the_host_name_tells_gpus_apart() -> None:
    cloned = [NodeGpu(0, "spark", BUS), NodeGpu(1, "spark", BUS)]  # cloned images, one host name
    assert choose_comm("auto", cloned, "gb10-2") == "nccl"


def test_ranks_on_one_gpu_fall_back_to_mpi_or_are_refused_nccl() -> None:
    assert shared_gpus(ONE_GPU_TWO_RANKS) == {ONE_GPU_TWO_RANKS[0]: [0, 1]}
    assert choose_comm("auto", ONE_GPU_TWO_RANKS, "h200-1x2") == "mpi"
    with pytest.raises(ConfigError, match=r"'h200-1x2' asks for comm = 'nccl'.*ranks 0, 1 on h200 GPU "
                                          r"0000:0F:01.0.*use comm = 'mpi'"):
        choose_comm("nccl", ONE_GPU_TWO_RANKS, "h200-1x2")


def test_one_host_with_a_gpu_per_rank_and_an_explicit_mpi_request() -> None:
    assert choose_comm("auto", ONE_HOST_TWO_GPUS, "h200-2") == "nccl"
    assert choose_comm("mpi", ONE_HOST_TWO_GPUS, "h200-2") == "mpi"
    assert choose_comm("mpi", TWO_GB10, "gb10-2") == "mpi"


def test_four_ranks_on_two_nodes_name_every_shared_gpu() -> None:
    gpus = [NodeGpu(0, "a", BUS), NodeGpu(0, "a", BUS), NodeGpu(1, "b", BUS), NodeGpu(1, "b", "0000:10:00.0")]
    assert shared_gpus(gpus) == {gpus[0]: [0, 1]}
    with pytest.raises(ConfigError, match=r"ranks 0, 1 on a GPU 0000:0F:01.0\)"):
        choose_comm("nccl", gpus, "t")


def _at(rank: int, local_rank: int, node: int = 0) -> Placement:
    return Placement(rank=rank, world=4, node=node, local_rank=local_rank, local_size=2, host=f"node{node}")


def test_device_is_the_node_local_rank_unless_listed() -> None:
    # ranks 2, 3 are the second node's ranks 0, 1: devices 0, 1 there, not 2, 3
    assert [device_index((), _at(r, r % 2, r // 2), visible=2) for r in range(4)] == [0, 1, 0, 1]
    assert device_index((), _at(3, 1, 1), visible=1) == 0  # more ranks than GPUs: they share
    assert device_index((1, 0, 1, 0), _at(2, 0, 1), visible=2) == 1  # an explicit list is by world rank
    with pytest.raises(ConfigError, match=r"rank 3 \(rank 1 of 2 on node1\) is mapped to CUDA device 5, "
                                          r"but 2 device\(s\) are visible"):
        device_index((0, 0, 0, 5), _at(3, 1, 1), visible=2)
    # the first device past the visible ones (CUDA devices count from 0): refused, not taken as the last one
    with pytest.raises(ConfigError, match=r"rank 1 \(rank 1 of 2 on node0\) is mapped to CUDA device 2, "
                                          r"but 2 device\(s\) are visible"):
        device_index((0, 2), _at(1, 1), visible=2)
    assert device_index((0, 1), _at(1, 1), visible=2) == 1  # the last visible device


class _FakeWorld:
    """The allgather of a two-rank job, as rank ``rank`` sees it."""

    def __init__(self, rank: int, gathered: list):
        self.rank, self.gathered = rank, gathered

    def allgather(self, mine):
        assert mine == self.gathered[self.rank]
        return self.gathered

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return len(self.gathered)


class _FakeCudaBackend:
    name = "cuda"
    pci_bus_id = BUS
    to_host = from_host = None


def test_make_comm_takes_nccl_for_gb10_2_and_mpi_for_two_ranks_on_one_gpu(monkeypatch) -> None:
    import glm_ep.dist.nccl as nccl

    made = []
    monkeypatch.setattr(nccl, "NcclComm", lambda mpi_comm, backend, deadline=None: made.append(mpi_comm) or "nccl-comm")
    gb10 = Topology.load("gb10-2")
    world = _FakeWorld(1, TWO_GB10)
    placement = Placement(rank=1, world=2, node=1, local_rank=0, local_size=1, host="spark-b")
    assert make_comm(world, _FakeCudaBackend(), gb10, placement) == "nccl-comm" and made == [world]
    shared = _FakeWorld(1, ONE_GPU_TWO_RANKS)
    one_host = Placement(rank=1, world=2, node=0, local_rank=1, local_size=2, host="h200")
    assert isinstance(make_comm(shared, _FakeCudaBackend(), Topology.load("h200-1x2"), one_host), MpiComm)
    with pytest.raises(ConfigError, match="ranks share a GPU"):
        make_comm(shared, _FakeCudaBackend(), gb10, one_host)


# ---- under mpiexec -n 2 ------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_discover_on_one_host_and_on_two_fake_nodes() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    failures: list[str] = []
    here = discover(comm)
    want = (rank, size, 0, rank, size, MPI.Get_processor_name())
    got = (here.rank, here.world, here.node, here.local_rank, here.local_size, here.host)
    if got != want:
        failures.append(f"one host: placement {got}, expected {want}")
    apart = comm.Split(color=rank, key=0)  # each rank its own node, as on two GB10s
    try:
        fake = discover(comm, node_comm=apart)
    finally:
        apart.Free()
    if (fake.node, fake.local_rank, fake.local_size) != (rank, 0, 1):
        failures.append(f"fake nodes: node {fake.node}, local {fake.local_rank}/{fake.local_size}, "
                        f"expected {rank}, 0/1")
    gpus = [NodeGpu(n, h, BUS) for n, h in comm.allgather((fake.node, fake.host))]
    if choose_comm("auto", gpus, "gb10-2") != "nccl":
        failures.append(f"fake nodes with one bus id {gpus}: expected NCCL")
    if device_index((), fake, visible=1) != 0:
        failures.append("fake nodes: each rank should take its node's GPU 0")
    same = [NodeGpu(n, h, BUS) for n, h in comm.allgather((here.node, here.host))]
    if choose_comm("auto", same, "h200-1x2") != "mpi":
        failures.append(f"one host, one bus id {same}: expected MPI")
    agreed(comm, failures)

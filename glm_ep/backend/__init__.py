"""Backends (NumPy reference, CUDA) and the communicator that goes with each."""

from __future__ import annotations

import logging
from typing import Any

from glm_ep.backend.base import Backend
from glm_ep.dist.comm import Communicator, MpiComm
from glm_ep.config.model import SiteConfig
from glm_ep.dist.deadline import Deadline, guarded
from glm_ep.errors import ConfigError
from glm_ep.dist.placement import NodeGpu, Placement, choose_comm, device_index

log = logging.getLogger(__name__)


def make_backend(topology: Any, placement: Placement, cfg: SiteConfig) -> Backend:
    """The topology's backend for this rank: NumPy, or CUDA on the rank's device (its node-local
    rank unless the topology lists devices; ``glm_ep.dist.placement.device_index``). Refused with a
    ConfigError, before any device is touched, where a lever or the model's top-k is past the
    backend's ``Capabilities``, or (CUDA) where the ring levers ask for a kernel that is not built
    or an fp16 form the site's ``swiglu_limit`` does not bound; and (CUDA, once the device is chosen)
    where a ring block, or the sort by expert of wide calls, would need more shared memory than the device
    gives one."""
    if topology.backend == "cpu":
        from glm_ep.backend.numpy_backend import NumpyBackend

        NumpyBackend.capabilities.check("cpu", topology.levers, cfg.top_k)
        return NumpyBackend()
    from glm_ep.backend.cuda import CudaBackend

    ring = cuda_ring(topology.levers, cfg)
    try:
        import cupy

        visible = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # not installed, no driver, no device
        raise ConfigError(f"topology {topology.name!r} asks for backend = 'cuda', but CUDA is unusable on "
                          f"{placement.host} ({type(e).__name__}: {e}); install the cuda13 or cuda12 extra (pip "
                          "install '.[cuda13]' from the checkout) or use backend = 'cpu'") from None
    be = CudaBackend(device_index(topology.devices, placement, visible), ring, dependent_launch=topology.levers.pdl)
    check_cuda_device(ring, topology.levers, cfg, topology.workspace_rows)
    return be


def cuda_ring(levers: Any, cfg: SiteConfig) -> Any:
    """The CUDA backend's ``RingConfig`` for ``levers``, after the refusals made on the host before any device is
    touched: a lever or the model's top-k past the backend's ``Capabilities``, an expert slice the kernels cannot
    take, a ring kernel that is not built or an fp16 form the site's ``swiglu_limit`` does not bound."""
    from glm_ep.backend.cuda import CudaBackend, RingConfig

    CudaBackend.capabilities.check("cuda", levers, cfg.top_k)
    _check_expert_slice(cfg)
    ring = RingConfig.from_levers(levers)
    ring.forms(cfg.swiglu_limit)  # the check the upload repeats, here on every rank before any weight is read
    return ring


def check_cuda_device(ring: Any, levers: Any, cfg: SiteConfig, rows: int) -> None:
    """Once the device is current: a ConfigError where a ring block, or the sort by expert of calls up to ``rows``
    rows, would need more shared memory than the device gives one block."""
    from glm_ep.backend.cuda.kernel_loader import block_smem_limit

    ring.check_fits(block_smem_limit())  # the device's own limit
    if levers.prefill_gemm and not levers.host_dispatch and rows >= levers.prefill_gemm_min_rows:
        # the routed experts' sorted path can run (a dense FFN stored NVFP4 sorts one expert: it always fits)
        from glm_ep.backend.cuda import route_kernels as route
        from glm_ep.backend.cuda.kernel_loader import compute_capability, current_device

        route.check_sort_fits(cfg.num_experts, block_smem_limit(), "sm_%d%d" % compute_capability(current_device()))


def _check_expert_slice(cfg: SiteConfig) -> None:
    """A ConfigError where ``moe_tp`` leaves each rank a slice of an expert's width the CUDA kernels cannot take."""
    from glm_ep.backend.cuda.grouped import EXPERT_WIDTH_MULTIPLE

    if cfg.moe_tp > 1 and cfg.moe_intermediate % EXPERT_WIDTH_MULTIPLE:
        raise ConfigError(f"moe_tp = {cfg.moe_tp}: each rank's slice of a routed expert is {cfg.moe_intermediate} wide "
                          f"(moe_intermediate_size / moe_tp), and the CUDA kernels take expert widths in multiples of "
                          f"{EXPERT_WIDTH_MULTIPLE} (the grouped GEMM's stage of k); expected a moe_tp that leaves "
                          f"one, or backend = 'cpu'")


def make_comm(mpi_comm: Any, backend: Backend, topology: Any, placement: Placement,
              deadline: Deadline | None = None) -> Communicator:
    """The site all-reduce for this rank, decided identically on every rank.

    CPU ranks sum over MPI. CUDA ranks use NCCL when every rank has a GPU of its own, told apart
    by (node, PCI bus id), and the topology does not ask for ``comm = "mpi"``; otherwise MPI with
    the buffers staged through the host (``glm_ep.dist.placement.choose_comm``). Waits on the other
    ranks are bounded by ``deadline``.
    """
    if backend.name == "cpu":
        if placement.rank == 0:
            log.info("all-reduce: MPI over %d rank(s)", placement.world)
        return MpiComm(mpi_comm, deadline=deadline)
    with guarded(deadline, "GPU placement exchange"):
        gpus = mpi_comm.allgather(NodeGpu(placement.node, placement.host, backend.pci_bus_id))
    kind = choose_comm(topology.comm, gpus, topology.name)
    if placement.rank == 0:
        log.info("all-reduce: %s over %d rank(s) on %d node(s)", kind.upper(), len(gpus),
                 len({g.node for g in gpus}))
    if kind == "nccl":
        from glm_ep.dist.nccl import NcclComm

        return NcclComm(mpi_comm, backend, deadline)
    return MpiComm(mpi_comm, to_host=backend.to_host, from_host=backend.from_host, deadline=deadline,
                   host_buffer=getattr(backend, "pinned", None))

"""Communicators: the ONE all-reduce a site ends with.

Every communicator sums bf16 buffers in place with NCCL's bf16 semantics: the partials are added
in rank order and each addition is rounded to bf16, so every rank ends with identical bytes.
``MpiComm`` serves the NumPy backend (and CUDA ranks that share one GPU, host-staged);
``glm_ep.dist.nccl.NcclComm`` serves CUDA ranks on their own GPUs. ``at(site)`` names the
all-reduces of one site, so a wait that outlives the collective deadline says where it hung.

``MpiComm`` first exchanges what each rank is about to sum (rows, elements, the site's name as a
CRC-32: 24 bytes a rank): ranks whose calls differ there (a library caller that gave the ranks
different row counts, or another layer) get the same ``AgreedError`` on every rank, where MPI would
truncate a message (a fatal error on one rank after another returned a wrong sum) or add partials
of different sites silently.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from typing import Any

import ml_dtypes
import numpy as np

from glm_ep.dist.deadline import Deadline, guarded
from glm_ep.dist.ranks import AgreedError


class Communicator(ABC):
    rank: int
    size: int
    #: whether ``all_reduce`` can be recorded into a CUDA graph (no host staging)
    capturable: bool = False

    @abstractmethod
    def all_reduce(self, buf: Any, site: str = "all-reduce") -> Any:
        """Sum ``buf`` (bf16, contiguous) over all ranks, in place; returns ``buf``. ``site`` names
        the call in a deadline message."""

    def at(self, site: str) -> "Communicator":
        """This communicator with its all-reduces named ``site`` (e.g. ``"layer 3 all-reduce"``)."""
        return SiteComm(self, site)


class SiteComm(Communicator):
    """One site's view of a communicator: the same sums, named for the deadline message."""

    def __init__(self, comm: Communicator, site: str):
        self.comm, self.site = comm, site
        self.rank, self.size, self.capturable = comm.rank, comm.size, comm.capturable

    def all_reduce(self, buf: Any, site: str | None = None) -> Any:
        return self.comm.all_reduce(buf, site or self.site)


class SelfComm(Communicator):
    """One rank: the sum is the buffer itself."""

    rank, size, capturable = 0, 1, True

    def all_reduce(self, buf: Any, site: str = "all-reduce") -> Any:
        return buf


def bf16_sum_in_rank_order(parts_PN: np.ndarray) -> np.ndarray:
    """``[P, N]`` bf16 partials -> ``[N]``: ``((p0 + p1) + p2) ...``, each add rounded to bf16."""
    acc = parts_PN[0].astype(np.float32)
    for p in parts_PN[1:]:
        acc = (acc + p.astype(np.float32)).astype(ml_dtypes.bfloat16).astype(np.float32)
    return acc.astype(ml_dtypes.bfloat16)


class MpiComm(Communicator):
    """All-reduce over MPI: an allgather of the raw bf16 bits, then the rank-order bf16 sum.

    MPI has no bf16 type, so the bits travel as uint16 and the sum is done here, identically on
    every rank. Device arrays (``to_host`` / ``from_host`` given) are staged through host buffers
    that live as long as the communicator, from ``host_buffer(shape, dtype)`` (the CUDA backend's
    page-locked memory: no allocation per call, and the device copies run at full speed). With a
    ``deadline``, the wait for the other ranks' partials is bounded by it.
    """

    def __init__(self, mpi_comm: Any, to_host=None, from_host=None, deadline: Deadline | None = None,
                 host_buffer=None):
        self.comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self._to_host = to_host
        self._from_host = from_host
        self._deadline = deadline
        self._host_buffer = host_buffer or (lambda shape, dtype: np.empty(shape, dtype))
        self._staging: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # send, gathered, sum

    def _staged(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The staging buffers' first n elements (grown, never shrunk): send [n], gathered [size, n]
        and sum [n], uint16 and contiguous."""
        if self._staging is None or self._staging[0].size < n:
            self._staging = (self._host_buffer((n,), np.uint16), self._host_buffer((self.size * n,), np.uint16),
                             self._host_buffer((n,), np.uint16))
        send, gathered, total = self._staging
        return send[:n], gathered[:self.size * n].reshape(self.size, n), total[:n]

    def _same_call(self, buf: Any, site: str) -> None:
        """Every rank is about to sum a buffer of the same shape at the same site, or every rank raises the same
        AgreedError naming each rank's (a second, rarer exchange gathers the site names for the message)."""
        mine = np.array([buf.shape[0] if buf.ndim else 1, buf.size, zlib.crc32(site.encode())], dtype=np.uint64)
        every = np.empty((self.size, mine.size), dtype=np.uint64)
        with guarded(self._deadline, site):
            self.comm.Allgather(mine, every)
        if (every == mine).all():
            return
        with guarded(self._deadline, site):
            sites = self.comm.allgather(site)
        calls = "\n".join(f"  rank {r}: '{name}' with {int(rows)} rows ({int(n)} values)"
                          for r, (name, (rows, n, _)) in enumerate(zip(sites, every)))
        raise AgreedError(f"the ranks reached an all-reduce with different calls:\n{calls}\nexpected every rank to "
                          "make the same call (the same layer, the same input rows) in the same order: every site and "
                          "step call is collective, each rank adds its share of one sum. Where a call raised on some "
                          "ranks only (an input error a caller caught), those ranks are a call ahead of the others "
                          "from then on, each later call meeting another's (refused where the two differ, summed "
                          "wrongly where they match): end the job (check_calls = true agrees each call's input on "
                          "every rank before any rank starts it, so such an error is raised on all of them)")

    def all_reduce(self, buf: Any, site: str = "all-reduce") -> Any:
        if self.size == 1:
            return buf
        self._same_call(buf, site)
        if self._to_host is None:  # host arrays: sent as they are
            bits = np.ascontiguousarray(buf).view(np.uint16).reshape(-1)
            gathered = np.empty((self.size, bits.size), dtype=np.uint16)
        else:
            bits, gathered, total = self._staged(buf.size)
            self._to_host(buf, out=bits.view(ml_dtypes.bfloat16).reshape(buf.shape))
        with guarded(self._deadline, site):
            self.comm.Allgather(bits, gathered)
        summed = bf16_sum_in_rank_order(gathered.view(ml_dtypes.bfloat16))
        if self._to_host is None:
            buf[...] = summed.reshape(buf.shape)
        else:
            total.view(ml_dtypes.bfloat16)[...] = summed
            self._from_host(buf, total.view(ml_dtypes.bfloat16).reshape(buf.shape))
        return buf

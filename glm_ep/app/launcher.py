"""What the launcher (mpiexec, srun) says of this process before MPI is initialised: its rank and the rank count,
from the environment; and the refusal of a command that writes from one process under a launcher of several."""

from __future__ import annotations

import os

from glm_ep.errors import InputError

#: where a launcher puts a process's (rank, rank count) before MPI is initialised: Open MPI, MPICH/Hydra and Intel
#: MPI, PMIx, MVAPICH2; PMIx launchers (srun --mpi=pmix) give a rank but no count
_LAUNCH_VARS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"), ("PMIX_RANK", None),
                ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"))


def _launch_value(which: int, default: int) -> int:
    """The first of the launchers' variables ``which`` (0: rank, 1: rank count) that is set, as an integer;
    ``default`` outside mpiexec or where the value is not one."""
    for names in _LAUNCH_VARS:
        value = os.environ.get(names[which], "").strip() if names[which] else ""
        if value:
            try:
                return int(value)
            except ValueError:
                return default
    return default


def launch_size() -> int | None:
    """The ranks the launcher started (its environment, before MPI is initialised); 1 outside mpiexec; None where
    a launcher gives a rank but no count (PMIx): then only MPI can tell."""
    if any(size_var and os.environ.get(size_var, "").strip() for _, size_var in _LAUNCH_VARS):
        return _launch_value(1, 1)
    return None if any(os.environ.get(rank_var, "").strip() for rank_var, _ in _LAUNCH_VARS) else 1


def launch_rank() -> int:
    """This process's rank as the launcher's environment says it, before MPI is initialised; 0 outside mpiexec
    (or where the value is not an integer)."""
    return _launch_value(0, 0)


def one_process(what: str) -> None:
    """An InputError where the launcher started more than one rank: ``what`` (e.g. "synth writes one checkpoint")
    from every rank would write the same files at once (PMIx: rank 0 cannot tell, the others refuse)."""
    if (launch_size() or launch_rank() + 1) > 1:
        raise InputError(f"{what} from one process; expected it run without mpiexec (or with -n 1)")

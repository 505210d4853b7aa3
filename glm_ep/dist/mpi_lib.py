"""Loading MPI: mpi4py's ``MPI`` module, or one clear error where no MPI library is installed.

mpi4py's wheels carry no MPI of their own; they load ``libmpi`` at import time. Without one the
import fails with a list of paths it tried. ``import_mpi`` turns that into an error that says
what to install: the ``mpi`` extra (MPICH from PyPI, with its ``mpiexec`` in the environment's
``bin``) or the system's MPI.
"""

from __future__ import annotations

from typing import Any

from glm_ep.errors import GlmEpError

INSTALL_HINT = ("install one: pip install '.[mpi]' from the glm_ep checkout (MPICH from PyPI, with mpiexec in this "
                "environment's bin), or the system's MPI (e.g. apt install mpich, or libopenmpi-dev)")


class MpiUnavailable(GlmEpError):
    """No MPI library could be loaded."""


def import_mpi() -> Any:
    """``mpi4py.MPI``; raises ``MpiUnavailable`` naming what to install when no libmpi loads."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MpiUnavailable(f"no MPI library found (mpi4py: {first}); {INSTALL_HINT}") from None
    return MPI

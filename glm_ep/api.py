"""The library API: load a checkpoint across the ranks of a communicator, then call a site or a step.

    # mpiexec -n 2 python -m mpi4py engine.py   (-m mpi4py: a rank that raises aborts the job at once)
    import glm_ep

    mlp = glm_ep.load("/models/glm-5.3-flash-nvfp4", topology="h200-2")
    y = mlp.site(3, x)   # layer 3's MLP applied to x: bf16 [rows, hidden] -> a fresh bf16 array
    h = mlp.step(x)      # every layer chained, h = h + site(h)

Every call is collective: each rank of the communicator makes the same calls in the same order
with the same input, and each gets the same result (each rank adds its share of one sum). The MPI
all-reduce refuses ranks whose calls differ in rows or site (``glm_ep.dist.comm``); the rest is
checked per call only where the topology says ``check_calls = true`` (a debugging aid: the ranks
then agree each call's loaded model, layer and input, at two or three small collectives and one copy of the
input to the host per call, and refuse a mismatch by name). Inputs are NumPy or CuPy arrays or torch
tensors (``glm_ep.interop``); a result has the input's kind and device and shares no memory with
the runtime. Inputs wider than the workspace run in workspace-sized chunks (rows are independent).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Callable

import ml_dtypes

from glm_ep import interop
from glm_ep.app import load_record
from glm_ep.balance.expert_load import ExpertLoad, ExpertLoadRecorder
from glm_ep.config.model import ModelConfig
from glm_ep.errors import ConfigError
from glm_ep.mlp.runtime import Runtime, load_runtime, open_checkpoint
from glm_ep.dist.ranks import Ranks, mpi_world
from glm_ep.config.topology import Topology


class GlmMlp:
    """This rank's share of the MLP sites of a GLM-5.3-Flash checkpoint, loaded (``glm_ep.load``)."""

    def __init__(self, runtime: Runtime, ranks: Ranks, recorder: ExpertLoadRecorder | None = None):
        self._rt, self._ranks, self._recorder = runtime, ranks, recorder

    @property
    def config(self) -> ModelConfig:
        return self._rt.model

    @property
    def topology(self) -> Topology:
        return self._rt.topo

    @property
    def num_layers(self) -> int:
        return self._rt.model.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self._rt.model.hidden_size

    @property
    def max_rows(self) -> int:
        """Rows one pass of the workspace takes; wider inputs run in chunks of this many."""
        return self._rt.stack.max_rows

    @property
    def comm(self) -> Any:
        """The mpi4py communicator it was loaded across."""
        return self._ranks.comm

    @property
    def device(self) -> int | None:
        """The CUDA device this rank computes on (a torch model beside it belongs there); None on the NumPy backend."""
        return self._rt.be.device.id if self._rt.be.name == "cuda" else None

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds."""
        return self._rt.weight_bytes

    def expert_load(self) -> ExpertLoad:
        """Per sparse layer and expert, how many slots chose it since the load (``glm_ep.balance.expert_load``:
        ``.logical_count`` [sparse layers, experts], ``.save(path)``). Collective. Recorded only where loaded with
        ``expert_load=True`` (each sparse site's ids read to the host after it: no graphs)."""
        if self._recorder is None:
            raise ConfigError("expert_load(): nothing was recorded; expected a model loaded with "
                              "glm_ep.load(..., expert_load=True)")
        return self._recorder.gather(self._ranks)

    def site(self, i: int, x: Any) -> Any:
        """Layer ``i``'s MLP applied to ``x`` (bf16 ``[rows, hidden]``), not chained."""
        return self._apply(lambda: interop.layer_index(i, self.num_layers), x)

    def step(self, x: Any) -> Any:
        """Every layer's MLP, chained: ``h = h + site(h)`` from ``h = x``; returns the last ``h``."""
        return self._apply(None, x)

    def _checked(self, index: Callable[[], int] | None, x: Any) -> tuple[str, int | None]:
        """The input's kind (``interop.check_input``) and the layer a site call names (None: a step). With
        ``check_calls``, every rank makes the same call with an input of the same bits, or all refuse: a site and a
        step go through the same collectives, so ranks that make different calls are told so, by name."""
        def check() -> tuple[str, int | None]:
            layer = index() if index is not None else None
            return interop.check_input(x, self.hidden_size), layer

        if not self._rt.topo.check_calls:
            return check()
        kind, layer = self._ranks.agree("call check", check)
        digest = hashlib.sha256(interop.host_bits(x)).hexdigest()
        what = "step" if layer is None else f"site {layer}"
        self._ranks.check_same("call check", "calls", {"model": self._rt.identity, "call": what, "input": digest},
                               "every rank to make the same call with the same input on the same loaded model (each "
                               "adds its share of one sum)")
        return kind, layer

    def _apply(self, index: Callable[[], int] | None, x: Any) -> Any:
        kind, layer = self._checked(index, x)
        stack = self._rt.stack
        fn = stack.step if layer is None else (lambda x_TH: stack.site_output(layer, x_TH))
        be, rows, chunk = self._rt.be, x.shape[0], self.max_rows
        with interop.runtime_stream(be):
            x_TH = interop.to_backend(x, kind, be)
            out_TH = be.xp.empty((rows, self.hidden_size), dtype=ml_dtypes.bfloat16)
            for r in range(0, rows, chunk):
                be.copy(fn(x_TH[r:r + chunk]), out_TH[r:r + chunk])  # fn's result is a view of the stack's buffer
            return interop.from_backend(out_TH, x, kind, be)

    def __repr__(self) -> str:
        t = self.topology
        return (f"GlmMlp({self.num_layers} layers, hidden {self.hidden_size}; rank {self._rt.cfg.rank} of "
                f"{t.world}, {t.layout_text}, backend {t.backend})")


def _topology(spec: Topology | str | os.PathLike | None, world: int) -> Topology:
    if spec is None:
        return Topology(name="default", world=world, tp=world, ep=world)
    if isinstance(spec, Topology):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        return Topology.load(spec)
    raise ConfigError(f"topology = {spec!r}: expected None, a Topology, a shipped topology name "
                      "(e.g. 'h200-2') or the path of a TOML file")


def _model_path(model_dir: Any) -> None:
    if not isinstance(model_dir, (str, os.PathLike)):
        raise ConfigError(f"model_dir = {model_dir!r}: expected the checkpoint folder's path (a str or a Path)")


def load(model_dir: str | Path, topology: Topology | str | os.PathLike | None = None, comm: Any = None,
         expert_load: bool = False) -> GlmMlp:
    """Load ``model_dir`` (HF ``config.json`` + safetensors) across the ranks of ``comm``.

    ``topology``: a ``Topology``, a shipped name (``"gb10-2"``), a TOML path, or None for
    world = tp = ep = the communicator's size on the NumPy backend. ``comm``: an mpi4py
    communicator, ``MPI.COMM_WORLD`` by default. ``expert_load``: record the routers' choices
    (``GlmMlp.expert_load``). Collective; a bad checkpoint or topology raises the same
    ``glm_ep.GlmEpError`` on every rank.
    """
    if comm is not None and not all(hasattr(comm, a) for a in ("Get_rank", "Get_size", "allgather", "Abort")):
        raise ConfigError(f"comm = {comm!r}: expected an mpi4py communicator (e.g. MPI.COMM_WORLD) or None")
    ranks = Ranks(comm if comm is not None else mpi_world())
    ranks.agree("model path", lambda: _model_path(model_dir))  # a bad one on one rank: an error on every rank
    topo = ranks.agree("topology", lambda: _topology(topology, ranks.size))
    ranks.deadline.timeout_s = topo.collective_timeout_s  # waits on the other ranks bounded from here on
    ckpt = open_checkpoint(model_dir, topo, ranks)
    if ckpt.note and ranks.rank == 0:  # the folder holds both weight layouts: which one is read
        logging.getLogger(__name__).warning("%s", ckpt.note)
    rt = load_runtime(ckpt, topo, ranks)
    return GlmMlp(rt, ranks, load_record.start(rt, ranks) if expert_load else None)

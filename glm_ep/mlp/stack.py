"""MlpStack: every MLP site of the model on one rank, one workspace for the whole stack.

``site_output(i, x)`` applies site i alone (``glm-ep forward``, the library's ``site``); ``step(h)`` runs
the chained stack ``h = h + site(h)`` in place. A backend that can capture (CUDA) records the decode step
(rows = 1, all layers, all-reduces included) once as a graph and replays it; verify widths too
(up to the backend's ``max_gemv_rows``) when the ``graph_verify`` lever is on. With the ``graph_sites``
lever, ``site_output`` does the same per (site, rows): an engine that calls one site at a time between
its attention layers replays one graph per call instead of launching the site's kernels.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import ml_dtypes

from glm_ep.backend.base import Backend
from glm_ep.dist.comm import Communicator
from glm_ep.config.model import SiteConfig
from glm_ep.errors import InputError
from glm_ep.config.topology import PathLevers
from glm_ep.mlp.site import Nvfp4DenseSite, site_buffers
from glm_ep.mlp.workspace import Workspace, workspace_pool

log = logging.getLogger(__name__)


class MlpStack:
    def __init__(self, be: Backend, comm: Communicator, cfg: SiteConfig, sites: list[Any],
                 levers: PathLevers, max_rows: int, shared_workspace: bool = True,
                 workspaces: list[Workspace] | None = None):
        self.be, self.comm, self.cfg, self.sites, self.levers = be, comm, cfg, sites, levers
        self.max_rows = max(max_rows, 1)
        # ``workspaces``: allocated beforehand (the loader does it before reading any weight), else here, for what
        # the sites of ``cfg`` and the backend declare
        nvfp4_dense = any(isinstance(s, Nvfp4DenseSite) and s.mlp is not None for s in sites)
        self.workspaces = workspaces or workspace_pool(
            be, (*site_buffers(cfg, levers, nvfp4_dense), *be.buffers(cfg, levers)), self.max_rows, len(sites),
            shared_workspace)
        self._scratch = self.workspaces[0].stack if self.workspaces else {}
        # static buffers: the chained state and one site's output, so a graph can be replayed
        self.h_buf = be.xp.empty((self.max_rows, cfg.hidden), dtype=ml_dtypes.bfloat16)
        self.out_buf = be.xp.empty_like(self.h_buf)
        self._graphs: dict[int, Callable[[], None]] = {}
        self._site_graphs: dict[tuple[int, int], Callable[[], None]] = {}  # (site, rows) -> replay

    def _own_scratch(self) -> None:
        """Bind the backend to this stack's scratch again where another stack's workspaces were bound to it since
        (benches and tests build several stacks on one backend): what this stack runs, and any graph it captures,
        reads the buffers its own workspaces keep alive."""
        if self.be.bound is not self._scratch:
            self.be.bind(self._scratch)

    def _check_rows(self, x_TH: Any) -> int:
        t, h = x_TH.shape
        if h != self.cfg.hidden:
            raise InputError(f"input hidden size is {h}, expected hidden_size = {self.cfg.hidden}")
        if not 1 <= t <= self.max_rows:
            raise InputError(f"{t} rows do not fit the workspace built for 1..{self.max_rows} rows "
                             "(raise workspace_rows in the topology)")
        return t

    def site_output(self, i: int, x_TH: Any) -> Any:
        """Site i applied to ``x`` (not chained); the result is a view of the stack's out buffer. Where
        ``_capturable(t, [site])`` and the ``graph_sites`` lever is on, the call replays a graph captured on
        the first call of its (site, rows): the site reads ``h_buf`` and writes ``out_buf`` in place (its
        all-reduce too), so a replay computes the new input's output where the eager call would."""
        t = self._check_rows(x_TH)
        self._own_scratch()
        self.be.copy(x_TH, self.h_buf[:t])
        site, ws = self.sites[i], self.workspaces[i]

        def run() -> Any:
            return site(self.h_buf[:t], ws, self.out_buf[:t])

        if not (self.levers.graph_sites and self._capturable(t, [site])):
            return run()
        self._replay(self._site_graphs, (i, t), run)
        return self.out_buf[:t]

    def _replay(self, graphs: dict[Any, Callable[[], None]], key: Any, body: Callable[[], Any],
                restore: Callable[[], Any] | None = None, what: str | None = None) -> None:
        """Run ``body`` as the graph ``graphs[key]``, captured on the first call after one eager run (the warm-up
        outside the capture: path logs, lazy kernel loads, scratch sized) and ``restore`` (undoing what that run
        changed of the inputs); the capture of ``what`` is logged where it is named."""
        if key not in graphs:
            body()
            if restore is not None:
                restore()
            graphs[key] = self.be.capture(body)
            if what:
                log.info("captured %s as one graph", what)
        graphs[key]()

    def _eager_step(self, t: int) -> None:
        h_TH, out_TH = self.h_buf[:t], self.out_buf[:t]
        for site, ws in zip(self.sites, self.workspaces):
            site(h_TH, ws, out_TH)
            self.be.add(h_TH, out_TH, h_TH)

    def _capturable(self, t: int, sites: list[Any] | None = None) -> bool:
        """Whether a call of ``t`` rows over ``sites`` (default: all) may be a graph of its own: the levers want
        one for that width, the backend captures and is not inside a caller's capture already (then the ops
        are recorded into that one), and every all-reduce among them is capturable."""
        lv, caps = self.levers, self.be.capabilities
        wanted = (t == 1 and lv.graph_decode) or (2 <= t <= caps.max_gemv_rows and lv.graph_verify)
        return wanted and not lv.host_dispatch and caps.capture and not self.be.capturing() and (
            self.comm.capturable or not any(s.reduces for s in (self.sites if sites is None else sites)))

    def step(self, x_TH: Any) -> Any:
        """``h = h + site(h)`` through every layer; returns a view of the stack's state buffer."""
        t = self._check_rows(x_TH)
        self._own_scratch()
        self.be.copy(x_TH, self.h_buf[:t])
        if self._capturable(t):  # the step updates h in place: the warm-up's is reset to x
            self._replay(self._graphs, t, lambda: self._eager_step(t), lambda: self.be.copy(x_TH, self.h_buf[:t]),
                         f"the {t}-row step of {len(self.sites)} sites")
        else:
            self._eager_step(t)
        return self.h_buf[:t]

"""The MLP scratch: the buffers its users declare, made once at load, and the footprint report.

Whatever needs scratch declares it as ``Buffer``s (a name, a dtype, elements as a function of the rows one call
holds): the sites and the routed-expert dispatch their per-call buffers (``glm_ep.mlp.site.site_buffers``), the
backend its kernels' counters and partial sums (``Backend.buffers``). A name declared by several users (which run
one after another) is ONE buffer, as large as the largest declaration. Nothing else allocates scratch:

* per-site buffers, one set per workspace. One workspace serves the whole layer stack by default: every buffer
  is fully written before it is read inside one site call and one stream runs the stack, so a later layer never
  observes an earlier layer's bytes. ``shared = False`` gives each layer a private copy, so the saving can be
  measured. ``u_slot`` is QUADRATIC in rows: ``[rows * top_k, rows]``.
* stack buffers (``Buffer.stack`` names the report line), one set for the stack in either mode: scratch that
  holds nothing from one op to the next (a backend's counters and partial sums, dequantized weights). The pool
  hands the backend its own through ``Backend.bind``.

``allocate_workspaces`` checks the total against the free memory first, so an oversized ``workspace_rows`` is a
clear error.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from glm_ep.errors import ConfigError


@dataclass(frozen=True)
class Buffer:
    """One scratch buffer as its user declares it: ``elements(rows)`` of ``dtype`` for calls of up to ``rows``
    rows (0: not needed at that width). ``zeroed``: made zero (counters each launch leaves zero for the next).
    ``stack``: "" for a per-site buffer; else one for the stack, reported on the line of that label with ``note``
    in parentheses, and ``hint`` (what makes it unneeded) added to the error where the memory is short."""

    name: str
    dtype: np.dtype
    elements: Callable[[int], int]
    zeroed: bool = False
    stack: str = ""
    note: str = ""
    hint: str = ""

    def nbytes(self, rows: int) -> int:
        return self.elements(max(rows, 1)) * np.dtype(self.dtype).itemsize


def merged(buffers: Iterable[Buffer]) -> tuple[Buffer, ...]:
    """One buffer per name, in the order of first declaration, as large as its largest declaration; ValueError where
    two declarations of a name disagree on the dtype or on being a stack buffer."""
    by_name: dict[str, list[Buffer]] = {}
    for b in buffers:
        by_name.setdefault(b.name, []).append(b)
    out = []
    for name, group in by_name.items():
        first = group[0]
        for b in group[1:]:
            if np.dtype(b.dtype) != np.dtype(first.dtype) or bool(b.stack) != bool(first.stack):
                raise ValueError(f"workspace buffer {name!r} declared as {np.dtype(first.dtype)} "
                                 f"{'stack' if first.stack else 'per-site'} and as {np.dtype(b.dtype)} "
                                 f"{'stack' if b.stack else 'per-site'}")
        if len(group) > 1:
            first = replace(first, elements=lambda r, g=tuple(group): max(b.elements(r) for b in g),
                            zeroed=any(b.zeroed for b in group))
        out.append(first)
    return tuple(out)


def site_part(buffers: Iterable[Buffer]) -> tuple[Buffer, ...]:
    return tuple(b for b in merged(buffers) if not b.stack)


def stack_part(buffers: Iterable[Buffer]) -> tuple[Buffer, ...]:
    return tuple(b for b in merged(buffers) if b.stack)


def ws_bytes(buffers: Iterable[Buffer], max_rows: int) -> dict[str, int]:
    """Byte size of each per-site buffer for ``max_rows`` rows (0 rows clamps to 1), by name."""
    return {b.name: b.nbytes(max_rows) for b in site_part(buffers)}


def ws_total_bytes(buffers: Iterable[Buffer], max_rows: int) -> int:
    """Bytes of one workspace's per-site buffers."""
    return sum(ws_bytes(buffers, max_rows).values())


def stack_bytes(buffers: Iterable[Buffer], max_rows: int) -> int:
    """Bytes of the stack buffers, made once whatever the workspace mode."""
    return sum(b.nbytes(max_rows) for b in stack_part(buffers))


def made(be: Any, buffers: Iterable[Buffer], max_rows: int) -> dict[str, Any]:
    """Each of ``buffers`` (merged) for ``max_rows`` rows, by name, on ``be``'s array namespace; one that needs no
    element is left out. Zeroed ones are zeroed by ``be.zero`` (on CUDA in order on the backend's stream, which a
    later launch reads them on). a_gate and a_up are one allocation (a_up right after a_gate, the same size, from
    the next 256 bytes), so a backend may write gate and up in one batched GEMM whose output stride is the
    distance between them."""
    bufs = merged(buffers)
    rows, by_name = max(max_rows, 1), {b.name: b for b in bufs}
    sizes, out = {b.name: b.elements(rows) for b in bufs}, {}
    for b in bufs:
        n = sizes[b.name]
        if n <= 0 or b.name in out:
            continue
        up = by_name.get("a_up")
        if b.name == "a_gate" and up is not None and sizes["a_up"] == n and np.dtype(up.dtype) == np.dtype(b.dtype):
            at = -(-n * np.dtype(b.dtype).itemsize // 256) * 256 // np.dtype(b.dtype).itemsize
            pair = be.xp.empty(at + n, dtype=b.dtype)
            out["a_gate"], out["a_up"] = pair[:n], pair[at:]
        else:
            out[b.name] = be.xp.empty(n, dtype=b.dtype)
    for b in bufs:
        if b.zeroed and b.name in out:
            be.zero(out[b.name])
    return out


class Workspace:
    """The scratch of one site call, as flat buffers by name: this workspace's per-site buffers, made here, and the
    stack's (``stack``: made once by ``workspace_pool``, which builds every workspace and binds them to the
    backend). ``nbytes``: the per-site buffers' bytes."""

    def __init__(self, be: Any, buffers: Iterable[Buffer], max_rows: int, stack: Mapping[str, Any]):
        buffers = merged(buffers)
        self.stack = stack
        self.max_rows = max(max_rows, 1)
        self.nbytes = ws_total_bytes(buffers, max_rows)
        self._flat = {**made(be, site_part(buffers), max_rows), **stack}
        self._views: dict[tuple[str, tuple[int, ...], int], Any] = {}

    def view(self, name: str, *shape: int, offset: int = 0) -> Any:
        """Elements ``[offset, offset + prod(shape))`` of buffer ``name``, shaped ``shape`` (a view).
        Views are kept and handed out again (at most a few per row count a site call takes): a
        wide call is bound by the host, and making one is several microseconds of Python."""
        key = (name, shape, offset)
        view = self._views.get(key)
        if view is None:
            n = math.prod(shape)
            buf = self._buffer(name)
            if offset < 0 or offset + n > buf.size:
                raise ValueError(f"workspace buffer {name!r} holds {buf.size} elements, asked for {shape}"
                                 + (f" from element {offset}" if offset else ""))
            view = self._views[key] = buf[offset:offset + n].reshape(shape)
        return view

    def as_f32(self, name: str) -> Any:
        """All of buffer ``name`` as float32 (a view of its bytes): scratch for a step that knows the
        buffer's contents are dead, e.g. a K split's partial sums."""
        view = self._views.get((name, (), -1))
        if view is None:
            buf = self._buffer(name)
            n = buf.nbytes // 4 * 4 // buf.itemsize
            view = self._views[(name, (), -1)] = buf[:n].view(np.float32)
        return view

    def fits(self, name: str, n: int) -> bool:
        """Whether buffer ``name`` holds ``n`` elements."""
        return name in self._flat and n <= self._flat[name].size

    def _buffer(self, name: str) -> Any:
        if name not in self._flat:
            raise ValueError(f"workspace buffer {name!r} was not declared for this workspace (it holds "
                             f"{', '.join(self._flat)})")
        return self._flat[name]


def workspace_pool(be: Any, buffers: Iterable[Buffer], max_rows: int, layers: int, shared: bool) -> list[Workspace]:
    """The workspace of each of ``layers`` sites, one object for all of them when ``shared``; their stack buffers are
    made once, and ``be`` is handed them (``Backend.bind``: its kernels' scratch is among them)."""
    buffers = merged(buffers)
    stack = made(be, stack_part(buffers), max_rows)
    pool = ([Workspace(be, buffers, max_rows, stack)] * layers if shared else
            [Workspace(be, buffers, max_rows, stack) for _ in range(layers)])
    be.bind(stack)
    return pool


def free_memory_bytes(xp: Any) -> int | None:
    """What ``xp`` can still allocate: available host memory for NumPy, free device memory for
    CuPy; None when the system does not say."""
    if xp is not np:
        return int(xp.cuda.runtime.memGetInfo()[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def workspaces_bytes(buffers: Iterable[Buffer], max_rows: int, layers: int, shared: bool) -> int:
    """Bytes of a stack's workspaces: one (``shared``) or ``layers`` of the per-site buffers, plus the stack's."""
    buffers = merged(buffers)
    return ws_total_bytes(buffers, max_rows) * (1 if shared else layers) + stack_bytes(buffers, max_rows)


def allocate_workspaces(be: Any, buffers: Iterable[Buffer], max_rows: int, layers: int, shared: bool,
                        free: int | None | str = "measure", sharers: int = 1) -> list[Workspace]:
    """``workspace_pool``, after checking that it fits the free memory (ConfigError if it does not). ``free``: the
    free memory as measured before any of the ``sharers`` ranks that allocate from the same memory (the ranks of
    one host on NumPy, of one GPU on CUDA) allocated theirs (default: measured here, one rank); each may take
    its share."""
    buffers = merged(buffers)
    once, need = stack_bytes(buffers, max_rows), workspaces_bytes(buffers, max_rows, layers, shared)
    what = (f"the shared workspace for workspace_rows = {max_rows} needs {fmt_bytes(need)}" if shared else
            f"the {layers} per-layer workspaces for workspace_rows = {max_rows} need {fmt_bytes(need)}")
    if once:
        what += f" (with {fmt_bytes(once)} of scratch one for the stack)"
    hints = ["lower workspace_rows in the topology" + ("" if shared else " or set shared_workspace = true")]
    hints += list(dict.fromkeys(b.hint for b in stack_part(buffers) if b.hint and b.nbytes(max_rows)))
    hint = "; ".join(hints)
    if free == "measure":
        free = free_memory_bytes(be.xp)
    if free is not None and need * sharers > free:
        kind = "host" if be.xp is np else "device"
        whose = f" for the {sharers} ranks that share it ({fmt_bytes(free // sharers)} each)" if sharers > 1 else ""
        raise ConfigError(f"{what}, but only {fmt_bytes(free)} of {kind} memory is free{whose}; {hint}")
    try:
        return workspace_pool(be, buffers, max_rows, layers, shared)
    except MemoryError as e:  # CuPy's OutOfMemoryError is a MemoryError too
        raise ConfigError(f"{what}, and allocating {'it' if shared else 'them'} failed ({e}); {hint}") from None


@dataclass(frozen=True)
class Footprint:
    per_workspace: int
    layers: int
    shared: bool

    @property
    def stack(self) -> int:
        return self.per_workspace if self.shared else self.per_workspace * self.layers

    @property
    def private_copies(self) -> int:
        return self.per_workspace * self.layers


def fmt_bytes(n: int) -> str:
    """Decimal units, the ones the report and its tests use: MB below 1 GB, GB above."""
    return f"{n / 1e9:.3f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def footprint_lines(buffers: Iterable[Buffer], rows: int, layers: int, shared: bool) -> list[str]:
    """The per-site buffers per workspace and for the stack in ``shared``'s mode, then a line per label of the stack
    buffers (made once in either mode) that take any bytes at ``rows`` rows."""
    buffers = merged(buffers)
    fp = Footprint(ws_total_bytes(buffers, rows), layers, shared)
    sizes = ws_bytes(buffers, rows)
    mode = "shared (one for the stack)" if shared else "per-layer (one per site)"
    lines = [
        f"workspace: {fmt_bytes(fp.per_workspace)} per workspace at {max(rows, 1)} rows "
        f"(= {fp.per_workspace} bytes; u_slot {fmt_bytes(sizes.get('u_slot', 0))}, quadratic in rows)",
        f"workspace: {layers} private copies would be {fmt_bytes(fp.private_copies)}; "
        f"mode {mode}: stack total {fmt_bytes(fp.stack)}"
        + (f", saving {fmt_bytes(fp.private_copies - fp.stack)}" if shared else ""),
    ]
    by_label: dict[str, list[Buffer]] = {}
    for b in stack_part(buffers):
        if b.nbytes(rows):
            by_label.setdefault(b.stack, []).append(b)
    for label, group in by_label.items():
        notes = "; ".join(dict.fromkeys(b.note for b in group if b.note))
        lines.append(f"{label}: {fmt_bytes(sum(b.nbytes(rows) for b in group))}" + (f" ({notes})" if notes else ""))
    return lines

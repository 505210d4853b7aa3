"""The MLP scratch: its 14 buffers, their byte sizes, and the footprint report.

One workspace serves the whole layer stack by default: every buffer is fully written before it
is read inside one site call and one stream runs the stack, so a later layer never observes an
earlier layer's bytes. ``shared = False`` gives each layer a private copy, so the saving can be
measured. ``u_slot`` is QUADRATIC in rows: ``[rows * top_k, rows]``. ``allocate_workspaces`` checks
the total against the free memory first, so an oversized ``workspace_rows`` is a clear error.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from glm_ep.config.model import SiteConfig
from glm_ep.errors import ConfigError

_I32, _F32, _BF16 = np.dtype(np.int32), np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)

#: Buffer order, as allocated; ``buffer_specs`` gives each one's shape and dtype.
BUFFERS = ("a_gate", "a_up", "a_act", "logits", "ids", "wts", "expert_out", "shared_out",
           "u_eid", "u_slot", "sorted_token_ids", "sorted_expert_ids", "expert_offsets", "token_to_perm")


def max_inter(cfg: SiteConfig) -> int:
    return max(cfg.local_dense_intermediate, cfg.moe_intermediate, cfg.local_shared_intermediate, 1)


def buffer_specs(cfg: SiteConfig, max_rows: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of each buffer for ``max_rows`` rows (0 rows clamps to 1)."""
    r, k, h, e = max(max_rows, 1), cfg.top_k, cfg.hidden, cfg.num_experts
    # gate/up/act serve both [rows, inter] (dense, shared) and [rows, top_k, moe_inter] (routed).
    act = max(r * max_inter(cfg), r * k * cfg.moe_intermediate, 1)
    return {
        "a_gate": ((act,), _BF16),
        "a_up": ((act,), _BF16),
        "a_act": ((act,), _BF16),
        "logits": ((r, e), _F32),
        "ids": ((r, k), _I32),
        "wts": ((r, k), _F32),
        "expert_out": ((r * k, h), _BF16),
        "shared_out": ((r, h), _BF16),
        "u_eid": ((r * k,), _I32),
        "u_slot": ((r * k, r), _I32),
        "sorted_token_ids": ((r * k,), _I32),
        "sorted_expert_ids": ((r * k,), _I32),
        "expert_offsets": ((e + 1,), _I32),
        "token_to_perm": ((r, k), _I32),
    }


def ws_bytes(cfg: SiteConfig, max_rows: int) -> list[int]:
    """Byte size of each of the 14 buffers, in ``BUFFERS`` order."""
    specs = buffer_specs(cfg, max_rows)
    return [int(np.prod(specs[b][0])) * specs[b][1].itemsize for b in BUFFERS]


def ws_total_bytes(cfg: SiteConfig, max_rows: int) -> int:
    return sum(ws_bytes(cfg, max_rows))


class Workspace:
    """The 14 scratch buffers, allocated once with the backend's array namespace ``xp``."""

    def __init__(self, xp: Any, cfg: SiteConfig, max_rows: int):
        self.max_rows = max(max_rows, 1)
        self.max_inter = max_inter(cfg)
        self.top_k = cfg.top_k
        self.nbytes = ws_total_bytes(cfg, max_rows)
        specs = buffer_specs(cfg, max_rows)
        self._flat = {name: xp.empty(int(np.prod(shape)), dtype=dtype) for name, (shape, dtype) in specs.items()
                      if name not in ("a_gate", "a_up")}
        # a_gate and a_up: one allocation (a_up right after a_gate, the same size, from the next 256 bytes), so a
        # backend may write gate and up in one batched GEMM whose output stride is the distance between them
        n = int(np.prod(specs["a_gate"][0]))
        at = -(-n // 128) * 128  # a_up 256-byte aligned, as a buffer of its own is
        pair = xp.empty(at + n, dtype=specs["a_gate"][1])
        self._flat["a_gate"], self._flat["a_up"] = pair[:n], pair[at:]
        self._views: dict[tuple[str, tuple[int, ...], int], Any] = {}

    def view(self, name: str, *shape: int, offset: int = 0) -> Any:
        """Elements ``[offset, offset + prod(shape))`` of buffer ``name``, shaped ``shape`` (a view).
        Views are kept and handed out again (at most a few per row count a site call takes): a
        wide call is bound by the host, and making one is several microseconds of Python."""
        key = (name, shape, offset)
        view = self._views.get(key)
        if view is None:
            n = math.prod(shape)
            buf = self._flat[name]
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
            buf = self._flat[name]
            n = buf.nbytes // 4 * 4 // buf.itemsize
            view = self._views[(name, (), -1)] = buf[:n].view(np.float32)
        return view

    def fits(self, name: str, n: int) -> bool:
        """Whether buffer ``name`` holds ``n`` elements."""
        return n <= self._flat[name].size


def workspace_pool(xp: Any, cfg: SiteConfig, max_rows: int, layers: int, shared: bool) -> list[Workspace]:
    """The workspace of each of ``layers`` sites: one object for all of them when ``shared``."""
    if shared:
        return [Workspace(xp, cfg, max_rows)] * layers
    return [Workspace(xp, cfg, max_rows) for _ in range(layers)]


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


def allocate_workspaces(xp: Any, cfg: SiteConfig, max_rows: int, layers: int, shared: bool,
                        free: int | None | str = "measure", sharers: int = 1) -> list[Workspace]:
    """``workspace_pool``, after checking that it fits the free memory (ConfigError if it does not). ``free``: the
    free memory as measured before any of the ``sharers`` ranks that allocate from the same memory (the ranks of
    one host on NumPy, of one GPU on CUDA) allocated theirs (default: measured here, one rank); each may take
    its share."""
    need = ws_total_bytes(cfg, max_rows) * (1 if shared else layers)
    what = (f"the shared workspace for workspace_rows = {max_rows} needs {fmt_bytes(need)}" if shared else
            f"the {layers} per-layer workspaces for workspace_rows = {max_rows} need {fmt_bytes(need)}")
    hint = "lower workspace_rows in the topology" + ("" if shared else " or set shared_workspace = true")
    if free == "measure":
        free = free_memory_bytes(xp)
    if free is not None and need * sharers > free:
        kind = "host" if xp is np else "device"
        whose = f" for the {sharers} ranks that share it ({fmt_bytes(free // sharers)} each)" if sharers > 1 else ""
        raise ConfigError(f"{what}, but only {fmt_bytes(free)} of {kind} memory is free{whose}; {hint}")
    try:
        return workspace_pool(xp, cfg, max_rows, layers, shared)
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


def footprint_lines(cfg: SiteConfig, rows: int, layers: int, shared: bool) -> list[str]:
    fp = Footprint(ws_total_bytes(cfg, rows), layers, shared)
    sizes = dict(zip(BUFFERS, ws_bytes(cfg, rows)))
    mode = "shared (one for the stack)" if shared else "per-layer (one per site)"
    lines = [
        f"workspace: {fmt_bytes(fp.per_workspace)} per workspace at {max(rows, 1)} rows "
        f"(= {fp.per_workspace} bytes; u_slot {fmt_bytes(sizes['u_slot'])}, quadratic in rows)",
        f"workspace: {layers} private copies would be {fmt_bytes(fp.private_copies)}; "
        f"mode {mode}: stack total {fmt_bytes(fp.stack)}"
        + (f", saving {fmt_bytes(fp.private_copies - fp.stack)}" if shared else ""),
    ]
    return lines

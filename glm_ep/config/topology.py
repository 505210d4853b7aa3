"""Topology files (TOML): the rank layout, the backend, the workspace and the path levers.

A topology is small, frozen and explicit. Every value is type-checked against its field (a TOML
``"false"`` is a string, not a boolean). Command-line flags override its fields
(``with_overrides``), and ``check_world`` refuses a file whose world does not match the MPI job.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm_ep.dist.deadline import DEFAULT_COLLECTIVE_TIMEOUT_S
from glm_ep.errors import ConfigError
from glm_ep.config.shipped import topology_path

BACKENDS = ("cpu", "cuda")
COMMS = ("auto", "mpi", "nccl")
_EXPECTED = {bool: "a boolean (true or false)", int: "an integer", float: "a number", str: "a string",
             tuple[int, ...]: "a list of integers"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _has_type(v: Any, want: Any) -> bool:
    if want is bool:
        return isinstance(v, bool)
    if want is int:
        return _is_int(v)
    if want is float:
        return _is_int(v) or isinstance(v, float)
    if want == tuple[int, ...]:
        return isinstance(v, tuple) and all(_is_int(d) for d in v)
    return isinstance(v, want)


def _check_types(obj: Any, prefix: str) -> None:
    """Each field of dataclass ``obj`` holds a value of its annotated type, else a ConfigError naming it. A list
    where a tuple of integers is expected (``devices=[0, 1]``, a TOML array) is taken as that tuple: set on the
    frozen ``obj`` in place, so it stays immutable and hashable."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        v, want = getattr(obj, f.name), hints[f.name]
        if want == tuple[int, ...] and isinstance(v, list):
            v = tuple(v)
            object.__setattr__(obj, f.name, v)
        if not _has_type(v, want):
            tuple_field = want == tuple[int, ...] and isinstance(v, tuple)
            got = f"{list(v)!r} holds a non-integer" if tuple_field else f"{v!r} has type {type(v).__name__}"
            raise ConfigError(f"{prefix}{f.name} = {got}, expected {_EXPECTED.get(want, want.__name__)}")


def _unknown_keys(unknown: list[str], known: set[str], lever_names: set[str]) -> str:
    """What is wrong with ``unknown`` keys: for each, the key it was likely meant to be (a typo, or a lever
    written outside [levers] or a top-level key inside it); the valid keys listed only where one has none."""
    spelled = {k: k for k in known} | {k: f"levers.{k}" for k in lever_names}  # bare name -> as the file says it
    meant = {}
    for key in unknown:
        close = difflib.get_close_matches(key.removeprefix("levers."), list(spelled), n=1, cutoff=0.75)
        if close:
            meant[key] = spelled[close[0]]
    if len(unknown) == 1:
        hint = f" (did you mean {meant[unknown[0]]!r}?)" if meant else ""
    else:
        hint = f" (did you mean {', '.join(f'{m!r} for {k!r}' for k, m in meant.items())}?)" if meant else ""
    if len(meant) == len(unknown):
        return f"unknown keys {unknown}{hint}"
    return f"unknown keys {unknown}{hint}; expected {sorted(known)} and [levers] {sorted(lever_names)}"


#: the (slab, depth) pairs the CUDA ring kernels are built for (gemv_nvfp4_ring.cu's gate + up entries,
#: gemv_nvfp4_union.cu's; glm_ep/backend/cuda/kernel_loader.py instantiates these): what the ring levers may name,
#: checked with the topology whatever its backend, so a file written on a CPU machine is not first refused on a GPU
RING_GLU_KERNELS = ((4, 2), (2, 3), (2, 2))
UNION_RING_KERNELS = ((2, 3), (4, 2), (2, 2))


def check_ring_geometries(glu: tuple[int, int], union_slab: tuple[int, ...], union_depth: tuple[int, ...]) -> None:
    """A ConfigError naming the levers where the decode ring's gate + up (slab, depth) or the union ring's (one
    projection, gate + up) pairs of them are not ones the kernels are built for."""
    if tuple(glu) not in RING_GLU_KERNELS:
        raise ConfigError(f"levers.ring_glu_slab = {glu[0]}, ring_glu_depth = {glu[1]}: expected a (slab, depth) in "
                          f"{list(RING_GLU_KERNELS)}, the gate + up kernels gemv_nvfp4_ring.cu instantiates")
    off = [pair for pair in zip(union_slab, union_depth) if pair not in UNION_RING_KERNELS]
    if len(union_slab) != 2 or len(union_depth) != 2 or off:
        raise ConfigError(f"levers.ring_union_slab = {list(union_slab)}, ring_union_depth = {list(union_depth)}: "
                          f"expected (one projection, gate + up) pairs of (slab, depth) in {list(UNION_RING_KERNELS)}, "
                          "the kernels gemv_nvfp4_union.cu instantiates")


#: levers that selected a form or geometry of the decode ring that measured slower than the default, removed with
#: their kernels (docs/perf/DESIGN-NOTES.md): a topology that names one is refused, saying so
REMOVED_LEVERS = {
    "ring_slab": "the decode ring's one projection has one slab (4 steps of 128 k) and depth (2 stages), the "
                 "fastest measured; gate + up's are ring_glu_slab and ring_glu_depth",
    "ring_depth": "the decode ring's one projection has one slab (4 steps of 128 k) and depth (2 stages), the "
                  "fastest measured; gate + up's are ring_glu_slab and ring_glu_depth",
    "ring_unscaled": "the decode ring reads every projection outside the fp16 form unscaled (bf16u or placed); the "
                     "scaled bf16 form measured slower",
    "ring_placed_hidden": "gate and up read the unscaled bf16 form; the placed form measured no faster there",
}


@dataclass(frozen=True)
class PathLevers:
    """Every gate of the dispatch, as a value with its default (never an environment read). The
    bounds a backend's kernels set (widest row group, union ids) are checked against its
    ``Capabilities`` when the backend is built (``glm_ep.backend.make_backend``)."""

    host_dispatch: bool = False  # read ids to the host and loop experts (debugging)
    row_batch: bool = True  # 2 rows and wider: row groups, each union expert swept once per group
    row_batch_max: int = 8  # widest row group of the union path (<= the backend's max_row_group)
    union_max_ids: int = 64  # rows * top_k a union table may hold (<= the backend's max_union_ids)
    prefill_gemm: bool = True  # wide prefill: sort by expert + grouped GEMM
    # measured crossover (glm-ep bench --prefill's sweep): below it, row groups; 24 was the H200's before the narrow
    # register tiles, with which both Hopper cards cross at 9 (configs/h100-1.toml, configs/h200-1.toml)
    prefill_gemm_min_rows: int = 24
    # a dense FFN stored NVFP4 (one expert every row chooses: each row group re-reads all of it): its crossover
    nvfp4_dense_gemm_min_rows: int = 9
    # ... and from this many rows each of its projections dequantized to bf16 (exact) into a scratch of one
    # projection's size, then cuBLAS: the grouped GEMM's W4A16 engines do not reach cuBLAS's bf16 rate (0: off)
    nvfp4_dense_dequant_min_rows: int = 256
    prefill_k_split: bool = True  # the grouped GEMM splits K where it has fewer blocks than SMs
    graph_decode: bool = True  # capture the 1-row decode step of the stack as a CUDA graph
    graph_verify: bool = True  # capture verify steps (2..max_gemv_rows rows) as CUDA graphs too
    graph_sites: bool = True  # one-site calls (site(i, x), forward) of those widths: a graph per (site, rows)
    pdl: bool = True  # CUDA, sm_90+: launch each kernel as a programmatic dependent of the one before it
    # the one-row routed kernels of the CUDA backend (glm_ep/backend/cuda/ring.py)
    ring: bool = True  # the persistent ring kernels (false: gemv_nvfp4.cu's block-per-tile kernels)
    ring_warps_per_sm: int = 16  # warps per SM the ring grid aims at (fewer where its rings do not fit)
    ring_max_warps: int = 0  # cap on the ring grid's warps (0: none)
    ring_min_items_per_sm: int = 4  # fewer items an SM (one expert's down projection): the block kernels (0: off)
    ring_claims: bool = True  # a ring warp's items past its first come from a device counter (false: a fixed stride)
    ring_f16: bool = False  # the down projection in the fp16-operand form: refused unless swiglu_limit bounds it
    ring_f16_hidden: bool = False  # gate and up too: the hidden state is unbounded (past 65504: inf); opt-in
    ring_placed: bool = True  # the down projection's unscaled form decoded by bit placement (x scaled by 2^k)
    ring_down_combine: bool = True  # one row: the shared expert's down projection + combine in the routed down launch
    ring_glu_slab: int = 4  # the decode ring's gate + up: its slab (steps of 128 k a stage) and depth (stages a warp)
    ring_glu_depth: int = 2
    ring_union_max_rows: int = 4  # verify groups of 2..this many rows on the union ring (0: block kernels)
    ring_union_slab: tuple[int, ...] = (2, 2)  # the union ring's slab and depth: (one projection, gate + up)
    ring_union_depth: tuple[int, ...] = (3, 3)

    def __post_init__(self) -> None:
        _check_types(self, "levers.")
        for key in ("row_batch_max", "union_max_ids", "prefill_gemm_min_rows", "nvfp4_dense_gemm_min_rows",
                    "ring_warps_per_sm"):
            if getattr(self, key) < 1:
                raise ConfigError(f"levers.{key} = {getattr(self, key)}, expected >= 1")
        for key in ("ring_union_slab", "ring_union_depth"):
            v = getattr(self, key)
            if len(v) != 2 or min(v) < 1:
                raise ConfigError(f"levers.{key} = {list(v)}, expected two positive integers (one projection, "
                                  "gate + up)")
        if self.ring:  # the ring's geometries, whatever the backend (the block kernels take none)
            check_ring_geometries((self.ring_glu_slab, self.ring_glu_depth), self.ring_union_slab,
                                  self.ring_union_depth)
        if self.ring_union_max_rows < 0:
            raise ConfigError(f"levers.ring_union_max_rows = {self.ring_union_max_rows}, expected >= 0 (0: off)")
        if self.ring_max_warps < 0:
            raise ConfigError(f"levers.ring_max_warps = {self.ring_max_warps}, expected >= 0 (0: no cap)")
        if self.nvfp4_dense_dequant_min_rows < 0:
            raise ConfigError(f"levers.nvfp4_dense_dequant_min_rows = {self.nvfp4_dense_dequant_min_rows}, expected "
                              ">= 0 (0: off)")
        if self.ring_min_items_per_sm < 0:
            raise ConfigError(f"levers.ring_min_items_per_sm = {self.ring_min_items_per_sm}, expected >= 0 (0: off)")
        if self.ring_f16_hidden and not self.ring_f16:
            raise ConfigError("levers.ring_f16_hidden = true needs ring_f16 = true (the fp16 form of gate and up "
                              "comes with the down projection's)")


@dataclass(frozen=True)
class Topology:
    name: str = "unnamed"  # what messages call it; a file's own name, else its file name (from_dict)
    world: int = 1
    tp: int = 1
    ep: int = 1
    moe_tp: int = 1  # each routed expert's width split over this many ranks (ep groups of moe_tp ranks)
    backend: str = "cpu"
    comm: str = "auto"  # auto: NCCL for cuda ranks on distinct GPUs, else MPI
    devices: tuple[int, ...] = ()  # world rank -> CUDA device; empty = the node-local rank
    workspace_rows: int = 512
    shared_workspace: bool = True
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S  # bound on every wait on the other ranks
    check_weights: bool = True  # refuse NaN/Inf weights at load (one vectorized scan of what a rank reads)
    allow_nonfinite_input: bool = False  # forward: compute NaN/Inf input rows instead of refusing them
    check_calls: bool = False  # library API: the ranks agree each call's layer and input (a debugging aid)
    expert_placement: str = ""  # a placement of the experts on the ep ranks (glm-ep balance --out): "" contiguous
    levers: PathLevers = field(default_factory=PathLevers)

    def __post_init__(self) -> None:
        _check_types(self, f"topology {self.name!r}: ")
        if self.world < 1:
            raise ConfigError(f"topology {self.name!r}: world = {self.world}, expected >= 1")
        for key in ("tp", "ep", "moe_tp"):
            d = getattr(self, key)
            if d < 1 or self.world % d:
                raise ConfigError(f"topology {self.name!r}: {key} = {d} does not divide world = {self.world}")
        if self.world % (self.ep * self.moe_tp):
            raise ConfigError(f"topology {self.name!r}: ep * moe_tp = {self.ep * self.moe_tp} does not divide world = "
                              f"{self.world} (the experts are split over ep groups of moe_tp ranks)")
        if self.backend not in BACKENDS:
            raise ConfigError(f"topology {self.name!r}: backend = {self.backend!r}, expected one of {BACKENDS}")
        if self.comm not in COMMS:
            raise ConfigError(f"topology {self.name!r}: comm = {self.comm!r}, expected one of {COMMS}")
        if self.comm == "nccl" and self.backend != "cuda":
            raise ConfigError(f"topology {self.name!r}: comm = 'nccl' with backend = {self.backend!r}; NCCL sums "
                              "the cuda backend's GPU buffers: expected comm = 'auto' or 'mpi' (or backend = 'cuda')")
        if self.devices and len(self.devices) != self.world:
            raise ConfigError(f"topology {self.name!r}: devices lists {len(self.devices)} entries for "
                              f"world = {self.world}; expected one device per rank")
        if any(d < 0 for d in self.devices):
            raise ConfigError(f"topology {self.name!r}: devices = {list(self.devices)}; expected CUDA device "
                              "numbers >= 0")
        if self.workspace_rows < 1:
            raise ConfigError(f"topology {self.name!r}: workspace_rows = {self.workspace_rows}, expected >= 1")
        if not (math.isfinite(self.collective_timeout_s) and self.collective_timeout_s > 0):
            raise ConfigError(f"topology {self.name!r}: collective_timeout_s = {self.collective_timeout_s}, "
                              "expected a finite number of seconds > 0")

    @property
    def layout_text(self) -> str:
        """How messages name the rank layout: ``tp 2, ep 2`` (``, moe_tp 2`` where experts are split)."""
        return f"tp {self.tp}, ep {self.ep}" + (f", moe_tp {self.moe_tp}" if self.moe_tp > 1 else "")

    @classmethod
    def load(cls, path: str | Path) -> "Topology":
        path = topology_path(path)  # a file, or a shipped topology by name (gb10-2)
        try:
            raw = tomllib.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text ({e}); expected a TOML topology file") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
        except RecursionError:
            raise ConfigError(f"{path}: values nested too deeply to parse; expected a flat TOML topology "
                              "file") from None
        placed = raw.get("expert_placement") if isinstance(raw, dict) else None
        if isinstance(placed, str) and placed and not Path(placed).is_absolute():
            raw["expert_placement"] = str(path.parent / placed)  # relative to the topology file
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "topology") -> "Topology":
        raw = dict(raw)
        levers_raw = raw.pop("levers", {})
        if not isinstance(levers_raw, dict):
            raise ConfigError(f"{source}: levers = {levers_raw!r}, expected a [levers] table")
        removed = sorted(set(levers_raw) & set(REMOVED_LEVERS))
        if removed:
            raise ConfigError(f"{source}: " + "; ".join(f"levers.{k} was removed: {REMOVED_LEVERS[k]}" for k in removed)
                              + "; delete " + ("it" if len(removed) == 1 else "them") + " from the topology")
        known = {f.name for f in dataclasses.fields(cls)} - {"levers"}
        lever_names = {f.name for f in dataclasses.fields(PathLevers)}
        unknown = sorted(set(raw) - known) + sorted(f"levers.{k}" for k in set(levers_raw) - lever_names)
        if unknown:
            raise ConfigError(f"{source}: {_unknown_keys(unknown, known, lever_names)}")
        raw.setdefault("name", Path(source).stem)
        try:
            return cls(levers=PathLevers(**levers_raw), **raw)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def with_overrides(self, tp: int | None = None, ep: int | None = None, backend: str | None = None,
                       world: int | None = None, moe_tp: int | None = None) -> "Topology":
        changes = {k: v for k, v in dict(tp=tp, ep=ep, backend=backend, world=world, moe_tp=moe_tp).items()
                   if v is not None}
        if changes.get("backend") == "cpu" and self.comm == "nccl":  # a GPU layout run on CPUs: sums over MPI
            changes["comm"] = "mpi"
        return dataclasses.replace(self, **changes) if changes else self

    def check_world(self, mpi_size: int) -> None:
        if mpi_size != self.world:
            ranks = f"{self.world} rank{'s' if self.world != 1 else ''}"
            raise ConfigError(f"topology {self.name!r} is for {ranks} (world = {self.world}), but the MPI job has "
                              f"{mpi_size}; launch with mpiexec -n {self.world} or pick another topology")

"""Lazy, per-rank reading of a GLM-5.3-Flash NVFP4 checkpoint.

``Checkpoint`` opens a model folder (``config.json`` plus ``model.safetensors.index.json`` and its
shards, or one ``model.safetensors``; where both are there, the single file, as HF transformers
reads it), parses every shard's header up front — so a truncated or corrupt file fails on every
rank at open time, before any rank starts reading — and then reads tensors, or row/column slices
of them, only when asked (``glm_ep.checkpoint.layers`` asks for what one rank owns at one MLP
site). An index may name only files inside the folder. ``stamps`` records every file it read, so
a later reader (the run's check) can tell a checkpoint rewritten since (``changed_since``).

With ``check_finite`` (the default) every bf16/fp32 tensor read must be finite and every E4M3 block
scale not NaN: a scan of the bit patterns of the bytes just read (``glm_ep.checkpoint.finite``), in
cache-sized chunks (what the NVFP4 scales will do, ``glm_ep.checkpoint.layers.read_nvfp4`` checks). ``fingerprint`` digests what the
folder says (the parsed config, the index, every shard header), so ranks can check they opened
the same checkpoint.

Shapes are ``[out, in]`` as stored. Suffixes: H hidden, I dense/shared width (``Il`` this rank's
slice), E routed experts.
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Callable

import ml_dtypes  # noqa: F401  (registers 'bfloat16' with NumPy: safetensors looks it up by name)
import numpy as np
from safetensors import safe_open

from glm_ep.checkpoint.finite import can_be_nonfinite, describe_nonfinite, first_nonfinite
from glm_ep.config.model import HF_QUANT_FILE, ModelConfig, parse_json
from glm_ep.errors import CheckpointError, not_a_file, path_kind

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
LAYER_PREFIXES = ("model.language_model.layers", "model.layers")
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8,
             "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what its header says."""

    file: Path
    dtype: str  # safetensors dtype string: "BF16", "F32", "U8", "F8_E4M3", ...
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in ``file``
    nbytes: int


def _stamp(path: Path) -> tuple[int, int, int]:
    """``path``'s (inode, size, modification time in ns); zeros where it is gone."""
    try:
        st = path.stat()
    except OSError:
        return (0, 0, 0)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _header_int(v: object) -> int:
    """A shape or offset of a safetensors header: a JSON integer (not a float such as 2.5 or 1e999, nor a bool)."""
    if type(v) is not int:
        raise ValueError(f"{v!r} is not an integer")
    return v


def _parse_header(path: Path) -> tuple[dict[str, TensorInfo], bytes]:
    """Read one shard's header; check it is well formed and the file holds all the data it names.
    Returns its tensors and the raw header bytes."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: corrupt header: file has {size} bytes, too short for a "
                                  "safetensors header")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > _MAX_HEADER or 8 + hlen > size:
            raise CheckpointError(f"{path}: corrupt header: header length {hlen} does not fit a file "
                                  f"of {size} bytes")
        raw = f.read(hlen)
    header = parse_json(raw, f"{path}: corrupt header", CheckpointError)
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt header: expected a JSON object")
    infos: dict[str, TensorInfo] = {}
    data_end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = str(entry["dtype"]), tuple(_header_int(d) for d in entry["shape"])
            start, end = (_header_int(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: corrupt header: entry for tensor '{name}' is malformed "
                                  f"({entry!r}: {e!r})") from None
        # dtypes this runtime never reads (other parts of a full model) are only bounds-checked
        expected = math.prod(shape) * _ITEMSIZE[dtype] if dtype in _ITEMSIZE else end - start
        if not 0 <= start <= end or end - start != expected:
            raise CheckpointError(f"{path}: corrupt header: tensor '{name}' ({dtype} {list(shape)}) "
                                  f"has data_offsets [{start}, {end}], expected {expected} bytes")
        infos[name] = TensorInfo(path, dtype, shape, 8 + hlen + start, end - start)
        data_end = max(data_end, end)
    if 8 + hlen + data_end > size:
        raise CheckpointError(f"{path}: truncated: header says {data_end} bytes of data, file has "
                              f"{size - 8 - hlen}")
    return infos, raw


class Checkpoint:
    """A model folder opened for lazy reads. Use as a context manager, or call ``close()``."""

    def __init__(self, model_dir: str | Path, check_finite: bool = True):
        self.dir = Path(model_dir)
        self.check_finite = check_finite
        self.unused: list[str] = []  # what check_extent found stored past what config.json declares (not read)
        if not self.dir.is_dir():
            kind = path_kind(self.dir)
            raise CheckpointError(f"{self.dir}: model folder {kind if kind.startswith('not ') else 'is ' + kind} "
                                  f"(expected a folder with config.json and {INDEX_FILE} or {SINGLE_FILE})")
        self.config = ModelConfig.from_file(self.dir / "config.json")
        #: where the folder holds both weight layouts, which one is read (HF's rule): a line for the load log
        self.note: str | None = None
        self.source, self._file_of = self._weights_source()
        files = sorted(set(self._file_of.values())) if self._file_of is not None else [SINGLE_FILE]
        read = [self.dir / "config.json", self.dir / HF_QUANT_FILE, self.source] + [self.dir / f for f in files]
        #: (inode, size, modification time) of every file read, at open: ``changed_since`` compares them
        self.stamps = {str(p): _stamp(p) for p in read}
        self._headers: dict[str, dict[str, TensorInfo]] = {}
        digest = hashlib.sha256(repr(sorted(self._file_of.items())).encode() if self._file_of else b"")
        for name in files:
            self._headers[name], raw_header = _parse_header(self.dir / name)
            digest.update(name.encode() + b"\0" + raw_header)
        #: digests of the parsed config and of the index with every shard header: equal on ranks
        #: that opened the same files
        self.fingerprint = {"config": hashlib.sha256(repr(self.config).encode()).hexdigest(),
                            "index": digest.hexdigest()}
        if self._file_of is None:
            self._file_of = {key: SINGLE_FILE for key in self._headers[SINGLE_FILE]}
        self._prefix = self._find_prefix()
        self._handles: dict[str, Any] = {}
        #: called with the byte count of every tensor (or slice) read: a progress bar's ``update``
        self.on_read: Callable[[int], Any] | None = None

    def _weights_source(self) -> tuple[Path, dict[str, str] | None]:
        """The file the weights are found from, and the index's weight map (None: the single file). HF
        transformers' rule: ``model.safetensors`` where it is a file, else the index; a folder holding both reads
        the single file (``self.note`` says so)."""
        single, index = self.dir / SINGLE_FILE, self.dir / INDEX_FILE
        if not_a_file(single, SINGLE_FILE) is None:
            if os.path.lexists(index):
                self.note = (f"{self.dir}: holds both {SINGLE_FILE} and {INDEX_FILE}: reading {SINGLE_FILE}, as HF "
                             "transformers does (the index and the shards it names are not read)")
            return single, None
        if not_a_file(index, INDEX_FILE) is None:
            return index, self._read_index(index)
        odd = [problem for p in (index, single) if os.path.lexists(p) and (problem := not_a_file(p, p.name))]
        if odd:
            raise CheckpointError(f"{'; '.join(odd)}; expected {INDEX_FILE} (with its shards) or {SINGLE_FILE}, "
                                  "a regular file")
        raise CheckpointError(f"{self.dir}: no weights: expected {INDEX_FILE} (with its shards) or {SINGLE_FILE}")

    def _read_index(self, index: Path) -> dict[str, str]:
        raw = parse_json(index.read_bytes(), str(index), CheckpointError)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: not a safetensors index: expected a JSON object whose 'weight_map' "
                                  "maps tensor names to shard file names")
        for key, shard in weight_map.items():
            if not isinstance(shard, str) or not shard:
                raise CheckpointError(f"{index}: weight_map['{key}'] = {shard!r}, expected the file name of a "
                                      "shard (a string)")
        base = os.path.abspath(self.dir)
        for shard in sorted(set(weight_map.values())):
            if os.path.isabs(shard) or os.path.commonpath([base, os.path.abspath(os.path.join(base, shard))]) != base:
                raise CheckpointError(f"{index}: weight_map names the shard {shard!r}, outside the model folder; "
                                      f"expected a file inside {self.dir} (as HF transformers requires)")
            if (problem := not_a_file(self.dir / shard, "shard file")) is not None:
                raise CheckpointError(f"{problem} (named in {index}); expected a safetensors shard, a regular file")
        return weight_map

    def changed_since(self, stamps: dict[str, tuple[int, int, int]]) -> list[str]:
        """The files of ``stamps`` (an earlier ``self.stamps`` of this folder) that are not as they were then:
        replaced, rewritten, grown or gone (inode, size or modification time differ)."""
        return [p for p, was in stamps.items() if _stamp(Path(p)) != was]

    def _find_prefix(self) -> str:
        for prefix in LAYER_PREFIXES:
            if any(key.startswith(prefix + ".") for key in self._file_of):
                return prefix
        raise CheckpointError(f"{self.source}: no layer tensors (expected keys starting with "
                              f"{' or '.join(repr(p + '.') for p in LAYER_PREFIXES)})")

    def check_extent(self) -> None:
        """The layers and routed experts config.json declares are the ones the keys hold: a config that declares
        more (a typo of num_hidden_layers or n_routed_experts) is refused here, from the keys alone, where the
        per-tensor lookups of every declared layer took minutes to name the first missing tensor."""
        model, lead = self.config, self._prefix + "."
        mlp_layers, experts, routed_layers, dense_layers, shared_layers = set(), set(), set(), set(), set()
        first_sparse = model.sparse_layers[0] if model.sparse_layers else None
        expert_lead = f"{lead}{first_sparse}.mlp.experts."
        for key in self._file_of:
            if not key.startswith(lead):
                continue
            layer, _, rest = key[len(lead):].partition(".")
            if layer.isdigit() and rest.startswith("mlp."):
                mlp_layers.add(int(layer))
                if rest.startswith("mlp.experts."):
                    routed_layers.add(int(layer))
                elif rest.startswith("mlp.gate_proj."):
                    dense_layers.add(int(layer))
                elif rest.startswith("mlp.shared_experts."):
                    shared_layers.add(int(layer))
            if key.startswith(expert_lead):
                e = key[len(expert_lead):].partition(".")[0]
                if e.isdigit():
                    experts.add(int(e))
        missing = [i for i in range(model.num_hidden_layers) if i not in mlp_layers]
        if missing:
            held = f"layers {min(mlp_layers)}..{max(mlp_layers)}" if mlp_layers else "no MLP layers"
            raise CheckpointError(f"{self.dir / 'config.json'}: num_hidden_layers = {model.num_hidden_layers}, but "
                                  f"{self.source} holds MLP tensors for {held} ({len(mlp_layers)} layers); no "
                                  f"'{lead}{{i}}.mlp.*' for layer {_few(missing)}")
        types = model.mlp_layer_types
        wrong = [(i, kind) for i, kind in enumerate(types) if i in (dense_layers if kind == "sparse" else routed_layers)
                 and i not in (routed_layers if kind == "sparse" else dense_layers)]
        if wrong:
            i, kind = wrong[0]
            held = "a dense FFN" if kind == "sparse" else "routed experts"
            raise CheckpointError(f"{self.dir / 'config.json'}: the schedule (mlp_layer_types or first_k_dense_replace) "
                                  f"makes layer {i} {kind}, but {self.source} holds {held} there (disagreeing layers: "
                                  f"{_few([j for j, _ in wrong])}); expected a schedule that matches the tensors")
        missing = [e for e in range(model.n_routed_experts) if e not in experts] if first_sparse is not None else []
        if missing:
            raise CheckpointError(f"{self.dir / 'config.json'}: n_routed_experts = {model.n_routed_experts}, but "
                                  f"layer {first_sparse} of {self.source} holds {len(experts)} routed experts; no "
                                  f"'{expert_lead}{{e}}.*' for expert {_few(missing)}")
        # stored past what config.json declares: not read, as HF loads such a checkpoint, but said (a config edited
        # by hand, or one of another model, would otherwise run silently on part of the weights)
        config, unused = self.dir / "config.json", []
        if past := sorted(i for i in mlp_layers if i >= model.num_hidden_layers):
            unused.append(f"num_hidden_layers = {model.num_hidden_layers}, but the checkpoint holds MLP tensors for "
                          f"layer {_few(past)} too")
        if extra := sorted(e for e in experts if e >= model.n_routed_experts):
            unused.append(f"n_routed_experts = {model.n_routed_experts}, but layer {first_sparse} holds routed "
                          f"expert {_few(extra)} too")
        shared = sorted(i for i in shared_layers if i < model.num_hidden_layers)  # not again those past the layers
        if model.n_shared_experts == 0 and shared:
            unused.append(f"n_shared_experts = 0, but the checkpoint holds shared-expert tensors "
                          f"('{lead}{{i}}.mlp.shared_experts.*') for layer {_few(shared)}")
        self.unused = [f"{config}: {what}: they are not used" for what in unused]

    def layer_prefix(self, i: int) -> str:
        """Key prefix of layer ``i``: ``model.layers.{i}`` or ``model.language_model.layers.{i}``."""
        return f"{self._prefix}.{i}"

    def has(self, name: str) -> bool:
        """Whether tensor ``name`` (full key) is stored."""
        file = self._file_of.get(name)
        return file is not None and name in self._headers[file]

    def info(self, name: str) -> TensorInfo:
        """The header entry of tensor ``name`` (full key); CheckpointError if it is not stored."""
        file = self._file_of.get(name)
        if file is None:
            raise CheckpointError(f"tensor '{name}' not found in {self.source}")
        info = self._headers[file].get(name)
        if info is None:
            raise CheckpointError(f"tensor '{name}' not found in {self.dir / file} ({self.source} maps it there)")
        return info

    def read(self, name: str, shape: tuple[int, ...], dtypes: tuple[str, ...],
             rows: slice | None = None, cols: slice | None = None) -> np.ndarray:
        """Tensor ``name``, or its ``[rows, cols]`` slice, after checking its stored dtype and full shape.

        Only the requested slice is read. BF16 comes back as ``ml_dtypes.bfloat16``, F8_E4M3 as
        ``ml_dtypes.float8_e4m3fn``; the result is C-contiguous and owns its memory.
        """
        info = self.info(name)
        if info.dtype not in dtypes:
            raise CheckpointError(f"{info.file}: tensor '{name}' has dtype {info.dtype}, expected "
                                  f"{' or '.join(dtypes)}")
        if info.shape != tuple(shape):
            raise CheckpointError(f"{info.file}: tensor '{name}' has shape {list(info.shape)}, expected "
                                  f"{list(shape)}")
        everything = slice(None)
        index = (everything if rows is None else rows, everything if cols is None else cols)[: len(shape)]
        if info.dtype == "F8_E4M3":
            # safetensors' NumPy framework has no float8: read the bytes the header points at.
            span = rows.indices(shape[0]) if rows is not None and shape else None
            row_bytes = info.nbytes // shape[0] if shape and shape[0] else 0
            if span is not None and span[2] == 1:  # contiguous rows: read only those
                first, stop = span[0], max(span[0], span[1])
                raw = np.fromfile(info.file, dtype=np.uint8, count=(stop - first) * row_bytes,
                                  offset=info.offset + first * row_bytes)
                out = raw.view(ml_dtypes.float8_e4m3fn).reshape((stop - first,) + shape[1:])
                out = out[(slice(None),) + index[1:]]
            else:
                raw = np.fromfile(info.file, dtype=np.uint8, count=info.nbytes, offset=info.offset)
                out = raw.view(ml_dtypes.float8_e4m3fn).reshape(shape)[index]
        elif not shape:
            out = self._handle(info.file).get_tensor(name)
        else:
            out = self._handle(info.file).get_slice(name)[index]
        out = np.ascontiguousarray(out)
        if self.on_read is not None:
            self.on_read(out.nbytes)
        if self.check_finite and can_be_nonfinite(out.dtype):
            at = first_nonfinite(out)
            if at is not None:
                where = [s.indices(n)[0] + i * s.indices(n)[2] for s, n, i in zip(index, shape, at)]
                kind = "a NaN block scale" if info.dtype == "F8_E4M3" else "a NaN or Inf"
                raise CheckpointError(f"{info.file}: tensor '{name}' holds {kind}: "
                                      f"{describe_nonfinite(out, at, where)}; expected finite {info.dtype} values "
                                      "(check_weights = false in the topology skips this check)")
        return out

    def read_scalar(self, name: str, dtypes: tuple[str, ...] = ("F32",)) -> float:
        """A scalar tensor stored with shape ``()`` or ``(1,)``."""
        info = self.info(name)
        if info.shape not in ((), (1,)):
            raise CheckpointError(f"{info.file}: tensor '{name}' has shape {list(info.shape)}, expected "
                                  "a scalar ([] or [1])")
        return float(self.read(name, info.shape, dtypes).reshape(()))

    def _handle(self, file: Path) -> Any:
        key = str(file)  # the path: an index may name shards in subfolders
        if key not in self._handles:
            try:
                self._handles[key] = safe_open(str(file), framework="numpy")
            except Exception as e:  # safetensors raises its own SafetensorError
                if f"(os error {errno.ENOMEM})" in str(e):  # its memory map refused (ulimit -v counts the file)
                    raise MemoryError(f"{file}: cannot map the shard into memory ({e})") from None
                raise CheckpointError(f"{file}: cannot open as safetensors: {e}") from None
        return self._handles[key]

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _few(ids: list[int]) -> str:
    """The first few of ``ids`` for a message."""
    return ", ".join(map(str, ids[:4])) + (f" (and {len(ids) - 4} more)" if len(ids) > 4 else "")

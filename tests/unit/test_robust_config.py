"""Malformed topologies, configs and indexes are clear errors on both ranks, never a traceback or a
value silently taken as something else; an oversized workspace is refused before any weight is
read; ranks that opened different checkpoints or layouts refuse to run."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from ckpt_writer import read_safetensors, write_safetensors
from cli_jobs import (copy_checkpoint, fails, glm_ep, glm_ep_per_rank, loaded_weights, save_hidden, shard_of,
                      write_topology)
from helpers import random_x

INDEX = "model.safetensors.index.json"


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path) -> Path:
    return copy_checkpoint(tiny_checkpoint, tmp_path / "tiny")


def _forward_args(ckpt: Path, tmp_path: Path, *extra: str) -> list[str]:
    x = save_hidden(tmp_path / "x.safetensors", random_x(0, 3, 128))
    return ["forward", "--model", str(ckpt), "--input", str(x), "--output", str(tmp_path / "out.safetensors"),
            *extra]


def _forward(ckpt: Path, tmp_path: Path, *extra: str):
    return glm_ep(2, *_forward_args(ckpt, tmp_path, *extra))


@pytest.mark.parametrize("values,levers,needle", [
    ({}, {"host_dispatch": "false"}, "levers.host_dispatch = 'false' has type str, expected a boolean"),
    ({"shared_workspace": "no"}, None, "shared_workspace = 'no' has type str, expected a boolean"),
    ({"world": "2"}, None, "world = '2' has type str, expected an integer"),
    ({"workspace_rows": 64.0}, None, "workspace_rows = 64.0 has type float, expected an integer"),
    ({"devices": ["0", "1"]}, None, "devices = ['0', '1'] holds a non-integer, expected a list of integers"),
    ({"collective_timeout_s": "5"}, None, "collective_timeout_s = '5' has type str, expected a number"),
    ({"collective_timeout_s": -1}, None, "collective_timeout_s = -1, expected a finite number of seconds > 0"),
], ids=["lever-bool-string", "bool-string", "int-string", "int-float", "devices-strings", "timeout-string",
        "timeout-negative"])
def test_topology_values_are_type_checked(ckpt, tmp_path, values: dict, levers: dict | None, needle: str) -> None:
    topo = write_topology(tmp_path / "t.toml", levers=levers, **dict(dict(world=2, tp=2, ep=2), **values))
    fails(_forward(ckpt, tmp_path, "--topology", str(topo)), "t.toml", needle)


def test_topology_not_utf8(ckpt, tmp_path) -> None:
    topo = tmp_path / "t.toml"
    topo.write_bytes(b'name = "caf\xe9"\nworld = 2\n')
    fails(_forward(ckpt, tmp_path, "--topology", str(topo)), "t.toml: not UTF-8 text")


def _edit_config(ckpt: Path, edit) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("damage,needles", [
    (lambda c: (c / "config.json").write_bytes(b'{"hidden_size": 128, "name": "caf\xe9"}'),
     ["config.json: not UTF-8 text"]),
    (lambda c: _edit_config(c, lambda d: d.update(quantization_config="nvfp4")),
     ["config.json: quantization_config = 'nvfp4' has type str, expected an object"]),
    (lambda c: (c / "config.json").write_text("[" * 100_000 + "]" * 100_000),
     ["config.json: JSON nested too deeply"]),
    (lambda c: (c / INDEX).write_text(json.dumps({"weight_map": {"model.layers.0.mlp.up_proj.weight": 3}})),
     [INDEX, "weight_map['model.layers.0.mlp.up_proj.weight'] = 3, expected the file name of a shard"]),
    (lambda c: (c / INDEX).write_text(json.dumps({"weight_map": {"model.layers.0.mlp.up_proj.weight": ["a"]}})),
     [INDEX, "= ['a'], expected the file name of a shard"]),
    (lambda c: (c / INDEX).write_text('{"weight_map": ' + "{\"a\": " * 50_000 + "1" + "}" * 50_001),
     [INDEX, "JSON nested too deeply"]),
    # accepted before, each silently taken as one of its readings
    (lambda c: _twice(c / "config.json", '"routed_scaling_factor": -2.5'),
     ["config.json: the key 'routed_scaling_factor' is given twice in one object; expected each key once"]),
    (lambda c: _twice(c / INDEX, '"model.layers.1.mlp.gate.weight": "model-00007-of-00007.safetensors"',
                      after='"weight_map": {'),
     [INDEX, "the key 'model.layers.1.mlp.gate.weight' is given twice"]),
    (lambda c: _edit_config(c, lambda d: d.update(first_k_dense_replace=2)),
     ["config.json: mlp_layer_types and first_k_dense_replace = 2 disagree on layer(s) [1]; expected one schedule"]),
    (lambda c: _edit_config(c, lambda d: d.update(routed_scaling_factor=-2.5)),
     ["config.json: routed_scaling_factor = -2.5, expected a number > 0"]),
], ids=["config-not-utf8", "quantization-config-string", "config-deeply-nested", "index-value-int",
        "index-value-list", "index-deeply-nested", "config-key-twice", "index-key-twice", "schedules-disagree",
        "negative-routed-scaling"])
def test_malformed_json_is_a_clear_error(ckpt, tmp_path, damage, needles: list[str]) -> None:
    damage(ckpt)
    fails(_forward(ckpt, tmp_path), *needles)


def _twice(path: Path, entry: str, after: str = "{") -> None:
    """``entry`` (a ``"key": value`` pair whose key the object already holds) inserted right after ``after``."""
    text = path.read_text()
    at = text.index(after) + len(after)
    path.write_text(text[:at] + entry + "," + text[at:])


def test_a_shard_header_naming_a_tensor_twice_is_refused(ckpt) -> None:
    from glm_ep.checkpoint.reader import Checkpoint
    from glm_ep.errors import CheckpointError

    shard = shard_of(ckpt, "model.layers.1.mlp.gate.weight")
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + n].decode()
    first = json.loads(header)
    name = next(k for k in first if k != "__metadata__")
    entry = json.dumps({name: first[name]})[1:-1]
    doubled = ("{" + entry + "," + header[1:]).encode()
    shard.write_bytes(struct.pack("<Q", len(doubled)) + doubled + data[8 + n:])
    with pytest.raises(CheckpointError, match=f"{shard.name}: corrupt header: the key '{name}' is given twice"):
        Checkpoint(ckpt)


def test_workspace_too_big_is_refused_before_any_weight_is_read(ckpt, tmp_path) -> None:
    topo = write_topology(tmp_path / "huge.toml", world=2, tp=2, ep=2, workspace_rows=10_000_000,
                          shared_workspace=False)
    r = _forward(ckpt, tmp_path, "--topology", str(topo))
    fails(r, "the 4 per-layer workspaces for workspace_rows = 10000000 need", "of host memory is free",
          "lower workspace_rows in the topology or set shared_workspace = true")
    assert not loaded_weights(r)


def test_ranks_that_opened_different_checkpoints_refuse_to_run(ckpt, tiny_checkpoint, tmp_path) -> None:
    _edit_config(ckpt, lambda d: d.update(routed_scaling_factor=2.0))
    r = glm_ep_per_rank(_forward_args(tiny_checkpoint, tmp_path), _forward_args(ckpt, tmp_path))
    fails(r, "ranks hold different checkpoints or layouts (differing: config)", "rank 0: config", "rank 1: config")
    assert not loaded_weights(r)


def test_ranks_that_opened_checkpoints_of_other_weights_refuse_to_run(tiny_checkpoint, tmp_path) -> None:
    """Each node its own copy, of the same shapes but other weights (another seed of the synthetic checkpoint: the
    config, index and shard headers are all the same): refused once the weights are read, from the router weights
    every rank reads whole, before any output is written."""
    from glm_ep.config.presets import preset
    from glm_ep.checkpoint.synth import write_synthetic

    other = write_synthetic(tmp_path / "seed7", preset("tiny"), seed=7, shard_bytes=256 * 1024)
    r = glm_ep_per_rank(_forward_args(tiny_checkpoint, tmp_path), _forward_args(other, tmp_path))
    fails(r, "ranks hold different checkpoints (differing: router weights and biases)",
          "rank 0: router weights and biases", "rank 1: router weights and biases")
    assert not (tmp_path / "out.safetensors").exists()


def _nudge_f32_in_place(ckpt: Path, key: str, index: int) -> Path:
    """Move element ``index`` of the F32 tensor ``key`` one float32 step up, in the shard's bytes themselves (the
    header, and so the checkpoint's fingerprint, stay as they are)."""
    shard = shard_of(ckpt, key)
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    entry = json.loads(data[8:8 + n])[key]
    assert entry["dtype"] == "F32", entry
    at = 8 + n + entry["data_offsets"][0] + 4 * index
    (old,) = struct.unpack("<f", data[at:at + 4])
    data[at:at + 4] = struct.pack("<f", float(np.nextafter(np.float32(old), np.float32(np.inf))))
    shard.write_bytes(bytes(data))
    return shard


def test_ranks_whose_checkpoints_differ_in_one_routing_bias_refuse_to_run(ckpt, tiny_checkpoint, tmp_path) -> None:
    """Two copies that differ in one float32 step of one e_score_correction_bias value (the rest of the files, the
    router weights among them, byte for byte the same): the bias selects experts, so the job is refused as for
    other router weights, before any output is written."""
    key = "model.layers.2.mlp.gate.e_score_correction_bias"
    shard = _nudge_f32_in_place(ckpt, key, 5)
    for theirs in sorted(tiny_checkpoint.iterdir()):
        a, b = theirs.read_bytes(), (ckpt / theirs.name).read_bytes()
        differ = sum(x != y for x, y in zip(a, b)) if len(a) == len(b) else -1
        assert (0 < differ <= 4 if theirs.name == shard.name else differ == 0), (theirs.name, differ)  # one value
    r = glm_ep_per_rank(_forward_args(tiny_checkpoint, tmp_path), _forward_args(ckpt, tmp_path))
    fails(r, "ranks hold different checkpoints (differing: router weights and biases)",
          "rank 0: router weights and biases", "rank 1: router weights and biases")
    assert not (tmp_path / "out.safetensors").exists()


def test_ranks_with_different_shard_headers_refuse_to_run(ckpt, tiny_checkpoint, tmp_path) -> None:
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    write_safetensors(shard, read_safetensors(shard))  # the same tensors under another writer's header
    r = glm_ep_per_rank(_forward_args(tiny_checkpoint, tmp_path), _forward_args(ckpt, tmp_path))
    fails(r, "ranks hold different checkpoints or layouts (differing: index)")


def test_ranks_with_different_topologies_refuse_to_run(tiny_checkpoint, tmp_path) -> None:
    a = write_topology(tmp_path / "a.toml", world=2, tp=2, ep=2)
    b = write_topology(tmp_path / "b.toml", world=2, tp=2, ep=2, workspace_rows=256)
    r = glm_ep_per_rank(_forward_args(tiny_checkpoint, tmp_path, "--topology", str(a)),
                        _forward_args(tiny_checkpoint, tmp_path, "--topology", str(b)))
    fails(r, "ranks hold different checkpoints or layouts (differing: topology workspace_rows); ",
          "rank 0: topology workspace_rows 512", "rank 1: topology workspace_rows 256")
    same = write_topology(tmp_path / "same.toml", world=2, tp=2, ep=2)  # another name, the same layout
    ok = glm_ep_per_rank(_forward_args(tiny_checkpoint, tmp_path, "--topology", str(a)),
                         _forward_args(tiny_checkpoint, tmp_path, "--topology", str(same)))
    assert ok.returncode == 0, ok.stderr[-3000:]


def test_ranks_that_read_different_inputs_refuse_to_run(tiny_checkpoint, tmp_path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    args0 = _forward_args(tiny_checkpoint, tmp_path)
    args1 = _forward_args(tiny_checkpoint, other)  # its own x.safetensors ...
    save_hidden(other / "x.safetensors", random_x(1, 3, 128))  # ... with other values
    r = glm_ep_per_rank(args0, args1)
    fails(r, "ranks hold different inputs (differing: input)")
    assert not loaded_weights(r)
    args1 = _forward_args(tiny_checkpoint, other)
    save_hidden(other / "x.safetensors", random_x(1, 5, 128))  # ... with other rows: named, with each rank's count
    r = glm_ep_per_rank(args0, args1)
    fails(r, "ranks hold different inputs (differing: input rows, input)", "rank 0: input rows 3",
          "rank 1: input rows 5")


@pytest.mark.parametrize("other,differing", [
    (["--prefill", "16"], "prefill"),  # MPI's 'Message truncated' before
    (["--check", "none"], "check"),  # rank 0 waited out the collective deadline before
    (["--seed", "1"], "seed"),  # a false FAIL of the float64 check before
], ids=["prefill", "check", "seed"])
def test_ranks_given_different_run_settings_refuse_to_run(tiny_checkpoint, other: list[str], differing: str) -> None:
    base = ["run", "--model", str(tiny_checkpoint), "--prefill", "8", "--decode", "1", "--verify", "2",
            "--check", "full", "--seed", "0"]
    r = glm_ep_per_rank(base, base + other)
    fails(r, f"ranks hold different command lines (differing: {differing})", f"rank 1: {differing}")
    assert not loaded_weights(r)


def test_ranks_running_different_commands_refuse_to_run(tiny_checkpoint, tmp_path) -> None:
    """forward on one rank and run on the other: refused at once (rank 0 waited out the deadline before)."""
    r = glm_ep_per_rank(_forward_args(tiny_checkpoint, tmp_path), ["run", "--model", str(tiny_checkpoint)])
    fails(r, "ranks hold different command lines (differing: ", "cmd")
    assert not loaded_weights(r)

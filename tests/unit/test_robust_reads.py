"""Which files a checkpoint read takes, and what a refusal says about a file that is not one: HF transformers'
rule where a folder holds both weight layouts, index entries kept inside the folder, a path that is a folder,
a FIFO or a symbolic link loop named as such (never "not found", never opened), and a checkpoint rewritten after
it was opened told apart from one that was not."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from glm_ep.checkpoint.reader import INDEX_FILE, SINGLE_FILE, Checkpoint
from glm_ep.config.topology import Topology
from glm_ep.errors import CheckpointError, ConfigError
from glm_ep.checkpoint.synth import write_synthetic
from glm_ep.config.presets import preset

from ckpt_writer import read_safetensors, write_safetensors
from cli_jobs import copy_checkpoint, shard_of

ROUTER = "model.layers.1.mlp.gate.weight"


@pytest.fixture
def ckpt(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    return copy_checkpoint(tiny_checkpoint, tmp_path / "tiny")


def _folder(p: Path) -> None:
    p.mkdir()


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _loop(p: Path) -> None:
    p.symlink_to(p.name)  # a link to itself


def _dangling(p: Path) -> None:
    p.symlink_to(p.with_name("gone"))


NOT_FILES = pytest.mark.parametrize("make,kind", [
    (_folder, "is a folder"), (_fifo, "is a FIFO"), (_loop, "is a symbolic link loop"),
    (_dangling, "is a broken symbolic link"),
], ids=["folder", "fifo", "loop", "dangling"])


@NOT_FILES
def test_config_json_that_is_not_a_file_says_what_it_is(ckpt: Path, make: Callable[[Path], None], kind: str) -> None:
    (ckpt / "config.json").unlink()
    make(ckpt / "config.json")
    with pytest.raises(ConfigError, match=f"config.json: config.json {kind}; expected the HF config.json"):
        Checkpoint(ckpt)


@NOT_FILES
def test_shard_that_is_not_a_file_says_what_it_is(ckpt: Path, make: Callable[[Path], None], kind: str) -> None:
    shard = shard_of(ckpt, ROUTER)
    shard.unlink()
    make(shard)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: shard file {kind} \(named in .*{INDEX_FILE}\)"):
        Checkpoint(ckpt)


@NOT_FILES
def test_topology_that_is_not_a_file_says_what_it_is(tmp_path: Path, make: Callable[[Path], None],
                                                      kind: str) -> None:
    make(tmp_path / "mine.toml")
    with pytest.raises(ConfigError, match=f"mine.toml: the topology {kind}, not a file; expected a TOML"):
        Topology.load(tmp_path / "mine.toml")


def test_model_folder_that_is_a_file_says_so(tmp_path: Path) -> None:
    (tmp_path / "model").write_text("{}")
    with pytest.raises(CheckpointError, match="model: model folder is a regular file"):
        Checkpoint(tmp_path / "model")


@pytest.mark.parametrize("name", ["../outside.safetensors", "sub/../../outside.safetensors", "/abs/x.safetensors"])
def test_index_entry_outside_the_folder_is_refused(ckpt: Path, name: str) -> None:
    outside = ckpt.parent / "outside.safetensors"
    shutil.copy(shard_of(ckpt, ROUTER), outside)  # a readable shard, there: only where it is counts
    index = json.loads((ckpt / INDEX_FILE).read_text())
    index["weight_map"][ROUTER] = name
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"names the shard '{name}', outside the model folder"):
        Checkpoint(ckpt)


def test_index_entry_in_a_subfolder_is_read(ckpt: Path) -> None:
    shard = shard_of(ckpt, ROUTER)
    (ckpt / "sub").mkdir()
    shard.rename(ckpt / "sub" / shard.name)
    index = json.loads((ckpt / INDEX_FILE).read_text())
    index["weight_map"] = {k: f"sub/../sub/{v}" if v == shard.name else v for k, v in index["weight_map"].items()}
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    with Checkpoint(ckpt) as ck:
        assert ck.read(ROUTER, (32, 128), ("BF16",)).shape == (32, 128)


def test_single_file_is_read_where_an_index_is_beside_it(ckpt: Path, tmp_path: Path) -> None:
    """HF transformers' rule (``modeling_utils``: ``model.safetensors`` is looked for before the index): a folder
    holding both reads the single file, and says so."""
    other = write_synthetic(tmp_path / "other", preset("tiny"), seed=1)  # other values, same names and shapes
    merged: dict = {}
    for shard in sorted(other.glob("model-*.safetensors")):
        merged.update(read_safetensors(shard))
    write_safetensors(ckpt / SINGLE_FILE, merged)
    with Checkpoint(ckpt) as ck, Checkpoint(other) as want:
        assert ck.source == ckpt / SINGLE_FILE
        assert np.array_equal(ck.read(ROUTER, (32, 128), ("BF16",)), want.read(ROUTER, (32, 128), ("BF16",)))
        assert f"holds both {SINGLE_FILE} and {INDEX_FILE}: reading {SINGLE_FILE}, as HF transformers does" \
            in ck.note
    (ckpt / SINGLE_FILE).unlink()
    with Checkpoint(ckpt) as ck:
        assert ck.source == ckpt / INDEX_FILE and ck.note is None


def test_single_file_that_is_a_folder_leaves_the_index_read(ckpt: Path) -> None:
    (ckpt / SINGLE_FILE).mkdir()  # HF's isfile() passes it by, as this does
    with Checkpoint(ckpt) as ck:
        assert ck.source == ckpt / INDEX_FILE
    (ckpt / INDEX_FILE).unlink()
    with pytest.raises(CheckpointError, match=f"{SINGLE_FILE}: {SINGLE_FILE} is a folder; expected {INDEX_FILE}"):
        Checkpoint(ckpt)


@pytest.mark.parametrize("change", ["rewrite", "touch", "replace"])
def test_a_rewritten_file_is_told_from_an_untouched_one(ckpt: Path, change: str) -> None:
    with Checkpoint(ckpt) as ck:
        stamps = ck.stamps
    assert Checkpoint(ckpt).changed_since(stamps) == []
    shard = shard_of(ckpt, ROUTER)
    if change == "rewrite":  # the same bytes written again, later
        data = shard.read_bytes()
        st = shard.stat()
        shard.write_bytes(data)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    elif change == "touch":
        os.utime(shard, ns=(0, 0))
    else:  # another file renamed over it, with the old one's size and times
        twin = shard.with_name("twin")
        shutil.copy2(shard, twin)
        twin.replace(shard)
    assert Checkpoint(ckpt).changed_since(stamps) == [str(shard)]

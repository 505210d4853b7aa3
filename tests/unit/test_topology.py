"""Topology files and ``Topology`` objects: every shipped file loads and its layout fits the GLM shape, values,
levers and overrides are checked by name, unknown keys are named with a close match, and lists become tuples."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from glm_ep.config.model import ModelConfig, RankLayout
from glm_ep.config.topology import PathLevers, Topology
from glm_ep.errors import ConfigError

from helpers import REPO


CONFIG_FILES = sorted((REPO / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.stem for p in CONFIG_FILES])
def test_every_topology_file_loads(path: Path) -> None:
    t = Topology.load(path)
    assert t.name == path.stem
    assert t.world % t.tp == 0 and t.world % t.ep == 0
    assert t.backend in ("cpu", "cuda") and t.workspace_rows >= 1
    t.check_world(t.world)
    RankLayout(t.world, t.world - 1, t.tp, t.ep)
    # what make_backend checks on a device, checked here against the device the file is for: its levers within
    # the backend's kernels, and (CUDA) every ring block within one block's shared memory at the GLM shape
    from glm_ep.backend.cuda import CudaBackend
    from glm_ep.backend.cuda.ring import RingConfig
    from glm_ep.backend.numpy_backend import NumpyBackend
    from glm_ep.config.presets import preset

    glm = ModelConfig.from_dict(preset("glm-5.3-flash"), source="glm-5.3-flash")
    backend = CudaBackend if t.backend == "cuda" else NumpyBackend
    backend.capabilities.check(t.backend, t.levers, glm.num_experts_per_tok)
    if t.backend == "cuda":
        ring = RingConfig.from_levers(t.levers)
        limit = 101376 if path.stem.startswith("gb10") else 232448  # opt-in smem a block: GB10 (sm_121), H200
        ring.forms(glm.swiglu_limit)
        ring.check_fits(limit)


def test_topology_values_and_levers() -> None:
    cpu2 = Topology.load(REPO / "configs" / "cpu-2.toml")
    assert (cpu2.world, cpu2.tp, cpu2.ep, cpu2.backend, cpu2.comm) == (2, 2, 2, "cpu", "mpi")
    assert cpu2.levers == PathLevers()
    gb10 = Topology.load(REPO / "configs" / "gb10-2.toml")
    assert (gb10.workspace_rows, gb10.levers.prefill_gemm_min_rows, gb10.devices) == (256, 32, (0, 0))
    t = Topology.from_dict({"world": 2, "levers": {"prefill_gemm_min_rows": 9, "host_dispatch": True}})
    assert t.levers.prefill_gemm_min_rows == 9 and t.levers.host_dispatch and t.name == "topology"


def test_topology_unknown_keys_bad_toml_and_bad_levers(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown keys.*'wrold'"):
        Topology.from_dict({"wrold": 2})
    with pytest.raises(ConfigError, match="levers.row_batch_maxx"):
        Topology.from_dict({"levers": {"row_batch_maxx": 4}})
    bad = tmp_path / "bad.toml"
    bad.write_text("world = [")
    with pytest.raises(ConfigError, match="bad.toml.*not valid TOML"):
        Topology.load(bad)
    with pytest.raises(ConfigError, match="missing.toml: topology file not found"):
        Topology.load(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match=r"levers.row_batch_max = 0, expected >= 1"):
        Topology.from_dict({"levers": {"row_batch_max": 0}})
    with pytest.raises(ConfigError, match=r"levers.prefill_gemm_min_rows = -1, expected >= 1"):
        Topology.from_dict({"levers": {"prefill_gemm_min_rows": -1}})
    with pytest.raises(ConfigError, match="devices lists 1 entries for world = 2"):
        Topology.from_dict({"world": 2, "devices": [0]})
    with pytest.raises(ConfigError, match="backend = 'tpu'"):
        Topology.from_dict({"backend": "tpu"})
    with pytest.raises(ConfigError, match=r"devices = \[0, -1\]; expected CUDA device numbers >= 0"):
        Topology.from_dict({"world": 2, "devices": [0, -1]})
    with pytest.raises(ConfigError, match="comm = 'nccl' with backend = 'cpu'; NCCL sums the cuda backend's GPU "
                                          "buffers: expected comm = 'auto' or 'mpi'"):
        Topology.from_dict({"comm": "nccl"})
    nccl = Topology.from_dict({"comm": "nccl", "backend": "cuda"})
    assert nccl.comm == "nccl" and nccl.with_overrides(backend="cuda").comm == "nccl"
    assert nccl.with_overrides(backend="cpu").comm == "mpi"  # --backend cpu on a GPU topology (h200-2, gb10-2)
    assert Topology.load(REPO / "configs" / "gb10-2.toml").with_overrides(backend="cpu").backend == "cpu"


@pytest.mark.parametrize("raw,message", [
    ({"wrold": 2}, "unknown keys ['wrold'] (did you mean 'world'?)"),
    ({"levers": {"row_batch_maxx": 4}},
     "unknown keys ['levers.row_batch_maxx'] (did you mean 'levers.row_batch_max'?)"),
    ({"row_batch_max": 4}, "unknown keys ['row_batch_max'] (did you mean 'levers.row_batch_max'?)"),  # not in [levers]
    ({"tpp": 2, "levers": {"pddl": True}}, "unknown keys ['tpp', 'levers.pddl'] (did you mean 'tp' for 'tpp', "
                                           "'levers.pdl' for 'levers.pddl'?)"),
], ids=["typo", "lever-typo", "lever-at-the-top", "two"])
def test_an_unknown_topology_key_with_a_close_match_names_it_not_every_key(raw: dict, message: str) -> None:
    """Each unknown key listed every valid one (about 40): a close match is named instead."""
    with pytest.raises(ConfigError) as e:
        Topology.from_dict(raw)
    assert str(e.value) == f"topology: {message}"


def test_an_unknown_topology_key_without_a_close_match_lists_the_valid_keys() -> None:
    with pytest.raises(ConfigError) as e:
        Topology.from_dict({"wrold": 2, "zzz": 1})
    assert str(e.value).startswith("topology: unknown keys ['wrold', 'zzz'] (did you mean 'world' for 'wrold'?); "
                                   "expected ['allow_nonfinite_input', "), str(e.value)
    assert "[levers] ['graph_decode', " in str(e.value)


def test_topology_world_check_and_overrides() -> None:
    cpu2 = Topology.load(REPO / "configs" / "cpu-2.toml")
    with pytest.raises(ConfigError, match=r"is for 2 ranks \(world = 2\), but the MPI job has 1"):
        cpu2.check_world(1)
    t = cpu2.with_overrides(tp=1, ep=2, backend="cpu")
    assert (t.world, t.tp, t.ep) == (2, 1, 2) and cpu2.tp == 2  # frozen: a new object
    assert cpu2.with_overrides() is cpu2
    with pytest.raises(ConfigError, match="ep = 3 does not divide world = 2"):
        cpu2.with_overrides(ep=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cpu2.world = 4  # type: ignore[misc]


@pytest.mark.parametrize("raw,named", [
    ({"levers": {"host_dispatch": "false"}}, "levers.host_dispatch = 'false' has type str, expected a boolean"),
    ({"levers": {"row_batch_max": True}}, "levers.row_batch_max = True has type bool, expected an integer"),
    ({"shared_workspace": "no"}, "shared_workspace = 'no' has type str, expected a boolean"),
    ({"world": "2"}, "world = '2' has type str, expected an integer"),
    ({"tp": 1.0}, "tp = 1.0 has type float, expected an integer"),
    ({"backend": 1}, "backend = 1 has type int, expected a string"),
    ({"devices": "0,1"}, "devices = '0,1' has type str, expected a list of integers"),
    ({"check_weights": 0}, "check_weights = 0 has type int, expected a boolean"),
    ({"allow_nonfinite_input": "yes"}, "allow_nonfinite_input = 'yes' has type str, expected a boolean"),
    ({"collective_timeout_s": float("nan")}, "collective_timeout_s = nan, expected a finite number of seconds"),
    ({"collective_timeout_s": 0}, "collective_timeout_s = 0, expected a finite number of seconds > 0"),
    ({"levers": 1}, r"levers = 1, expected a \[levers\] table"),
])
def test_topology_values_are_type_checked_by_name(raw: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        Topology.from_dict(raw, source="t.toml")


def test_lists_are_taken_where_a_tuple_of_integers_is_expected() -> None:
    """Python callers write lists (as TOML does): a Topology and its levers take them as tuples, and stay frozen
    and hashable."""
    t = Topology(world=2, tp=2, ep=2, devices=[0, 1], levers=PathLevers(ring_union_slab=[4, 4],
                                                                        ring_union_depth=[2, 2]))
    assert t.devices == (0, 1) and t.levers.ring_union_slab == (4, 4) and t.levers.ring_union_depth == (2, 2)
    assert t == Topology(world=2, tp=2, ep=2, devices=(0, 1), levers=PathLevers(ring_union_slab=(4, 4),
                                                                                ring_union_depth=(2, 2)))
    assert hash(t) == hash(dataclasses.replace(t))
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.devices = [1, 0]  # type: ignore[misc]
    assert Topology.from_dict({"world": 2, "devices": [1, 0]}).devices == (1, 0)  # a TOML array, as before


@pytest.mark.parametrize("make,named", [
    (lambda: Topology(world=2, devices=[0, "1"]), "devices = [0, '1'] holds a non-integer, expected a list of "
                                                  "integers"),
    (lambda: Topology(world=2, devices=[0, 1.0]), "devices = [0, 1.0] holds a non-integer, expected a list"),
    (lambda: Topology(world=2, devices=[True, 0]), "devices = [True, 0] holds a non-integer, expected a list"),
    (lambda: Topology(devices="0"), "devices = '0' has type str, expected a list of integers"),
    (lambda: PathLevers(ring_union_slab=[4, None]), "levers.ring_union_slab = [4, None] holds a non-integer, "
                                                    "expected a list of integers"),
    (lambda: PathLevers(ring_union_slab=[4]), "levers.ring_union_slab = [4], expected two positive integers"),
    (lambda: Topology.from_dict({"levers": {"ring": [True]}}), "levers.ring = [True] has type list, expected a "
                                                               "boolean"),
], ids=["str", "float", "bool", "not-a-list", "lever-none", "lever-one", "list-for-a-boolean"])
def test_a_list_with_a_non_integer_is_refused_naming_it(make, named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        make()


def test_a_python_built_topology_is_not_called_single() -> None:
    """An unnamed Topology is no shipped file: its messages do not name one (world = 2 is not 'single')."""
    assert Topology().name == "unnamed" and Topology(world=2, tp=2, ep=2).name == "unnamed"
    with pytest.raises(ConfigError) as e:
        Topology(world=2, tp=2, ep=2, devices=[0])
    assert str(e.value).startswith("topology 'unnamed': devices lists 1 entries for world = 2"), str(e.value)
    with pytest.raises(ConfigError) as e:
        Topology(world=2, tp=2, ep=2).check_world(1)
    assert str(e.value).startswith("topology 'unnamed' is for 2 ranks (world = 2), but the MPI job has 1")
    assert Topology(name="mine", world=2).name == "mine"
    assert Topology.load(REPO / "configs" / "single.toml").name == "single"  # shipped files keep their names
    assert Topology.load(REPO / "configs" / "cpu-2.toml").name == "cpu-2"


def test_topology_defaults_and_new_keys(tmp_path: Path) -> None:
    t = Topology()
    assert (t.collective_timeout_s, t.check_weights, t.allow_nonfinite_input) == (300.0, True, False)
    p = tmp_path / "t.toml"
    p.write_text("world = 2\ncollective_timeout_s = 7.5\ncheck_weights = false\nallow_nonfinite_input = true\n")
    t = Topology.load(p)
    assert (t.collective_timeout_s, t.check_weights, t.allow_nonfinite_input) == (7.5, False, True)
    assert Topology.from_dict({"collective_timeout_s": 5}).collective_timeout_s == 5  # an integer is a number


def test_topology_file_not_utf8_or_nested_too_deeply(tmp_path: Path) -> None:
    p = tmp_path / "t.toml"
    p.write_bytes(b'name = "\xff"\n')
    with pytest.raises(ConfigError, match="t.toml: not UTF-8 text"):
        Topology.load(p)
    p.write_text("devices = " + "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="t.toml: values nested too deeply"):
        Topology.load(p)

"""A load-aware placement of the routed experts on the expert-parallel ranks (DeepSeek's EPLB, per layer).

``balanced_placement`` takes a recorded load (``logical_count`` [L, E]) and, per sparse layer:

1. replicates: each of the ``redundant`` extra slots goes, one at a time, to the expert whose load per replica
   is the largest (a slot that chose it then takes one replica: ``glm_ep.mlp.expert_map``'s rule) among those
   with fewer replicas than ranks (``redundant`` is at most ``E * (ep - 1)``);
2. packs the ``P = E + redundant`` physical slots onto the ``ep`` groups, ``P / ep`` each (equal counts:
   every rank holds as many experts): heaviest first (load per replica), each onto the least-loaded group with
   room that does not hold that expert yet.

The file (JSON) holds, per sparse layer, the experts of each EP rank in order: rank ``g`` holds physical slots
``[g*P/ep, (g+1)*P/ep)``. The topology's ``expert_placement = "FILE"`` loads it (``read``): the router still
ranks all experts, the dispatch maps global ids to slots through a per-layer table, and the placement's digest
joins the ranks' fingerprint. A file that does not cover every expert exactly (missing, duplicated past its
``redundant`` slots, twice on one rank), names a rank outside ``ep``, or another layer count is refused by name.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glm_ep.config.model import ModelConfig, parse_json
from glm_ep.errors import ConfigError, not_a_file

FORMAT = "glm_ep expert placement 1"


@dataclass(frozen=True)
class ExpertPlacement:
    """Per sparse layer, the expert in each physical slot (``phys_expert[j]``: [P] for ``layers[j]``)."""

    ep: int
    num_experts: int
    redundant: int
    layers: tuple[int, ...]
    phys_expert: tuple[np.ndarray, ...]

    @property
    def slots(self) -> int:
        return self.num_experts + self.redundant

    def held(self, layer: int, ep_rank: int) -> list[int]:
        """The experts EP rank ``ep_rank`` holds at model layer ``layer``, in slot order."""
        per = self.slots // self.ep
        return self.phys_expert[self.layers.index(layer)][ep_rank * per:(ep_rank + 1) * per].tolist()

    def to_json(self) -> dict:
        per = self.slots // self.ep
        return {"format": FORMAT, "ep": self.ep, "num_experts": self.num_experts, "redundant": self.redundant,
                "layers": {str(i): [p[g * per:(g + 1) * per].tolist() for g in range(self.ep)]
                           for i, p in zip(self.layers, self.phys_expert)}}

    @property
    def digest(self) -> str:
        return hashlib.blake2b(json.dumps(self.to_json(), sort_keys=True).encode(), digest_size=16).hexdigest()

    def save(self, path: str | Path) -> Path:
        """JSON, one line per rank's experts."""
        raw = self.to_json()
        head = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in raw.items() if k != "layers")
        layers = ",\n".join(f"  {json.dumps(i)}: [\n" + ",\n".join(f"   {json.dumps(r)}" for r in ranks) + "\n  ]"
                             for i, ranks in raw["layers"].items())
        from glm_ep.app.files import replacing

        p = Path(path)
        with replacing(p) as tmp:  # a write cut short leaves no partial placement
            tmp.write_text("{\n" + head + ',\n "layers": {\n' + layers + "\n }\n}\n")
        return p


def replicate(load_E: np.ndarray, redundant: int, most: int | None = None) -> np.ndarray:
    """int64 [E]: replicas per expert, each of the ``redundant`` extra ones given to the largest load per
    replica (ties: the lower id) among the experts with fewer than ``most`` (the ranks: one copy a rank)."""
    load = np.asarray(load_E, dtype=np.float64)
    nrep = np.ones(load.size, dtype=np.int64)
    if most is not None and redundant > load.size * (most - 1):
        raise ValueError(f"{redundant} replicas of {load.size} experts at most {most} each")
    for _ in range(redundant):
        share = load / nrep
        if most is not None:
            share[nrep >= most] = -np.inf
        nrep[int(np.argmax(share))] += 1
    return nrep


def pack(load_E: np.ndarray, nrep_E: np.ndarray, ep: int) -> np.ndarray:
    """int32 [P]: the expert of each physical slot, group-major, ``P / ep`` a group, heaviest first onto the
    least-loaded group with room (never two replicas of one expert in a group where another group has room)."""
    per = int(nrep_E.sum()) // ep
    share = np.asarray(load_E, dtype=np.float64) / nrep_E
    items = [e for e in np.argsort(-share, kind="stable").tolist() for _ in range(int(nrep_E[e]))]
    groups: list[list[int]] = [[] for _ in range(ep)]
    weight = np.zeros(ep)
    for e in items:
        room = [g for g in range(ep) if len(groups[g]) < per]
        fresh = [g for g in room if e not in groups[g]] or room
        g = min(fresh, key=lambda g: (weight[g], g))
        groups[g].append(e)
        weight[g] += share[e]
    spread(groups)
    return np.array([e for g in groups for e in sorted(g)], dtype=np.int32)


def spread(groups: list[list[int]]) -> list[list[int]]:
    """``groups`` with no expert twice in one group, in place: where the greedy packing had to put a replica into a
    group that holds its expert already (the groups without it full), that copy swaps with an expert of a group
    that lacks it, one the first group lacks. Where an expert has no more copies than groups (``replicate``'s cap),
    such a group and such an expert always exist: the first group holds fewer distinct experts than its size, the
    other group none of the expert."""
    for items in groups:
        for i, e in enumerate(items):
            if items.count(e) < 2:
                continue
            other = next((o for o in groups if e not in o), None)  # none: more copies than groups (uncapped)
            if other is not None:
                j = next(j for j, f in enumerate(other) if f not in items)
                items[i], other[j] = other[j], e
    return groups


def balanced_placement(logical_count_LE: np.ndarray, layers: tuple[int, ...], ep: int,
                       redundant: int = 0) -> ExpertPlacement:
    """EPLB per layer from recorded loads (the module's docstring); ConfigError by name where the slots do not
    split evenly over ``ep``."""
    counts = np.asarray(logical_count_LE)
    e = counts.shape[1]
    if ep < 1 or redundant < 0 or (e + redundant) % ep:
        raise ConfigError(f"--ep {ep} --redundant {redundant}: {e} experts + {redundant} replicas = {e + redundant} "
                          f"slots do not split evenly over ep = {ep}; expected ep to divide experts + redundant")
    if redundant > e * (ep - 1):
        raise ConfigError(f"--ep {ep} --redundant {redundant}: a rank holds an expert at most once, so {e} experts "
                          f"take at most {e} x (ep - 1) = {e * (ep - 1)} replicas; expected --redundant <= "
                          f"{e * (ep - 1)}")
    phys = tuple(pack(c, replicate(c, redundant, most=ep), ep) for c in counts)
    return ExpertPlacement(ep, e, redundant, tuple(layers), phys)


def read(path: str | Path, model: ModelConfig, ep: int) -> ExpertPlacement:
    """The placement in ``path`` for ``model`` at ``ep``, checked: ConfigError naming the file and the fault."""
    p = Path(path)
    if (problem := not_a_file(p, "expert placement file")) is not None:  # missing, or a folder, a FIFO ...
        raise ConfigError(f"{problem} (topology expert_placement); expected a file written by glm-ep balance")
    raw = parse_json(p.read_bytes(), str(p))

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{p}: {what}")

    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise bad(f"not an expert placement (format {raw.get('format') if isinstance(raw, dict) else raw!r}); "
                  f"expected {FORMAT!r}, written by glm-ep balance")
    e, red, file_ep = raw.get("num_experts"), raw.get("redundant", 0), raw.get("ep")
    if e != model.n_routed_experts:
        raise bad(f"num_experts = {e!r}, the model has {model.n_routed_experts}; expected a placement of this model")
    if not isinstance(red, int) or isinstance(red, bool) or red < 0 or (e + red) % ep:
        raise bad(f"redundant = {red!r}: {e} experts + replicas do not split evenly over ep = {ep}")
    if file_ep != ep:
        raise bad(f"ep = {file_ep!r}, the topology has ep = {ep}; expected a placement made for ep = {ep}")
    layers_raw = raw.get("layers")
    want = [str(i) for i in model.sparse_layers]
    if not isinstance(layers_raw, dict) or sorted(layers_raw, key=_as_int) != want:
        got = sorted(layers_raw, key=_as_int) if isinstance(layers_raw, dict) else layers_raw
        raise bad(f"layers {got!r} ({len(got) if isinstance(got, list) else '?'} layers); expected the model's "
                  f"{len(want)} sparse layers {want}")
    per = (e + red) // ep
    phys = tuple(_layer(layers_raw[i], i, ep, per, e, red, bad) for i in want)
    return ExpertPlacement(ep, e, red, tuple(model.sparse_layers), phys)


def _as_int(key: str) -> tuple[int, str]:
    return (int(key), key) if key.isdigit() else (1 << 62, key)


def _layer(ranks: object, layer: str, ep: int, per: int, e: int, red: int, bad) -> np.ndarray:
    if not isinstance(ranks, list) or len(ranks) != ep:
        n = len(ranks) if isinstance(ranks, list) else "not a list of"
        extra = f" (rank {ep} is outside ep = {ep})" if isinstance(ranks, list) and len(ranks) > ep else ""
        raise bad(f"layer {layer}: {n} ranks{extra}; expected one list of experts for each of the ep = {ep} ranks")
    for g, held in enumerate(ranks):
        if not isinstance(held, list) or len(held) != per or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                     and 0 <= x < e for x in held):
            raise bad(f"layer {layer}, rank {g}: {held!r}; expected {per} expert ids in 0..{e - 1}")
        if len(set(held)) != len(held):
            raise bad(f"layer {layer}, rank {g}: expert {_first_repeat(held)} twice on one rank; expected each "
                      "expert at most once a rank")
    flat = [x for held in ranks for x in held]
    count = np.bincount(flat, minlength=e)
    missing = np.flatnonzero(count == 0).tolist()  # (the lists' lengths fixed, a duplicate leaves one missing)
    if missing:
        dup = np.flatnonzero(count > 1).tolist()
        dups = f", experts {_few(dup)} placed more than once" if dup else ""
        raise bad(f"layer {layer}: experts {_few(missing)} are missing{dups}; expected every expert 0..{e - 1} exactly "
                  f"once, plus the file's redundant = {red} replicas")
    return np.array(flat, dtype=np.int32)


def _few(ids: list[int]) -> str:
    return str(ids[:8])[:-1] + (", ...]" if len(ids) > 8 else "]")


def _first_repeat(xs: list[int]) -> int:
    seen: set[int] = set()
    return next(x for x in xs if x in seen or seen.add(x))

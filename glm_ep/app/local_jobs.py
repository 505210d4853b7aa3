"""The commands that run in one process, without MPI: ``synth`` (a synthetic checkpoint), ``make-input`` (a
``forward`` input) and ``footprint`` (weight and workspace footprints from a config alone); ``balance`` is in
``balance_job``. ``glm_ep.app.cli`` parses their flags and calls them."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Callable, Iterator

from glm_ep.app.launcher import one_process
from glm_ep.errors import ConfigError, InputError


def synth_job(args: argparse.Namespace) -> int:
    from glm_ep.config.presets import preset
    from glm_ep.checkpoint.synth import write_synthetic

    one_process("synth writes one checkpoint")
    from glm_ep.checkpoint.reader import INDEX_FILE, SINGLE_FILE

    out = Path(args.out)
    held = [n for n in ("config.json", INDEX_FILE, SINGLE_FILE) if (out / n).exists()]
    shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors")) if out.is_dir() else []
    if (held or shards) and not args.force:  # shards alone: a write cut short, whose files would stay beside ours
        what = ", ".join(held) if held else (", ".join(shards[:2])
                                            + (f" and {len(shards) - 2} more shard(s)" if len(shards) > 2 else ""))
        raise InputError(f"{args.out}: already holds a checkpoint ({what}); expected an empty or new folder "
                         "(--force writes over its files)")
    if args.hf_model is not None:  # refused (torch missing, a folder in use) before anything is written
        from glm_ep.hf.pair import check_hf_folder

        check_hf_folder(args.hf_model, args.out, args.force)
    cfg = preset(args.preset)
    for key in ("intermediate_size", "moe_intermediate_size"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if args.layers is not None:
        cut_layers(cfg, args.layers)
    # --force over a checkpoint, cut short once it had begun writing: its shards may be part old, part new, under
    # the old index (refused before writing, the old checkpoint stays whole)
    unmake = (lambda: _unmake_checkpoint(out, (INDEX_FILE, "config.json"))) if held else None
    with _cleaned_if_cut_short(out, unmake):
        path = write_synthetic(args.out, cfg, seed=args.seed, shard_bytes=args.shard_mb * 2**20,
                               router_dtype=args.router_dtype, composite=args.composite, progress=True,
                               dense=args.dense, router_skew=args.router_skew)
    if held or shards:  # --force: the old checkpoint's weight files the new index does not name go (shards of
        # another count stayed beside the new ones); nothing else in the folder is touched
        import json

        new = set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values())
        for old in [*path.glob("model-*-of-*.safetensors"), path / SINGLE_FILE]:
            if old.is_file() and old.name not in new:
                old.unlink()
    print(f"wrote {path}")
    if args.hf_model is not None:
        from glm_ep.hf.pair import write_hf_model

        with _cleaned_if_cut_short(Path(args.hf_model)):  # the HF twin (the checkpoint itself is whole)
            print(f"wrote {write_hf_model(path, args.hf_model, seed=args.seed)}")
    return 0


@contextlib.contextmanager
def _cleaned_if_cut_short(folder: Path, touched: Callable[[], None] | None = None) -> Iterator[None]:
    """A write into ``folder`` that an error, Ctrl-C or SIGTERM cuts short: what it added goes (all of ``folder``
    where it did not exist); what was there before stays, as the write left it, and ``touched`` runs where the
    write had begun (a file added, or one of the old ones rewritten)."""
    import shutil

    before = set(folder.iterdir()) if folder.is_dir() else None
    stamps = {p: p.stat().st_mtime_ns for p in before or () if p.is_file()}
    try:
        yield
    except BaseException:
        added = set(folder.iterdir()) - before if before is not None and folder.is_dir() else set()
        begun = bool(added) or any(not p.exists() or p.stat().st_mtime_ns != t for p, t in stamps.items())
        if before is None:
            shutil.rmtree(folder, ignore_errors=True)
        for p in added:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        if begun and touched is not None:
            touched()
        raise


def _unmake_checkpoint(folder: Path, names: tuple[str, ...]) -> None:
    """A --force write cut short over a checkpoint: the old index and config.json would present shards of two
    seeds (or shapes) as one checkpoint that loads. They go, so nothing loads the folder and a new synth refuses
    it by its shards until --force writes it whole; said on stderr."""
    import sys

    for name in names:
        (folder / name).unlink(missing_ok=True)
    print(f"glm-ep: {folder}: the write over its checkpoint was cut short, so its shards may be part old, part new: "
          f"its {' and '.join(names)} were removed, so nothing loads it; expected `glm-ep synth --force` again",
          file=sys.stderr, flush=True)


def cut_layers(cfg: dict[str, Any], n: int) -> None:
    """``cfg``'s schedule cut to ``n`` layers, keeping at least one sparse layer (a checkpoint of dense layers alone
    would leave the routed experts, the point of the model, untested): the last layer turns sparse where the cut
    would hold none, and the log says so."""
    cfg["num_hidden_layers"] = n
    if "mlp_layer_types" in cfg:  # the schedule itself (a first_k_dense_replace beside it could contradict it)
        types = (cfg["mlp_layer_types"] * n)[:n]
        dense = n - 1 if "sparse" not in types else None
        cfg["mlp_layer_types"] = types[:-1] + ["sparse"] if dense is not None else types
    else:
        k = cfg.get("first_k_dense_replace", 0)
        dense = n - 1 if k >= n else None
        cfg["first_k_dense_replace"] = min(k, n - 1)
    if dense is not None:
        logging.getLogger(__name__).info("--layers %d: layer %d is sparse (the preset's first layers are dense); a "
                                         "synthetic checkpoint keeps at least one sparse layer", n, n - 1)


def footprint_job(args: argparse.Namespace) -> int:
    from glm_ep.config.model import ModelConfig
    from glm_ep.mlp.runtime import report_lines, site_config
    from glm_ep.config.presets import preset
    from glm_ep.config.topology import Topology

    model = (ModelConfig.from_dict(preset(args.preset), source=f"preset {args.preset}") if args.preset
             else ModelConfig.from_file(f"{args.model}/config.json"))
    topo = Topology.load(args.topology) if args.topology is not None else Topology(name="footprint")
    tp, ep = args.tp or (topo.tp if args.topology else 1), args.ep or (topo.ep if args.topology else 1)
    moe_tp = args.moe_tp or (topo.moe_tp if args.topology else 1)
    lcm = math.lcm(tp, ep * moe_tp)  # the smallest world both divide
    if args.topology and topo.world % lcm:  # a job on it would refuse them: so does its footprint
        raise ConfigError(f"topology {topo.name!r}: tp = {tp}, ep = {ep}, moe_tp = {moe_tp} do not divide its world = "
                          f"{topo.world} (ep * moe_tp and tp must); expected degrees that divide it, or no --topology "
                          "(world = lcm(tp, ep * moe_tp))")
    world = topo.world if args.topology else lcm
    topo = dataclasses.replace(topo, world=world, tp=tp, ep=ep, moe_tp=moe_tp,
                               workspace_rows=args.rows or topo.workspace_rows,
                               shared_workspace=topo.shared_workspace and not args.per_layer)
    cfg = site_config(model, topo, 0)
    from glm_ep.app.footprint import weight_bytes_per_rank

    if args.model and args.dense is not None:
        raise InputError(f"--dense {args.dense} with --model: the checkpoint says how its dense FFNs are stored; "
                         "expected --dense with --preset only")
    dense_nvfp4, router_itemsize = args.dense == "nvfp4", 2
    if args.model:  # how the checkpoint stores its dense FFNs and its routers, from the headers
        from glm_ep.checkpoint.reader import Checkpoint
        from glm_ep.checkpoint.layers import dense_is_nvfp4

        with Checkpoint(args.model, check_finite=False) as ck:
            if ck.note:  # both weight layouts in the folder: which one is read
                logging.getLogger(__name__).warning("%s", ck.note)
            if "dense" in model.mlp_layer_types:
                dense_nvfp4 = dense_is_nvfp4(ck, model.mlp_layer_types.index("dense"))
            if "sparse" in model.mlp_layer_types:
                router = f"{ck.layer_prefix(model.mlp_layer_types.index('sparse'))}.mlp.gate.weight"
                router_itemsize = 4 if ck.info(router).dtype == "F32" else 2
    from glm_ep.mlp.site import site_buffers

    from glm_ep.balance import expert_load
    from glm_ep.balance.report import decode_row_line

    load = expert_load.read(args.expert_load, model) if args.expert_load else None
    # the scratch rank 0's sites declare (it holds a dense FFN's shard), as the load makes it on the NumPy backend
    buffers = site_buffers(cfg, topo.levers, dense_nvfp4 and bool(model.dense_layers))
    for line in report_lines(model, topo, weight_bytes_per_rank(model, topo, dense_nvfp4, router_itemsize), buffers):
        print(line)
    if model.sparse_layers:
        print(decode_row_line(model, topo.ep, topo.moe_tp, load))
    return 0


def make_input_job(args: argparse.Namespace) -> int:
    """A ``forward`` input: ``hidden_states`` bf16 ``[rows, hidden]``, standard normal values from ``--seed``."""
    import ml_dtypes
    import numpy as np

    from glm_ep.app.files import check_output_path, save_readable
    from glm_ep.config.model import ModelConfig

    one_process("make-input writes one file")
    hidden = args.hidden if args.model is None else ModelConfig.from_file(Path(args.model) / "config.json").hidden_size
    out = check_output_path(args.out)
    try:
        x = np.random.default_rng(args.seed).standard_normal((args.rows, hidden)).astype(ml_dtypes.bfloat16)
    except MemoryError as e:
        raise InputError(f"--rows {args.rows}: {args.rows} rows of hidden {hidden}, drawn in float64, do not fit in "
                         f"memory ({e}); expected fewer rows") from None
    try:
        save_readable({"hidden_states": x}, out)
    except OSError as e:
        raise InputError(f"{out}: cannot write the input ({e.strerror or e})") from None
    print(f"wrote {out}: hidden_states bf16 [{args.rows}, {hidden}] (seed {args.seed})")
    return 0

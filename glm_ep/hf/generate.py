"""``glm-ep generate``: greedy generation through a transformers ``glm5_next`` model whose MLPs glm_ep serves.

    mpiexec -n 2 glm-ep generate --model DIR --hf-model HF_DIR --prompt-ids 1,2,3 --max-new-tokens 16 [--compare]

Every rank loads the glm_ep checkpoint (its share of each site) and the whole HF model (on the rank's glm_ep device:
its CUDA device, or the CPU on the NumPy backend), attaches the one to the other (``glm_ep.hf.attach``) and runs
the same greedy loop (``greedy``); attention, KV cache and lm head are HF's, replicated. Rank 0 prints the tokens
and tokens/s of the prefill and of the decode steps, the slowest rank's times after ``--warmup`` untimed
generations. ``--compare`` first generates with HF's own MLPs on every rank (before they are replaced) and prints
where the two first differ and how far their logits are apart (``compare``). The ranks agree on the tokens they
generated: a rank whose attention computed otherwise is an error on every rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

from glm_ep.errors import EXIT_FAIL, EXIT_OK, InputError

#: the ids a prompt may hold at most, as the command line gives them (a longer prompt is a file's job)
MAX_PROMPT_IDS = 65536


def token_ids(text: str) -> list[int]:
    """An argparse type: comma-separated token ids >= 0 (``1,2,3``)."""
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids (e.g. 1,2,3)") from None
    if any(i < 0 for i in ids) or len(ids) > MAX_PROMPT_IDS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 1..{MAX_PROMPT_IDS} token ids, each >= 0")
    return ids


def add_arguments(p: argparse.ArgumentParser, count: Callable[[int], Callable[[str], int]]) -> None:
    """The ``generate`` subcommand's own flags (the layout flags are the CLI's); ``count(n)``: an integer >= n."""
    p.add_argument("--model", required=True, help="the glm_ep checkpoint whose sites serve the MLPs")
    p.add_argument("--hf-model", required=True, help="the transformers glm5_next model (glm-ep synth --hf-model "
                   "writes one whose MLPs are the checkpoint's)")
    p.add_argument("--prompt-ids", required=True, type=token_ids, help="the prompt as token ids: 1,2,3")
    p.add_argument("--max-new-tokens", type=count(1), default=16)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the torch model's dtype (glm_ep's sites read and write bf16 either way)")
    p.add_argument("--warmup", type=count(0), default=1, help="untimed generations before the timed one")
    p.add_argument("--compare", action="store_true", help="also generate with HF's own MLPs; print where the two "
                   "first differ and how far their logits are apart")
    p.add_argument("--check-calls", action="store_true", help="the ranks agree each site's input bits "
                   "(the topology's check_calls: a debugging aid)")
    p.add_argument("--out", help="also write the result as markdown here (e.g. docs/perf/GENERATE_H100.md)")


def load_model(path: str, dtype: str, device: int | None) -> Any:
    """The ``Glm5NextForConditionalGeneration`` in folder ``path``, ``dtype``, on CUDA ``device`` (None: the
    CPU), in eval mode; InputError where it is not a complete transformers glm5_next model."""
    from glm_ep.hf import deps

    torch, hf = deps.torch(), deps.glm5_next()
    config = Path(path) / "config.json"
    try:
        model_type = json.loads(config.read_bytes()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise InputError(f"--hf-model {path}: cannot read {config.name} ({e}); expected the folder of a transformers "
                         "glm5_next model (glm-ep synth --hf-model writes one)") from None
    if model_type != "glm5_next":
        raise InputError(f"--hf-model {path}: model_type {model_type!r} in {config.name}; expected 'glm5_next'")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report: what is wrong is said below, once
    try:
        model, info = hf.Glm5NextForConditionalGeneration.from_pretrained(path, dtype=getattr(torch, dtype),
                                                                         output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - whatever transformers makes of the folder: the user's to mend
        raise InputError(f"--hf-model {path}: transformers cannot load it as a glm5_next model "
                         f"({type(e).__name__}: {e})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        raise InputError(f"--hf-model {path}: no weights for {len(missing)} tensor(s) of the model "
                         f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}); expected every one stored "
                         "(transformers would make them up at random)")
    return model.to(torch.device("cuda", device) if device is not None else torch.device("cpu")).eval()


def _check_prompt(ids: list[int], model: Any) -> None:
    vocab = model.config.get_text_config().vocab_size
    if max(ids) >= vocab:
        raise InputError(f"--prompt-ids: token {max(ids)} is outside the model's vocabulary (ids 0..{vocab - 1})")


def _quiet_transformers(rank: int, verbose: bool) -> None:
    """No weight-loading bars; ranks other than 0 print transformers' errors only (unless -v), as glm_ep's own."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if rank != 0 and not verbose:
        hf_logging.set_verbosity_error()


def generate_job(args: argparse.Namespace, ranks: Any) -> int:
    from glm_ep.api import GlmMlp
    from glm_ep.app.files import check_output_path
    from glm_ep.app.jobs import agreed_topology
    from glm_ep.hf import deps
    from glm_ep.mlp.runtime import load_runtime, open_checkpoint

    topo = agreed_topology(args, ranks)
    if args.check_calls:
        topo = dataclasses.replace(topo, check_calls=True)
    if args.out is not None:  # never over a file the job reads
        reads = [(f"a file of the {flag} folder ({name})", Path(folder) / name)
                 for flag, folder in (("--model", args.model), ("--hf-model", args.hf_model))
                 for name in ("config.json", "model.safetensors", "model.safetensors.index.json")]
        ranks.agree("output check", lambda: check_output_path(args.out, reads) if ranks.rank == 0 else None)
    ranks.agree("transformers import", deps.glm5_next)  # torch missing on one rank: an error on every rank
    _quiet_transformers(ranks.rank, args.verbose)
    mlp = GlmMlp(load_runtime(open_checkpoint(args.model, topo, ranks), topo, ranks), ranks)
    model = ranks.agree("transformers model load", lambda: load_model(args.hf_model, args.dtype, mlp.device))
    ranks.agree("prompt check", lambda: _check_prompt(args.prompt_ids, model))
    ref = _reference(model, args) if args.compare else None
    from glm_ep.hf.attached import attach  # torch is there by now
    from glm_ep.hf.compare import compare
    from glm_ep.hf.greedy import greedy

    attach(model, mlp)
    for _ in range(args.warmup):
        greedy(model, args.prompt_ids, args.max_new_tokens)
    got = greedy(model, args.prompt_ids, args.max_new_tokens, keep_logits=ref is not None)
    _agree_tokens(ranks, got.tokens)
    times = ranks.allgather("generation times", (got.prefill_s, got.decode_s))
    lines: list[str] = []
    explained = True
    if ranks.rank == 0:
        lines = _report(args, got, max(t[0] for t in times), max(t[1] for t in times), mlp, model)
        if ref is not None:
            verdict = compare(ref.tokens, ref.logits, got.tokens, got.logits, ref.margins)
            lines += verdict.lines()
            explained = verdict.explained
            if not explained:
                print("glm-ep: compare FAILED: glm_ep's logits differ from HF's own MLPs' by more than rounding "
                      "explains (the compare lines above say how)", file=sys.stderr, flush=True)
        print("\n".join(lines), flush=True)
    if args.out is not None:  # rank 0 writes; a failure is every rank's error
        ranks.agree("output write", lambda: _write_markdown(Path(args.out), lines, _device_name(model))
                    if ranks.rank == 0 else None)
    # --compare: a difference rounding does not explain fails the job on every rank, as run's check does
    return EXIT_OK if ranks.allgather("compare verdict", explained)[0] else EXIT_FAIL


def _reference(model: Any, args: argparse.Namespace) -> Any:
    """The greedy generation with HF's own MLPs, its logits and routing margins kept."""
    from glm_ep.hf.greedy import RouterMargins, greedy

    margins = RouterMargins(model)
    try:
        return greedy(model, args.prompt_ids, args.max_new_tokens, keep_logits=True, margins=margins)
    finally:
        margins.remove()


def _agree_tokens(ranks: Any, tokens: list[int]) -> None:
    from glm_ep.dist.ranks import AgreedError

    every = ranks.allgather("generated tokens", tokens)
    if any(t != every[0] for t in every):
        per_rank = "\n".join(f"  rank {r}: {t}" for r, t in enumerate(every))
        raise AgreedError("the ranks generated different tokens: their replicated attention computed otherwise, so "
                          "their sites summed partials of different inputs; expected the same model, prompt and "
                          "deterministic kernels on every rank (--check-calls names the first site whose inputs "
                          f"differ):\n{per_rank}")


def _report(args: argparse.Namespace, got: Any, prefill_s: float, decode_s: float, mlp: Any, model: Any) -> list[str]:
    import transformers

    decoded = len(got.tokens) - 1
    t = mlp.topology
    device = next(model.parameters()).device
    rows = [("prefill", len(args.prompt_ids), prefill_s), ("decode", decoded, decode_s)]
    lines = [f"prompt: {len(args.prompt_ids)} token(s) {args.prompt_ids}",
             f"generated: {len(got.tokens)} token(s) {got.tokens}",
             f"{'phase':<8} {'tokens':>7} {'total ms':>10} {'tokens/s':>10}"]
    lines += [f"{phase:<8} {n:>7} {s * 1e3:>10.3f} {(f'{n / s:.1f}' if n and s > 0 else '-'):>10}"
              for phase, n, s in rows]
    lines.append(f"(glm_ep: backend {t.backend}, world {t.world}, tp {t.tp}, ep {t.ep}, {mlp.num_layers} MLP sites; "
                 f"attention, KV cache and lm head: HF transformers {transformers.__version__}, torch {args.dtype} on "
                 f"{device}, on every rank; the slowest rank's times after {args.warmup} warm-up generation(s))")
    return lines


def _device_name(model: Any) -> str:
    device = next(model.parameters()).device
    if device.type == "cuda":
        from glm_ep.hf import deps

        return deps.torch().cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def _write_markdown(path: Path, lines: list[str], device: str) -> None:
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = [f"# glm-ep generate: {device}", "", f"Command: `glm-ep {' '.join(sys.argv[1:])}`  ", f"Date: {date}", "",
            "```text", *lines, "```", ""]
    path.write_text("\n".join(text))

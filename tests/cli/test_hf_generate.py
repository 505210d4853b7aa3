"""``glm-ep synth --hf-model`` and ``glm-ep generate`` as a user runs them, on one and two ranks; what they refuse
(one clear message, exit 2, on every rank); and a library caller whose ranks do not all call the attached model
(the job ends past ``collective_timeout_s``, never hangs). Skipped without torch or a transformers with
``glm5_next``.
"""

from __future__ import annotations

import json
import re
import textwrap

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

from glm_ep.errors import EXIT_FAIL, EXIT_STALL  # noqa: E402

from cli_jobs import fails, glm_ep, mpiexec  # noqa: E402
from helpers import REPO  # noqa: E402
from hf_pair import write_pair  # noqa: E402

PROMPT = "1,2,3"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The pair as the README makes it: ``glm-ep synth --preset tiny --out DIR --hf-model HF``."""
    folder = tmp_path_factory.mktemp("generate")
    r = glm_ep(1, "synth", "--preset", "tiny", "--out", str(folder / "glm"), "--hf-model", str(folder / "hf"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-2:] == [f"wrote {folder / 'glm'}", f"wrote {folder / 'hf'}"]
    return folder / "glm", folder / "hf"


def _tokens(stdout: str) -> list[int]:
    found = re.search(r"^generated: 16 token\(s\) \[([\d, ]+)\]$", stdout, re.M)
    assert found, stdout
    return [int(t) for t in found.group(1).split(",")]


def test_generate_on_two_ranks_prints_tokens_rates_and_the_comparison(pair, tmp_path) -> None:
    glm, hf = pair
    out = tmp_path / "GENERATE.md"
    r = glm_ep(2, "generate", "--model", str(glm), "--hf-model", str(hf), "--prompt-ids", PROMPT,
               "--max-new-tokens", "16", "--warmup", "0", "--compare", "--check-calls", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "prompt: 3 token(s) [1, 2, 3]" and len(_tokens(r.stdout)) == 16
    rates = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(prefill|decode) +(\d+) +[\d.]+ +[\d.]+$",
                                                              r.stdout, re.M)}
    assert rates == {"prefill": 3, "decode": 15}, r.stdout
    assert "(glm_ep: backend cpu, world 2, tp 2, ep 2, 4 MLP sites;" in r.stdout
    compare = [line for line in lines if line.startswith("compare: ")]
    assert len(compare) == 2 and "smallest routing margin in HF's routers" in compare[1], r.stdout
    assert ("HF's own MLPs generate the same 16 tokens" in compare[0]
            or "first difference at new token" in compare[0]), r.stdout
    assert r.stdout.count("generated:") == 1, "a rank other than 0 printed"
    text = out.read_text()
    assert text.startswith("# glm-ep generate: CPU") and "--prompt-ids 1,2,3" in text
    assert all(line in text for line in lines), text


def test_compare_against_another_model_fails_the_job(pair, tmp_path) -> None:
    """``--compare`` with an HF model from another seed: the logits are as far apart as two unrelated models', so
    the job fails (exit 3, as run's check does) on every rank, after printing the comparison that says why."""
    glm, _ = pair
    r = glm_ep(1, "synth", "--preset", "tiny", "--seed", "7", "--out", str(tmp_path / "glm7"), "--hf-model",
               str(tmp_path / "hf7"))
    assert r.returncode == 0, r.stderr[-3000:]
    r = glm_ep(2, "generate", "--model", str(glm), "--hf-model", str(tmp_path / "hf7"), "--prompt-ids", PROMPT,
               "--max-new-tokens", "4", "--warmup", "0", "--compare")
    assert r.returncode == EXIT_FAIL, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "compare: the logits are as far apart as two unrelated models'" in r.stdout, r.stdout
    assert r.stderr.count("glm-ep: compare FAILED") == 1, r.stderr[-3000:]  # once, by rank 0
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_the_pair_is_written_once(pair, tmp_path) -> None:
    glm, hf = pair
    r = glm_ep(1, "synth", "--out", str(tmp_path / "new"), "--hf-model", str(hf))
    fails(r, f"--hf-model {hf}: already holds a model (config.json, model.safetensors); expected an empty or new "
          "folder (--force writes over its files)")
    assert not (tmp_path / "new").exists(), "the checkpoint was written before the refusal"


def test_generate_refuses_a_model_of_another_shape_and_bad_arguments(pair, tmp_path) -> None:
    """One clear message, exit 2. (A model of another shape on one rank of two, the refusals of load_model and of
    the prompt: held in-process, tests/mpi/test_hf_attach_mpi.py and tests/unit/test_hf_attach.py.)"""
    glm, hf = pair
    _, hf3 = write_pair(tmp_path, layers=3)
    r = glm_ep(1, "generate", "--model", str(glm), "--hf-model", str(hf3), "--prompt-ids", PROMPT, "--warmup", "0")
    fails(r, "the transformers model and the glm_ep checkpoint differ: num_hidden_layers 3 in the model, 4 in the "
          "checkpoint; mlp_layer_types ['dense', 'sparse', 'sparse'] in the model")
    r = glm_ep(2, "generate", "--model", str(glm), "--hf-model", str(hf), "--prompt-ids", "1,x")
    fails(r, "argument --prompt-ids: '1,x' is not a comma-separated list of token ids (e.g. 1,2,3)")
    r = glm_ep(2, "generate", "--model", str(glm), "--hf-model", str(hf), "--prompt-ids", PROMPT, "--out",
               str(hf / "config.json"))
    fails(r, "is a file of the --hf-model folder (config.json); expected another path")


_SOME_RANKS = textwrap.dedent("""
    import sys
    import torch
    from mpi4py import MPI
    import glm_ep
    from glm_ep.hf import attach
    from glm_ep.hf.generate import load_model

    mlp = glm_ep.load(sys.argv[1], glm_ep.Topology(name="short", world=2, tp=2, ep=2, collective_timeout_s=3))
    model = attach(load_model(sys.argv[2], "bfloat16", None), mlp)
    if MPI.COMM_WORLD.Get_rank() == 0:  # rank 1 leaves the model alone
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
    print(f"rank {MPI.COMM_WORLD.Get_rank()} passed the call", flush=True)
""")


def test_a_call_on_some_ranks_only_ends_the_job(pair, tmp_path) -> None:
    """Rank 0 runs the model, rank 1 does not: rank 0 waits at the first site's all-reduce, and past
    ``collective_timeout_s`` names itself and the site and ends the job (exit 4) on every rank."""
    glm, hf = pair
    script = tmp_path / "some_ranks.py"
    script.write_text(_SOME_RANKS)
    r = mpiexec(2, str(script), str(glm), str(hf))
    assert r.returncode == EXIT_STALL, (r.returncode, r.stderr[-3000:])
    assert re.search(r"\[rank 0\] glm-ep: error: rank 0 waited [\d.]+ s at '[^']+' for the other ranks "
                     r"\(collective_timeout_s = 3\)", r.stderr), r.stderr[-3000:]
    assert "rank 0 passed the call" not in r.stdout


# appended to the README's example: each rank's new tokens, in a file of its own (their prints may interleave)
_SAVE_TOKENS = """
import json
from mpi4py import MPI
with open(f"tokens-{MPI.COMM_WORLD.Get_rank()}.json", "w") as f:
    json.dump(ids[0, 3:].tolist(), f)
"""


def test_the_readme_example_generates_on_two_ranks(pair, tmp_path) -> None:
    """The README's Python example ("Use it from transformers") under ``mpiexec -n 2``, on the pair in
    ``.cache/pair``: both ranks generate the same 16 tokens through HF's ``generate``."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Use it from transformers"):]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "pair").symlink_to(pair[0].parent)
    (tmp_path / "example.py").write_text(example + _SAVE_TOKENS)
    r = mpiexec(2, "example.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    tokens = [json.loads((tmp_path / f"tokens-{rank}.json").read_text()) for rank in range(2)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 16, tokens

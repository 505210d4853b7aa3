"""``glm_ep.hf.attach`` under ``mpiexec -n 2`` (tests marked mpi): every rank runs HF's model, its attention
replicated, and its share of each site; the logits and greedy generation held against HF's own modules as on one
rank (``hf_pair``), the ranks' results bit for bit the same, and what must be an error on every rank: a model of
another shape on one rank, ranks whose calls differ (``check_calls``). Each rank writes its own copy of the pairs
(deterministic). Assertions are agreed across ranks (``helpers.agreed``).
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

import glm_ep  # noqa: E402
from glm_ep import AgreedError, Topology  # noqa: E402
from glm_ep.hf import attach  # noqa: E402
from glm_ep.hf.generate import load_model  # noqa: E402

from helpers import agreed  # noqa: E402
from hf_pair import (PROMPT_LENGTHS, generation, load_models, logits, logits_errors, logits_failures,  # noqa: E402
                     prompt, write_pair)

COLLECTIVE_TIMEOUT_S = 30.0
#: (tp, ep) at world 2, and the expert-TP layout where the topology has it
LAYOUTS = [{"tp": 2, "ep": 2}] + ([{"tp": 2, "ep": 1, "moe_tp": 2}]
                                  if "moe_tp" in {f.name for f in dataclasses.fields(Topology)} else [])


def _comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _load(glm, **layout) -> glm_ep.GlmMlp:
    n = _comm().Get_size()
    topo = Topology(**{"name": "hf", "world": n, "tp": n, "ep": n, "check_calls": True,
                       "collective_timeout_s": COLLECTIVE_TIMEOUT_S, **layout})
    return glm_ep.load(glm, topo)


@pytest.fixture(scope="module")
def clear(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("hf-clear"), clear=True)


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def models(clear, request):
    """The clear twin with HF's MLPs and glm_ep's, the sites on every rank's share (``check_calls``: the ranks
    feed every site the same input bits, or the call is an error)."""
    glm, hf = clear
    return load_models(hf, _load(glm, **request.param))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_logits_against_hf_modules_on_two_ranks(models, length) -> None:
    """As the one-rank test holds them; and the ranks hold the same logits, bit for bit."""
    comm = _comm()
    ids = prompt(length)
    errors = logits_errors(models, ids)
    if comm.Get_rank() == 0:
        print(f"prompt {length}: logits relative L2 vs HF fp32 {errors}")
    failures = logits_failures(errors, f"prompt {length}")
    blobs = comm.allgather(logits(models.glm16, ids).tobytes())
    if any(b != blobs[0] for b in blobs):
        failures.append("the ranks' logits differ")
    agreed(comm, failures)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_generation_on_two_ranks_matches_hf_modules(models, dtype) -> None:
    result = generation(models, dtype, [1, 2, 3])
    if _comm().Get_rank() == 0:
        print("\n".join(result.lines()))
    agreed(_comm(), [] if result.explained else [f"{dtype}: {result.lines()}"])


@pytest.mark.mpi(min_size=2)
def test_a_model_of_another_shape_on_one_rank_is_an_error_on_every_rank(clear, tmp_path) -> None:
    comm = _comm()
    glm, hf = clear
    mlp = _load(glm)
    other = hf if comm.Get_rank() == 0 else write_pair(tmp_path, layers=3)[1]
    failures = []
    try:
        attach(load_model(str(other), "bfloat16", None), mlp)
        failures.append("attached")
    except AgreedError as e:
        if "num_hidden_layers 3 in the model, 4 in the checkpoint" not in str(e) or "(on rank 1)" not in str(e):
            failures.append(f"refused otherwise: {e}")
    agreed(comm, failures)


@pytest.mark.mpi(min_size=2)
def test_ranks_whose_calls_differ_are_an_error_on_every_rank(clear) -> None:
    """With ``check_calls``, ranks whose models feed a site other bits (another prompt here; a rank whose attention
    computed otherwise in practice) are refused at that site on every rank; the model then runs on."""
    comm = _comm()
    glm, hf = clear
    model = attach(load_model(str(hf), "bfloat16", None), _load(glm))
    failures = []
    try:
        logits(model, prompt(7, seed=1 + comm.Get_rank()))
        failures.append("computed")
    except AgreedError as e:
        if "ranks hold different calls (differing: input)" not in str(e):
            failures.append(f"refused otherwise: {e}")
    try:
        logits(model, prompt(7))
    except AgreedError as e:
        failures.append(f"the same prompt afterwards: {e}")
    agreed(comm, failures)

"""``glm_ep.hf.attach`` on the CUDA backend with torch CUDA tensors: the same checks as on the CPU
(tests/unit/test_hf_attach.py, ``hf_pair``) with the model and glm_ep on one GPU, and ``glm-ep generate --backend
cuda`` (its tokens/s are what the GPU run records: README "Use it from transformers"). Skipped without CuPy and a
visible GPU, or without a torch built with CUDA and a transformers with ``glm5_next``.
"""

from __future__ import annotations

import re

import pytest

from _cuda import requires_cuda

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

import glm_ep  # noqa: E402
from glm_ep import Topology  # noqa: E402

from cli_jobs import glm_ep as glm_ep_job  # noqa: E402
from hf_pair import (NEW_TOKENS, PROMPT_LENGTHS, SITE_BOUND, generation, load_models, logits_errors,  # noqa: E402
                     logits_failures, prompt, site_errors, write_pair)

pytestmark = [pytest.mark.cuda, requires_cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch without CUDA")]


def _gpu(glm) -> glm_ep.GlmMlp:
    from mpi4py import MPI

    return glm_ep.load(glm, Topology(name="cuda-1", backend="cuda"), comm=MPI.COMM_SELF)


@pytest.fixture(scope="module")
def clear(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("hf-clear"), clear=True)


@pytest.fixture(scope="module")
def models(clear):
    glm, hf = clear
    mlp = _gpu(glm)
    assert mlp.device == 0
    return load_models(hf, mlp)


def test_the_served_mlps_take_and_give_cuda_tensors(models) -> None:
    layer = models.glm16.model.language_model.layers[1].mlp
    x = torch.randn(2, 5, layer.glm_mlp.hidden_size, device="cuda:0")
    for dtype in (torch.float32, torch.bfloat16):
        y = layer(x.to(dtype))
        assert y.is_cuda and y.device == x.device and y.dtype == dtype and y.shape == x.shape


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_sites_inside_the_model_hold_the_contract_on_the_gpu(tmp_path, length) -> None:
    glm, hf = write_pair(tmp_path)
    errors = site_errors(hf, _gpu(glm), prompt(length))
    assert all(0 < e < SITE_BOUND for e in errors), errors


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_logits_against_hf_modules_on_the_gpu(models, length) -> None:
    errors = logits_errors(models, prompt(length))
    print(f"prompt {length}: logits relative L2 {errors}")
    assert not logits_failures(errors, f"prompt {length}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_generation_on_the_gpu_matches_hf_modules(models, dtype) -> None:
    result = generation(models, dtype, [1, 2, 3])
    print("\n".join(result.lines()))
    assert result.tokens == NEW_TOKENS and result.explained, result.lines()


def test_generate_command_on_the_cuda_backend(clear) -> None:
    glm, hf = clear
    r = glm_ep_job(1, "generate", "--model", str(glm), "--hf-model", str(hf), "--prompt-ids", "1,2,3",
                   "--max-new-tokens", "16", "--backend", "cuda", "--compare")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torch bfloat16 on cuda:0" in r.stdout and r.stdout.count("compare: ") == 2, r.stdout
    assert "not explained by rounding" not in r.stdout, r.stdout
    assert re.search(r"^decode +15 +[\d.]+ +[\d.]+$", r.stdout, re.M), r.stdout

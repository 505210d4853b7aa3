"""Expert-load statistics: ``forward`` / ``run --expert-load FILE [--plot]`` and ``GlmMlp.expert_load()``.

The file holds, per sparse layer and expert, how many slots chose it (held against the router applied here to
the same input), each call's rows and choices, and the slots each rank counted itself (held against the
expert ranges of the layout); rank 0 prints the per-rank load per layout. A file of another model, or no load
file at all, is refused by name.
"""

from __future__ import annotations


import numpy as np
import pytest

import glm_ep
from glm_ep.balance import expert_load
from glm_ep.checkpoint.reader import Checkpoint
from glm_ep.errors import ConfigError, InputError
from glm_ep.mlp.routing import RouteParams, router_topk

from ckpt_writer import write_checkpoint
from cli_jobs import fails, glm_ep as glm_ep_job, save_hidden
from helpers import random_x


def _ids(ckpt_dir, layer: int, x: np.ndarray) -> np.ndarray:
    """The router's choices for ``x`` at ``layer``, from the checkpoint's tensors (the router is never sharded)."""
    with Checkpoint(ckpt_dir) as ck:
        m, p = ck.config, ck.layer_prefix(layer)
        router = ck.read(f"{p}.mlp.gate.weight", (m.n_routed_experts, m.hidden_size), ("BF16", "F32"))
        bias = ck.read(f"{p}.mlp.gate.e_score_correction_bias", (m.n_routed_experts,), ("F32",))
    logits = x.astype(np.float32) @ router.astype(np.float32).T
    return router_topk(logits, bias, RouteParams(m.num_experts_per_tok, 2.5, True))[0]


def test_forward_records_what_the_routers_chose(tiny_checkpoint, tmp_path) -> None:
    x = random_x(3, 37, 128)
    load_path = tmp_path / "load.safetensors"
    r = glm_ep_job(2, "forward", "--model", str(tiny_checkpoint), "--input", str(save_hidden(tmp_path / "x.st", x)),
                   "--output", str(tmp_path / "y.st"), "--expert-load", str(load_path))
    assert r.returncode == 0, r.stderr[-3000:]
    load = expert_load.read(load_path)
    assert load.layers == (1, 2, 3) and load.layout == {"world": 2, "tp": 2, "ep": 2, "moe_tp": 1,
                                                        "expert_placement": ""}
    for j, layer in enumerate(load.layers):
        ids = _ids(tiny_checkpoint, layer, x)
        np.testing.assert_array_equal(load.choices[j], ids)
        np.testing.assert_array_equal(load.logical_count[j], np.bincount(ids.reshape(-1), minlength=32))
        assert load.call_rows[j].tolist() == [37]
        # each rank counted the slots of its own expert range (ep 2: 0..15, 16..31)
        assert load.rank_slots[j].tolist() == [int((ids < 16).sum()), int((ids >= 16).sum())]
    assert "expert load: ep 2, 37-row calls (3 site calls): slots per rank" in r.stdout, r.stdout
    assert "expert load: moe_tp 2, 37-row calls (3 site calls): slots per rank 296.00 / 296.00" in r.stdout, r.stdout


def test_run_records_its_calls_and_plots_the_load(tiny_checkpoint, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    load_path = tmp_path / "run-load.safetensors"
    r = glm_ep_job(2, "run", "--model", str(tiny_checkpoint), "--prefill", "12", "--decode", "3", "--verify", "2",
                   "--no-check", "--moe-tp", "2", "--expert-load", str(load_path), "--plot")
    assert r.returncode == 0, r.stderr[-3000:]
    load = expert_load.read(load_path)
    assert [c.tolist() for c in load.call_rows] == [[12, 1, 1, 1, 2]] * 3  # the run's calls, each once
    assert load.layout["moe_tp"] == 2 and load.rank_slots.tolist() == [[17 * 8] * 2] * 3  # every slot, each rank
    assert (tmp_path / "run-load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "expert load: moe_tp 2, 1-row calls (9 site calls): slots per rank 8.00 / 8.00" in r.stdout, r.stdout
    assert "expert load: ep 2, 1-row calls (9 site calls)" in r.stdout, r.stdout


def test_the_library_records_when_asked(tiny_checkpoint, tmp_path) -> None:
    from mpi4py import MPI

    mlp = glm_ep.load(tiny_checkpoint, comm=MPI.COMM_SELF, expert_load=True)
    x = random_x(8, 6, mlp.hidden_size)
    mlp.site(2, x)
    mlp.step(x[:1])
    load = mlp.expert_load()
    assert [c.tolist() for c in load.call_rows] == [[1], [6, 1], [1]]
    np.testing.assert_array_equal(load.choices[1][:6], _ids(tiny_checkpoint, 2, x))
    assert load.logical_count.sum(axis=1).tolist() == [8, 56, 8] and load.rank_slots[:, 0].tolist() == [8, 56, 8]
    again = expert_load.read(load.save(tmp_path / "api.safetensors"), mlp.config)
    np.testing.assert_array_equal(again.logical_count, load.logical_count)
    with pytest.raises(ConfigError, match=r"expert_load\(\): nothing was recorded; expected a model loaded with "):
        glm_ep.load(tiny_checkpoint, comm=MPI.COMM_SELF).expert_load()


def test_a_load_of_another_model_or_no_load_at_all_is_refused_by_name(tiny_checkpoint, tmp_path) -> None:
    from mpi4py import MPI

    mlp = glm_ep.load(tiny_checkpoint, comm=MPI.COMM_SELF, expert_load=True)
    mlp.step(random_x(1, 2, mlp.hidden_size))
    path = mlp.expert_load().save(tmp_path / "tiny-load.safetensors")
    _, other = write_checkpoint(tmp_path / "other", seed=1)
    with Checkpoint(tmp_path / "other") as ck:
        with pytest.raises(InputError, match=r"tiny-load.safetensors: an expert load of another model \("
                                             r"num_hidden_layers 4 in the file, 3 in the model; n_routed_experts 32 in "
                                             r"the file, 16 in the model"):
            expert_load.read(path, ck.config)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InputError, match="junk.safetensors: not a safetensors file"):
        expert_load.read(tmp_path / "junk.safetensors")
    with pytest.raises(InputError, match="nothing.safetensors: expert load file not found"):
        expert_load.read(tmp_path / "nothing.safetensors")
    y = tmp_path / "y.safetensors"
    from safetensors.numpy import save_file

    save_file({"a": np.zeros(1)}, str(y), metadata={"format": "something else"})
    with pytest.raises(InputError, match=r"y.safetensors: format 'something else', expected 'glm_ep expert load 1'"):
        expert_load.read(y)


def test_plot_without_a_load_and_a_load_over_the_input_or_output_are_refused_on_every_rank(tiny_checkpoint, tmp_path) -> None:
    x = save_hidden(tmp_path / "x.st", random_x(3, 2, 128))
    r = glm_ep_job(2, "forward", "--model", str(tiny_checkpoint), "--input", str(x), "--output",
                   str(tmp_path / "y.st"), "--plot")
    fails(r, "--plot draws the load --expert-load records; expected --expert-load FILE with it")
    r = glm_ep_job(2, "forward", "--model", str(tiny_checkpoint), "--input", str(x), "--output",
                   str(tmp_path / "y.st"), "--expert-load", str(x))
    fails(r, f"--expert-load {x}: is the --input file; expected another path")
    y = tmp_path / "y.st"  # the output, not written yet: the load would overwrite it after the forward wrote it
    r = glm_ep_job(2, "forward", "--model", str(tiny_checkpoint), "--input", str(x), "--output", str(y),
                   "--expert-load", str(y))
    fails(r, f"--expert-load {y}: is the --output file; expected another path")
    assert not y.exists()


def test_footprint_says_the_decode_rows_busiest_rank_against_the_mean(tiny_checkpoint, tmp_path) -> None:
    """Uniform routing at the GLM shape: ~1.27x at ep 2, exactly 1 at moe_tp 2; from a recorded load where given,
    and a load of another model refused by name."""
    import subprocess
    import sys

    from cli_jobs import mpi_env
    from helpers import REPO

    def footprint(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "glm_ep", "footprint", *args], capture_output=True, text=True,
                              timeout=120, env=mpi_env(), cwd=REPO)

    ep2, tp2 = footprint("--preset", "glm-5.3-flash", "--ep", "2"), footprint("--preset", "glm-5.3-flash", "--moe-tp",
                                                                               "2")
    assert "(ep 2; uniform routing, 20000 seeded draws): the busiest rank reads 71.9" in ep2.stdout, ep2.stdout
    assert ": 1.27" in ep2.stdout.splitlines()[-1], ep2.stdout
    assert "(moe_tp 2; uniform routing, 20000 seeded draws): the busiest rank reads 56.62 MB, the mean 56.62 MB: " \
           "1.000x" in tp2.stdout, tp2.stdout
    from mpi4py import MPI

    mlp = glm_ep.load(tiny_checkpoint, comm=MPI.COMM_SELF, expert_load=True)
    mlp.site(1, random_x(4, 3, mlp.hidden_size))
    path = mlp.expert_load().save(tmp_path / "load.safetensors")
    r = footprint("--model", str(tiny_checkpoint), "--ep", "2", "--expert-load", str(path))
    assert r.returncode == 0 and "(ep 2; the recorded load's 3 rows x 1 layers)" in r.stdout, r.stdout + r.stderr
    r = footprint("--preset", "glm-5.3-flash", "--expert-load", str(path))
    assert r.returncode == 2 and "load.safetensors: an expert load of another model (num_hidden_layers 4 in the " \
                                 "file, 45 in the model" in r.stderr and not r.stdout, r.stdout + r.stderr


def test_balance_warns_where_its_placement_is_less_even_than_the_contiguous_ranges(tiny_checkpoint, tmp_path) -> None:
    """The placement balances each expert's load summed over the calls; on a few one-row calls it can leave them
    less even than the contiguous ranges. The placement is written either way, and a warning names the widths
    where a busiest / mean got worse (none where none did): it used to pass in silence."""
    import re
    import subprocess
    import sys

    from mpi4py import MPI

    from cli_jobs import mpi_env
    from helpers import REPO

    mlp = glm_ep.load(tiny_checkpoint, comm=MPI.COMM_SELF, expert_load=True)
    for seed in range(6):
        mlp.site(1, random_x(seed, 1, mlp.hidden_size))  # one-row calls
    mlp.site(1, random_x(9, 16, mlp.hidden_size))
    load = mlp.expert_load().save(tmp_path / "load.safetensors")
    seen = set()
    for redundant in ("0", "4"):
        r = subprocess.run([sys.executable, "-m", "glm_ep", "balance", "--load", str(load), "--ep", "2", "--redundant",
                            redundant, "--out", str(tmp_path / f"p{redundant}.json")], capture_output=True, text=True,
                           timeout=120, env=mpi_env(), cwd=REPO)
        assert r.returncode == 0 and (tmp_path / f"p{redundant}.json").exists(), r.stderr
        rows = re.findall(r"(\d+)-row calls \(\d+ site calls\): .* summed over the calls ([\d.]+)x contiguous -> "
                          r"([\d.]+)x placed; per call ([\d.]+)x -> ([\d.]+)x", r.stdout)
        assert len(rows) == 2, r.stdout
        worse = [w for w, s0, s1, p0, p1 in rows if float(s1) > float(s0) or float(p1) > float(p0)]
        if worse:
            assert (f"balance: warning: on the recorded {', '.join(f'{w}-row calls' for w in worse)} the placement is "
                    "less even than the contiguous ranges") in r.stderr, (r.stdout, r.stderr)
        else:
            assert "warning" not in r.stderr, r.stderr
        seen.add(bool(worse))
    assert seen == {True, False}  # these calls hold both cases (4 replicas on 32 experts: less even per call)


def test_a_moe_tp_that_does_not_divide_and_a_bad_balance_request_are_refused_by_name(tiny_checkpoint, tmp_path) -> None:
    """On every rank of a job (agreed, exit 2), and in the one-process commands."""
    import subprocess
    import sys

    from cli_jobs import mpi_env
    from helpers import REPO

    fails(glm_ep_job(2, "run", "--model", str(tiny_checkpoint), "--moe-tp", "3", "--no-check"),
          "moe_tp = 3 does not divide world = 2")
    fails(glm_ep_job(2, "run", "--model", str(tiny_checkpoint), "--ep", "2", "--moe-tp", "2", "--no-check"),
          "ep * moe_tp = 4 does not divide world = 2")

    def one(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "glm_ep", *args], capture_output=True, text=True, timeout=120,
                              env=mpi_env(), cwd=REPO)

    r = one("footprint", "--preset", "tiny", "--moe-tp", "8")
    assert r.returncode == 2 and "moe_tp = 8: moe_intermediate_size 64 does not split into 8 slices" in r.stderr, r.stderr
    from mpi4py import MPI

    mlp = glm_ep.load(tiny_checkpoint, comm=MPI.COMM_SELF, expert_load=True)
    mlp.site(1, random_x(4, 3, mlp.hidden_size))
    load = mlp.expert_load().save(tmp_path / "load.safetensors")
    r = one("balance", "--load", str(load), "--ep", "3", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 2 and "32 experts + 0 replicas = 32 slots do not split evenly over ep = 3" in r.stderr, \
        r.stderr
    r = one("balance", "--load", str(tmp_path / "p.json"), "--ep", "2", "--out", str(tmp_path / "q.json"))
    assert r.returncode == 2 and "p.json: expert load file not found" in r.stderr, r.stderr
    r = one("synth", "--preset", "tiny", "--router-skew", "-1", "--out", str(tmp_path / "s"))
    assert r.returncode == 2 and "--router-skew: -1.0, expected a finite number >= 0" in r.stderr, r.stderr
    assert not (tmp_path / "p.json").exists()
    # under mpiexec every rank would write the same placement file at once
    r = subprocess.run([sys.executable, "-m", "glm_ep", "balance", "--load", str(load), "--ep", "2", "--out",
                        str(tmp_path / "p.json")], capture_output=True, text=True, timeout=120,
                       env={**mpi_env(), "OMPI_COMM_WORLD_SIZE": "2"}, cwd=REPO)
    assert r.returncode == 2 and "balance writes one placement from one process" in r.stderr, r.stderr
    assert not (tmp_path / "p.json").exists()

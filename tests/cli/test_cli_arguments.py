"""The command line: argument errors name the flag and what it takes, print once under mpiexec, and end every
rank, also where only some ranks' arguments are bad (they meet at the argument check every job opens with)."""

from __future__ import annotations

import pytest

from cli_jobs import fails, glm_ep, glm_ep_per_rank


@pytest.mark.parametrize("argv,needle", [
    (["synth", "--seed", "-1"], "argument --seed: -1, expected an integer >= 0"),
    (["synth", "--shard-mb", "0"], "argument --shard-mb: 0, expected an integer >= 1"),
    (["synth", "--layers", "-2"], "argument --layers: -2, expected an integer >= 1"),
    (["run", "--warmup", "-1"], "argument --warmup: -1, expected an integer >= 0"),
    (["run", "--seed", "x"], "argument --seed: 'x' is not an integer"),
    (["run", "--decode", "-1"], "argument --decode: -1, expected an integer >= 0"),
    (["run", "--verify", "0"], "argument --verify: 0, expected an integer >= 1"),
    (["run", "--prefill", "0"], "argument --prefill: 0, expected an integer >= 1"),
    (["footprint", "--preset", "tiny", "--tp", "0"], "argument --tp: 0, expected an integer >= 1"),
    (["synth", "--dense", "fp8"], "argument --dense: invalid choice: 'fp8'"),
    (["run", "--tp", "0"], "argument --tp: 0, expected an integer >= 1"),
    (["forward", "--model", "m", "--input", "i", "--output", "o", "--moe-tp", "-2"],
     "argument --moe-tp: -2, expected an integer >= 1"),
    (["bench", "--iters", "0"], "argument --iters: 0, expected an integer >= 1"),
    (["bench", "--layers", "-1"], "argument --layers: -1, expected an integer >= 0"),
    (["bench", "--prefill", "--rows", "16", "0"], "argument --rows: 0, expected an integer >= 1"),
    (["run", "--check", "full", "--no-check"], "argument --no-check: not allowed with argument --check"),
])
def test_bad_counts_are_refused_by_the_parser(argv: list[str], needle: str, capsys, tmp_path) -> None:
    """A negative seed or warm-up count was a traceback (seed) or taken as it was (warm-up, shard size). Paths
    under tmp_path: a parser that let one through writes nothing into the working folder."""
    from glm_ep.app.cli import main

    where = {"synth": ["--out", str(tmp_path / "ck")], "run": ["--cache-dir", str(tmp_path / "cache")]}.get(argv[0], [])
    with pytest.raises(SystemExit) as e:
        main(argv + where)
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["synth", "--out", ""], ["synth", "--out", "ck", "--hf-model", " "], ["run", "--cache-dir", ""],
    ["run", "--expert-load", ""], ["make-input", "--out", "", "--rows", "1", "--hidden", "8"],
    ["forward", "--model", "m", "--input", "i", "--output", ""], ["balance", "--load", "", "--ep", "2", "--out", "p"],
    ["bench", "--out", ""], ["footprint", "--preset", "tiny", "--expert-load", ""],
    ["generate", "--model", "", "--hf-model", "h", "--prompt-ids", "1"],
])
def test_an_empty_path_is_refused_by_the_parser(argv: list[str], capsys, tmp_path, monkeypatch) -> None:
    """An empty --out / --cache-dir / --hf-model / ... named the current folder: a checkpoint or a model written
    into it, the cache's folder looked for there, an expert load silently not recorded. Every flag that names a
    file or folder refuses it, by name, before anything is written."""
    from glm_ep.app.cli import main

    monkeypatch.chdir(tmp_path)
    flag = argv[[i for i, a in enumerate(argv) if a.strip() == ""][0] - 1]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2, e.value.code
    assert f"argument {flag}: " in (err := capsys.readouterr().err) and "an empty path; expected a file or folder" \
        in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv,needle", [
    (["run", "--prefill", "0"], "argument --prefill: 0, expected an integer >= 1"),
    (["run", "--check", "fulll"], "argument --check: invalid choice: 'fulll'"),
    (["forward", "--model", "m"], "the following arguments are required: --input, --output"),
], ids=["prefill-0", "check-typo", "forward-no-input"])
def test_an_argument_error_under_mpiexec_is_printed_once(argv: list[str], needle: str, tmp_path) -> None:
    """Every rank printed argparse's usage block and its error, interleaved: now rank 0 alone prints them (one
    usage, one error line), and every rank exits 2."""
    r = glm_ep(2, *argv, cwd=tmp_path)
    fails(r, f"glm-ep: error: {needle}")
    assert r.stderr.count("usage:") == 1, r.stderr


_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


@pytest.mark.parametrize("env,printed", [
    ({}, True), ({"PMI_RANK": "0"}, True), ({"PMI_RANK": "1"}, False), ({"OMPI_COMM_WORLD_RANK": "3"}, False),
    ({"PMIX_RANK": "2"}, False), ({"MV2_COMM_WORLD_RANK": "1"}, False),
])
def test_an_argument_error_is_printed_by_rank_0_only(env: dict[str, str], printed: bool, capsys,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank from the launcher's environment (MPI is not up while arguments are parsed): rank 0, or no
    launcher, prints one error line; any other rank prints nothing; all exit 2. (A command whose ranks never meet:
    ``run`` and ``forward`` agree an argument error across ranks, the next test.)"""
    from glm_ep.app.cli import main

    for name in _RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        main(["footprint", "--preset", "tiny", "--rows", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    if printed:
        assert [line for line in err.splitlines() if "error" in line] == [
            "glm-ep: error: argument --rows: 0, expected an integer >= 1"], err
    else:
        assert err == ""


@pytest.mark.parametrize("bad,needle", [
    (["--bogus"], "glm-ep: error: unrecognized arguments: --bogus (on rank 1)"),
    (["--check", "fulll"], "glm-ep: error: argument --check: invalid choice: 'fulll'"),
], ids=["unknown-flag", "bad-choice"])
def test_a_bad_argument_on_one_rank_ends_every_rank(bad: list[str], needle: str, tiny_checkpoint) -> None:
    """Rank 1's arguments do not parse, rank 0's do: rank 0 used to wait in MPI's start-up for a rank that had
    exited, without a word (the job hung). Now the failing rank meets the others at the argument check every job
    opens with: one agreed error naming the rank, exit 2 on every rank."""
    good = ["run", "--model", str(tiny_checkpoint), "--decode", "1", "--prefill", "2"]
    r = glm_ep_per_rank(good, good + bad)
    fails(r, needle, "(on rank 1)")
    assert "PASS" not in r.stdout


def test_help_still_prints(capsys) -> None:
    from glm_ep.app.cli import main

    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    assert e.value.code == 0 and "--prefill PREFILL" in capsys.readouterr().out


def test_run_with_model_on_some_ranks_only_is_one_agreed_error(tiny_checkpoint, tmp_path) -> None:
    """``--model`` is a per-rank path, but the default checkpoint is made (and agreed) only where none is given:
    given on rank 1 alone, the ranks' collectives paired up wrongly and both crashed. Now one agreed error."""
    args = ["run", "--decode", "1", "--prefill", "2", "--cache-dir", str(tmp_path / "cache")]
    r = glm_ep_per_rank(args, args + ["--model", str(tiny_checkpoint)])
    fails(r, "--model is given on rank(s) 1 but not on the others; expected it on every rank")
    assert not (tmp_path / "cache").exists()  # refused before rank 0 wrote the default checkpoint


def test_argument_errors_of_commands_that_meet_are_agreed_under_any_launcher(monkeypatch) -> None:
    """Which argument errors take the ranks' agreement: run/forward and errors of no known command under a launch of
    several ranks, or of a count the launcher does not give (PMIx sets a rank only; rank 0 too must not exit while
    the others wait for it in MPI's start-up); synth, footprint and bench keep rank 0's one line."""
    from glm_ep.app import cli, launcher

    for name in _RANK_VARS + ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert launcher.launch_size() == 1
    monkeypatch.setenv("PMIX_RANK", "0")
    assert launcher.launch_size() is None
    for argv, agreed in ((["run", "--prefill", "0"], True), (["forward", "--model"], True), (["runn"], True),
                         ([], True), (["footprint", "--rows", "0"], False), (["bench", "--iters", "x"], False)):
        parser = cli.build_parser()
        parser.argv = tuple(argv)
        try:
            parser.parse_args(argv)
            raise AssertionError(f"{argv} parsed")
        except cli._ArgumentsRefused:
            assert agreed, argv
        except SystemExit:
            assert not agreed, argv
    monkeypatch.setenv("PMI_SIZE", "1")  # a launch of one rank: no agreement needed
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["run", "--prefill", "0"])


def test_an_empty_topology_argument_is_refused(tiny_checkpoint, tmp_path) -> None:
    """``--topology "$UNSET"``: an empty name is an error, not the default layout run silently."""
    r = glm_ep(2, "forward", "--model", str(tiny_checkpoint), "--input", str(tmp_path / "x"), "--output",
               str(tmp_path / "o.safetensors"), "--topology", "")
    fails(r, "--topology '': expected a shipped topology name or a TOML path")



def test_footprint_refuses_degrees_its_topology_world_does_not_hold(capsys) -> None:
    """``footprint --topology cpu-2 --tp 4`` reported world 4, a layout the topology's job refuses: now refused as
    the job refuses it; without --topology the world is still the smallest both degrees divide."""
    from glm_ep.app.cli import main

    assert main(["footprint", "--preset", "tiny", "--topology", "cpu-2", "--tp", "4"]) == 2
    assert "topology 'cpu-2': tp = 4, ep = 2, moe_tp = 1 do not divide its world = 2" in capsys.readouterr().err
    assert main(["footprint", "--preset", "tiny", "--tp", "4", "--ep", "2"]) == 0
    assert "world 4, tp 4, ep 2" in capsys.readouterr().out

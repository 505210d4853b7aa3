"""A stopped rank (SIGSTOP) never leaves the others waiting: past ``collective_timeout_s`` the
waiting rank names itself and the site, and the whole job ends with ``EXIT_STALL``.

Each job runs in its own session; MPICH's launcher puts every rank in a session of its own, so
the ranks are found by walking the launcher's process tree and are killed by id when a test ends,
pass or fail.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from glm_ep.errors import EXIT_STALL

from cli_jobs import mpi_env, write_topology
from helpers import REPO

DEADLINE_S = 3.0
HANG_GUARD_S = 120.0  # how long a job may take to end after the stop before the test calls it hung


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(d.name))
    return tree


def _descendants(root: int) -> list[int]:
    tree, found, todo = _children(), [], [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class MpiJob:
    """``mpiexec -n 2 python ARGS`` started in its own session; stderr collected as it comes."""

    def __init__(self, *args: str):
        local = Path(sys.executable).parent / "mpiexec"
        cmd = [str(local) if local.exists() else "mpiexec", "-n", "2", sys.executable, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(),
                                     cwd=REPO, start_new_session=True)
        self.stderr: list[str] = []
        self.stdout: list[str] = []
        self.pids: set[int] = set()
        self._readers = [threading.Thread(target=self._read, args=(s, out), daemon=True)
                         for s, out in ((self.proc.stderr, self.stderr), (self.proc.stdout, self.stdout))]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream, out: list[str]) -> None:
        for line in stream:
            out.append(line)

    def wait_for(self, text: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not any(text in line for line in self.stderr + self.stdout):
            assert self.proc.poll() is None, f"job ended before {text!r}:\n{''.join(self.stderr)[-3000:]}"
            assert time.monotonic() < end, f"no {text!r} within {timeout} s:\n{''.join(self.stderr)[-3000:]}"
            time.sleep(0.05)

    def rank_pid(self, rank: int) -> int:
        """The pid of ``rank`` (its environment holds ``PMI_RANK``); every process of the job is
        remembered for the cleanup."""
        self.pids.update(_descendants(self.proc.pid))
        for pid in self.pids:
            try:
                if f"PMI_RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    return pid
            except OSError:
                continue
        raise AssertionError(f"no process of rank {rank} under mpiexec {self.proc.pid}")

    def __enter__(self) -> "MpiJob":
        return self

    def __exit__(self, *exc: object) -> None:
        self.pids.update(_descendants(self.proc.pid))
        for pid in sorted(self.pids):  # SIGKILL also ends a stopped process
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for t in self._readers:
            t.join(timeout=5)


def _ended(job: MpiJob, after: str) -> tuple[int, str]:
    """The job's exit code and stderr once it ends; failed as hung if it runs HANG_GUARD_S past ``after``."""
    try:
        code = job.proc.wait(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {HANG_GUARD_S:g} s after {after}:\n{''.join(job.stderr)[-3000:]}")
    for t in job._readers:
        t.join(timeout=5)
    return code, "".join(job.stderr)


def _ends_with_stall(job: MpiJob, site: str) -> None:
    """The job ends with ``EXIT_STALL``, and rank 0 says how long it waited at ``site``: at least the deadline
    (the product's own clock; the test times nothing, its wait is only a hang guard)."""
    code, err = _ended(job, "the stop")
    assert code == EXIT_STALL, f"exit {code}, expected {EXIT_STALL}:\n{err[-3000:]}"
    said = re.findall(r"^\[rank 0\] glm-ep: error: rank 0 waited (\d+\.\d) s at '([^']*)' for the other ranks "
                      rf"\(collective_timeout_s = {DEADLINE_S:g}\): ", err, re.M)
    assert len(said) == 1, err[-3000:]
    waited, at = float(said[0][0]), said[0][1]
    assert waited >= DEADLINE_S, (waited, err[-3000:])  # it waited out the deadline, no less
    assert site in f"at '{at}' for the other ranks", (at, site)
    assert "aborting all 2 ranks" in err, err[-3000:]


def test_stopped_rank_at_an_agreement_point_ends_the_job(tmp_path) -> None:
    script = textwrap.dedent(f"""
        import os, signal, sys
        from mpi4py import MPI
        from glm_ep.dist.ranks import Ranks, run_guarded

        ranks = Ranks(MPI.COMM_WORLD, timeout_s={DEADLINE_S})

        def main():
            ranks.agree("start", lambda: None)
            if ranks.rank == 1:
                print("rank 1 stops now", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            ranks.agree("the agreement after the stop", lambda: None)
            print(f"rank {{ranks.rank}} passed", flush=True)
            return 0

        sys.exit(run_guarded(main, MPI.COMM_WORLD))
    """)
    with MpiJob("-c", script) as job:
        job.wait_for("rank 1 stops now", timeout=60)
        job.rank_pid(1)  # remember the job's processes for the cleanup
        _ends_with_stall(job, "at 'the agreement after the stop'")
        assert not any("passed" in line for line in job.stdout)


def test_sigstop_of_one_rank_mid_run_ends_the_job_within_the_deadline(tiny_checkpoint, tmp_path) -> None:
    topo = write_topology(tmp_path / "stall.toml", world=2, tp=2, ep=2, collective_timeout_s=DEADLINE_S)
    with MpiJob("-m", "glm_ep", "run", "--model", str(tiny_checkpoint), "--topology", str(topo), "--prefill", "8",
                "--decode", "20000", "--verify", "2", "--warmup", "0", "--no-check") as job:
        job.wait_for("weights: rank 1 holds", timeout=60)  # loaded: the decode steps are running
        os.kill(job.rank_pid(1), signal.SIGSTOP)
        _ends_with_stall(job, "all-reduce' for the other ranks")


def test_ctrl_c_while_a_rank_waits_on_a_stopped_one_ends_the_job_at_once(tmp_path) -> None:
    """Rank 1 stopped, rank 0 blocked in a collective waiting for it: a Ctrl-C there cannot reach Python (the
    main thread sits in MPI), so the job used to wait out collective_timeout_s and exit 4. The watchdog hears the
    signal and ends the job as an interrupt: 130, 'interrupted while rank 0 waited at ...', long before the
    (here an hour's) deadline."""
    script = textwrap.dedent("""
        import os, signal, sys
        from mpi4py import MPI
        from glm_ep.dist.ranks import Ranks, run_guarded

        ranks = Ranks(MPI.COMM_WORLD, timeout_s=3600)
        ranks.deadline.watch_signals()

        def main():
            ranks.agree("start", lambda: None)
            if ranks.rank == 1:
                print("rank 1 stops now", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            print(f"rank {ranks.rank} waits", flush=True)
            ranks.agree("the agreement after the stop", lambda: None)
            return 0

        sys.exit(run_guarded(main, MPI.COMM_WORLD))
    """)
    with MpiJob("-c", script) as job:
        job.wait_for("rank 1 stops now", timeout=60)
        job.wait_for("rank 0 waits", timeout=60)
        time.sleep(0.5)  # in the collective
        os.kill(job.rank_pid(0), signal.SIGINT)
        code, err = _ended(job, "Ctrl-C")
        assert code == 130, f"exit {code}:\n{err[-3000:]}"
        assert ("[rank 0] glm-ep: interrupted while rank 0 waited at 'the agreement after the stop' for the other "
                "ranks; aborting all 2 ranks") in err, err[-3000:]

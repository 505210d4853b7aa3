"""Units under the robustness checks: the bit-pattern NaN/Inf scan, the workspace's memory check,
the deadline's guard, and the checkpoint fingerprint."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from glm_ep.checkpoint import finite
from glm_ep.mlp import workspace
from glm_ep.checkpoint.reader import Checkpoint
from glm_ep.config.model import RankLayout, SiteConfig
from glm_ep.dist.deadline import Deadline
from glm_ep.errors import EXIT_STALL, ConfigError
from glm_ep.backend.numpy_backend import NumpyBackend
from glm_ep.mlp.site import site_buffers
from glm_ep.mlp.workspace import ws_total_bytes

from cli_jobs import copy_checkpoint
from helpers import tiny_model

E4M3 = ml_dtypes.float8_e4m3fn


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_first_nonfinite_finds_the_first_across_chunks(dtype, bad: float) -> None:
    n = 11 * (3 * finite._CHUNK // 11 + 7)  # a little over three chunks
    a = np.linspace(-1e3, 1e3, n).astype(dtype).reshape(-1, 11)  # the extremes of each dtype stay finite
    assert finite.first_nonfinite(a) is None
    flat = a.reshape(-1)
    for i in (n - 1, 2 * finite._CHUNK + 5, finite._CHUNK, 7):  # the last set is the first found
        flat[i] = bad
        assert finite.first_nonfinite(a) == np.unravel_index(i, a.shape)
    assert finite.nonfinite_mask(a).sum() == 4


def test_e4m3_nan_is_0x7f_and_0xff_only() -> None:
    bits = np.arange(256, dtype=np.uint8)
    mask = finite.nonfinite_mask(bits.view(E4M3))
    assert np.flatnonzero(mask).tolist() == [0x7F, 0xFF]
    assert np.array_equal(mask, np.isnan(bits.view(E4M3).astype(np.float32)))  # ml_dtypes agrees
    assert finite.first_nonfinite(bits[:0x7F].view(E4M3)) is None  # 448 (0x7E) is the largest finite


def _cfg() -> SiteConfig:
    return SiteConfig.for_rank(tiny_model(), RankLayout(1, 0, 1, 1))


def allocate_workspaces(cfg: SiteConfig, *args, **kwargs) -> list[workspace.Workspace]:
    """``workspace.allocate_workspaces`` on NumPy, for the buffers the sites of ``cfg`` declare."""
    return workspace.allocate_workspaces(NumpyBackend(), site_buffers(cfg), *args, **kwargs)


def test_workspace_bigger_than_free_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg()
    need = ws_total_bytes(site_buffers(cfg), 64)
    monkeypatch.setattr(workspace, "free_memory_bytes", lambda xp: need - 1)
    with pytest.raises(ConfigError, match=r"shared workspace for workspace_rows = 64 needs .* but only .* of host "
                                          r"memory is free; lower workspace_rows"):
        allocate_workspaces(cfg, 64, 4, shared=True)
    monkeypatch.setattr(workspace, "free_memory_bytes", lambda xp: need)
    pool = allocate_workspaces(cfg, 64, 4, shared=True)
    assert len(pool) == 4 and all(ws is pool[0] for ws in pool) and pool[0].nbytes == need
    private = allocate_workspaces(cfg, 8, 4, shared=False)
    assert len({id(ws) for ws in private}) == 4


def test_per_layer_workspaces_are_checked_as_one_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``shared_workspace = false``: each of the layers gets its own workspace, so the free memory must hold layers x
    one workspace. The tiny model at 8 rows, counted by hand from the buffer list: act = max(8 * 256, 8 * 8 * 64)
    bf16 for each of gate/up/act (3 * 1024 bytes a row), logits 32 fp32 (128), six int32/fp32 [rows, top_k]
    buffers (6 * 32), expert_out [rows * 8, 128] bf16 (2048), shared_out [rows, 128] bf16 (256): 5696 bytes a row;
    u_slot [rows * 8, rows] int32 (32 a row squared); expert_offsets 33 int32 (132)."""
    cfg = _cfg()
    one = 5696 * 8 + 32 * 8 * 8 + 132  # 47748
    monkeypatch.setattr(workspace, "free_memory_bytes", lambda xp: 4 * one - 1)
    with pytest.raises(ConfigError, match=r"the 4 per-layer workspaces for workspace_rows = 8 need 0\.19 MB, but only "
                                          r"0\.19 MB of host memory is free; lower workspace_rows in the topology or "
                                          r"set shared_workspace = true"):
        allocate_workspaces(cfg, 8, 4, shared=False)
    monkeypatch.setattr(workspace, "free_memory_bytes", lambda xp: 4 * one)
    pool = allocate_workspaces(cfg, 8, 4, shared=False)
    assert len({id(ws) for ws in pool}) == 4 and all(ws.nbytes == one for ws in pool)
    # two ranks sharing that memory: each needs its four
    with pytest.raises(ConfigError, match=r"4 per-layer workspaces .* for the 2 ranks that share it"):
        allocate_workspaces(cfg, 8, 4, False, 2 * 4 * one - 1, 2)
    assert len(allocate_workspaces(cfg, 8, 4, False, 2 * 4 * one, 2)) == 4


def test_ranks_sharing_memory_each_take_their_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks on one host (NumPy) or one GPU each checked their workspace against ALL of the memory free there, so
    two ranks could take twice what is free; now each fits its share of what was free before any allocated."""
    cfg = _cfg()
    need = ws_total_bytes(site_buffers(cfg), 64)
    monkeypatch.setattr(workspace, "free_memory_bytes", lambda xp: pytest.fail("measured again"))
    with pytest.raises(ConfigError, match=r"needs .* but only .* of host memory is free for the 2 ranks that share "
                                          r"it \(.* each\); lower workspace_rows"):
        allocate_workspaces(cfg, 64, 4, True, 2 * need - 1, 2)
    assert allocate_workspaces(cfg, 64, 4, True, 2 * need, 2)[0].nbytes == need
    assert allocate_workspaces(cfg, 64, 4, True, None, 2)[0].nbytes == need  # the system does not say


def test_workspace_allocation_failure_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate")

    monkeypatch.setattr(workspace, "free_memory_bytes", lambda xp: None)
    monkeypatch.setattr(workspace, "workspace_pool", no_memory)
    with pytest.raises(ConfigError, match="the 4 per-layer workspaces .* allocating them failed .*Unable to allocate"):
        allocate_workspaces(_cfg(), 64, 4, shared=False)
    with pytest.raises(ConfigError, match="the shared workspace .* allocating it failed .*Unable to allocate"):
        allocate_workspaces(_cfg(), 64, 4, shared=True)


def test_free_host_memory_is_known_here() -> None:
    free = workspace.free_memory_bytes(np)
    assert free is not None and 0 < free


def test_deadline_guard_nests_and_expires_once(capsys: pytest.CaptureFixture) -> None:
    aborted: list[int] = []
    done = threading.Event()
    hooks: list[str] = []

    def abort(code: int) -> None:  # like MPI_Abort, never returns: the (daemon) watchdog stays parked
        aborted.append(code)
        done.set()
        threading.Event().wait()

    d = Deadline(rank=1, size=2, timeout_s=0.5, abort=abort)
    d.on_expiry(lambda: hooks.append("nccl abort"))
    with d.guard("outer"):
        with d.guard("inner"):
            assert d._armed[0] == "inner"
        assert d._armed[0] == "outer"
        assert done.wait(10), "the deadline never fired"
    assert aborted == [EXIT_STALL] and hooks == ["nccl abort"]
    err = capsys.readouterr().err
    assert "[rank 1] glm-ep: error: rank 1 waited" in err and "at 'outer'" in err
    assert "collective_timeout_s = 0.5" in err and "aborting all 2 ranks" in err


def test_deadline_of_one_rank_never_arms() -> None:
    d = Deadline(rank=0, size=1, timeout_s=0.01, abort=lambda code: pytest.fail("aborted a one-rank job"))
    with d.guard("nothing to wait for"):
        time.sleep(0.1)
    assert d._watcher is None and d._armed is None


def test_fingerprint_follows_config_and_headers_not_the_folder(tiny_checkpoint: Path, tmp_path: Path) -> None:
    copy = copy_checkpoint(tiny_checkpoint, tmp_path / "copy")
    with Checkpoint(tiny_checkpoint) as a, Checkpoint(copy) as b:
        assert a.fingerprint == b.fingerprint and set(a.fingerprint) == {"config", "index"}
    cfg = json.loads((copy / "config.json").read_text())
    cfg["swiglu_limit"] = 7.0
    (copy / "config.json").write_text(json.dumps(cfg, indent=4))
    with Checkpoint(tiny_checkpoint) as a, Checkpoint(copy) as b:
        assert a.fingerprint["config"] != b.fingerprint["config"] and a.fingerprint["index"] == b.fingerprint["index"]


class _TwoRanks:
    """A communicator stand-in whose allgather hands back what two ranks gave: this one's, then ``other``."""

    def __init__(self, other: dict[str, str]):
        self.other = other

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 2

    def Abort(self, code: int) -> None:
        raise AssertionError(f"abort {code}")

    def allgather(self, value: dict[str, str]) -> list[dict[str, str]]:
        return [value, self.other]


def test_check_same_names_each_rank_value_whole_and_digests_short() -> None:
    """Values that differ only past their 12th character (a devices list, a lever tuple, a command line's rows)
    are shown whole, so the ranks' lines differ; hex digests by their first 12 digits."""
    from glm_ep.dist.ranks import AgreedError, Ranks

    mine = {"topology devices": "(0, 1, 2, 3, 4, 5, 6, 7)", "config": "ab" * 32, "same": "x"}
    theirs = {"topology devices": "(0, 1, 2, 3, 4, 5, 7, 6)", "config": "cd" * 32, "same": "x"}
    with pytest.raises(AgreedError) as e:
        Ranks(_TwoRanks(theirs)).check_same("site", "layouts", mine)
    msg = str(e.value)
    assert "(differing: topology devices, config)" in msg
    assert "rank 0: topology devices (0, 1, 2, 3, 4, 5, 6, 7), config abababababab\n" in msg
    assert msg.endswith("rank 1: topology devices (0, 1, 2, 3, 4, 5, 7, 6), config cdcdcdcdcdcd")
    long = {"a": "[" + "1, " * 100 + "]"}
    with pytest.raises(AgreedError, match=re.escape("rank 1: a " + ("[" + "1, " * 100)[:200] + "...") + "$"):
        Ranks(_TwoRanks(long)).check_same("site", "values", {"a": "2"})
    Ranks(_TwoRanks(dict(mine))).check_same("site", "layouts", mine)  # the same everywhere: no error


class _Aborted(Exception):
    pass


def _deadline(timeout_s: float = 5.0) -> tuple[Deadline, list[int]]:
    codes: list[int] = []

    def abort(code: int) -> None:  # MPI_Abort never returns: here it raises out of the tick instead
        codes.append(code)
        raise _Aborted

    return Deadline(rank=0, size=2, timeout_s=timeout_s, abort=abort), codes


def test_time_the_process_spent_stopped_is_not_waiting(capsys) -> None:
    """A gap between two watchdog ticks far past the tick is the process stopped (SIGSTOP of the whole job, a
    frozen container): left out of the wait, so a job paused past collective_timeout_s and resumed goes on."""
    d, codes = _deadline(5.0)
    d._armed = ("site", 100.0, d._stopped_s)
    d._tick(100.0)
    d._tick(100.0 + 600.0)  # stopped ten minutes
    assert d.waited(d._armed, 700.0) == pytest.approx(d.tick_s) and not codes
    now = 700.0
    with pytest.raises(_Aborted):
        while now < 720.0:  # then really waiting, the watchdog ticking: past the deadline
            now += d.tick_s
            d._tick(now)
    assert codes == [EXIT_STALL] and d.waited(d._armed, now) > 5.0
    assert now == pytest.approx(700.0 + 5.0, abs=2 * d.tick_s)
    assert "rank 0 waited 5.2 s at 'site'" in capsys.readouterr().err


def test_one_rank_takes_sigterm_as_terminated() -> None:
    """A one-rank job has no wait to watch, but a scheduler's cancel still ends it as Terminated (the command says
    "terminated (SIGTERM)" and exits 143), not by the signal's default, silently."""
    import os
    import signal

    from glm_ep.dist.deadline import Deadline, Terminated

    before = signal.getsignal(signal.SIGTERM)
    try:
        d = Deadline(0, 1, 60.0, lambda code: None)
        d.watch_signals()
        assert d._watcher is None  # no watchdog thread for one rank
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)  # give the handler a bytecode boundary to run at
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("signum,code,said", [(2, 130, "interrupted"), (15, 143, "terminated (SIGTERM)")])
def test_a_signal_during_a_guarded_wait_ends_the_job(capsys, signum: int, code: int, said: str) -> None:
    """A signal the wake-up pipe brings while a guard is armed: if the main thread is still in that wait after
    the grace, the watchdog ends the job with the interrupt's code; if it left the wait, the signal is its own."""
    import os

    from glm_ep.dist.deadline import SIGNAL_GRACE_S

    d, codes = _deadline()
    r, w = os.pipe()
    d._signal_fd = r
    os.set_blocking(r, False)
    d._armed = ("all-reduce", 10.0, 0.0)
    os.write(w, bytes([signum]))
    d._tick(10.0)
    assert not codes
    with pytest.raises(_Aborted):
        d._tick(10.0 + SIGNAL_GRACE_S)
    assert codes == [code]
    assert f"[rank 0] glm-ep: {said} while rank 0 waited at 'all-reduce'" in capsys.readouterr().err
    d2, codes2 = _deadline()
    d2._signal_fd = r
    d2._armed = ("all-reduce", 10.0, 0.0)
    os.write(w, bytes([signum]))
    d2._tick(10.0)
    d2._armed = None  # the main thread took it: out of the wait
    d2._tick(11.0)
    d2._armed = ("next", 11.0, 0.0)
    d2._tick(12.0)
    assert not codes2
    os.close(r), os.close(w)

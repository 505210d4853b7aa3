"""The CUDA backend's stream discipline: every op queues on the backend's own stream, whatever stream
CuPy has current, and leaves the caller's current stream as it found it. (Two ranks sharing one GPU
once summed stale chunks because a buffer copy ran on CuPy's default stream, unordered against the
backend's non-blocking one; git log -- tools/two_rank_race_probe.py has the investigation.)
"""

from __future__ import annotations

import numpy as np
import pytest

from glm_ep.bench.common import hold_stream

from _cuda import backend, cupy, dev, host, poisoned, requires_cuda
from helpers import BF16, rand_bf16

pytestmark = [pytest.mark.cuda, requires_cuda]


def _busy(stream, ms: float = 200.0) -> None:
    """Queue a one-thread kernel on ``stream`` that spins for ``ms`` milliseconds (the global timer)."""
    hold_stream(cupy, ms * 1e6, stream)


def test_ops_leave_the_callers_stream_current(rng):
    from glm_ep.backend.cuda import CudaBackend

    mine = cupy.cuda.Stream(non_blocking=True)
    x = rand_bf16(rng, (2, 64))
    w = rand_bf16(rng, (32, 64))
    with mine:
        be = CudaBackend(0)  # building it does not make its stream current either
        assert cupy.cuda.get_current_stream() == mine
        xd, wd, out = be.asarray(x), be.asarray(w), be.xp.empty((2, 32), dtype=BF16)
        be.linear(xd, wd, out)
        be.copy(out, be.xp.empty_like(out))
        assert cupy.cuda.get_current_stream() == mine, "a backend op changed CuPy's current stream"
        assert be.stream != mine


def test_copy_queues_on_the_backend_stream(rng):
    """``copy`` with another stream current and busy: it must complete on the backend's stream
    while that stream still spins (on the busy stream it would wait behind the spin)."""
    be = backend()
    x = rand_bf16(rng, (16, 128))
    src, dst = dev(x), poisoned((16, 128), BF16)
    other = cupy.cuda.Stream(non_blocking=True)
    with other:
        _busy(other)
        be.copy(src, dst)
        got = host(dst)  # waits for the backend's stream only
        still_busy = not other.done
    other.synchronize()
    assert still_busy, "the spin ended before the check: the test proves nothing on this device"
    np.testing.assert_array_equal(got.view(np.uint16), x.view(np.uint16))


def test_the_benchs_l2_flush_reads_its_buffer_in_stream_order():
    """``bench.common.flush_l2`` (before each of ``time_gpu_us``'s calls) queues on the stream it is given, behind
    what is there, reads its buffer to the last 16 bytes and writes none of it: it leaves the L2 clean instead of
    filling it dirty. Its one write, kept so that the reads stay live, goes to the first word only where the words a
    thread read XOR to 0x9e3779b9: the last 16 bytes are seeded so, the rest XOR to 0."""
    from glm_ep.bench.common import flush_l2

    magic = 0x9E3779B9
    stream = cupy.cuda.Stream(non_blocking=True)
    buf = cupy.full(8 << 20, 0x5A, dtype=cupy.uint8)  # every other 16 bytes XOR to 0
    buf[-16:].view(cupy.uint32)[:] = cupy.asarray([magic, 0, 0, 0], dtype=cupy.uint32)
    cupy.cuda.Device().synchronize()
    want = cupy.asnumpy(buf)
    flush_l2(cupy, cupy.zeros(16, dtype=cupy.uint8), stream)  # built before the spin: NVRTC can outlast it
    stream.synchronize()
    _busy(stream, 200.0)
    flush_l2(cupy, buf, stream)
    after = cupy.cuda.Event()
    after.record(stream)
    assert not after.done
    first = int(cupy.asnumpy(buf[:4].view(cupy.uint32))[0])  # read on another stream while this one is busy
    assert first == 0x5A5A5A5A, "the flush ran before the stream's busy kernel"
    after.synchronize()
    got = cupy.asnumpy(buf)
    assert int(got[:4].view(np.uint32)[0]) == magic, "the flush did not read the buffer's last 16 bytes"
    np.testing.assert_array_equal(got[4:], want[4:])

"""Where do the wrong chunks of two ranks sharing one GPU come from? Each pass runs the chunked
``glm-ep forward`` loop (every site, the input in workspace-sized chunks) in one of these modes and
counts the chunks whose output is off the NumPy rank's (relative L2 > 0.05):

  plain        the product's code path (persistent page-locked staging buffers, the site's input
               copied on the backend's stream)
  setitem      plain, but the site's input copied by ``h_buf[:t] = x`` on CuPy's current stream
  fresh        the all-reduce as it was: pageable host arrays made for each call
  fresh-check  the same, and each gathered partial's digest taken the moment the allgather returns,
               compared afterwards with the digest its sender took of what it sent (the transport)
  observe      fresh, instrumented: the partial read back (``to_host``) compared with a second read
               after a device-wide sync (a stale read), the gathered partials with the senders'
               digests after one more collective, the uploaded sum with a read-back, and the
               site's input copy with the chunk (``h_buf``)
  sync-ops     fresh, with a device-wide sync after every backend op (serialisation on the device)

    mpirun -n 2 python tools/two_rank_race_probe.py MODEL INPUT CPU_OUT TOPOLOGY [--passes N] [--modes M ...]

Rank 0 prints one line per pass; every rank takes part in every check.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import sys

import ml_dtypes  # noqa: F401  (bf16 for safetensors' NumPy reader)
import numpy as np
from safetensors.numpy import load_file

from glm_ep.dist.comm import bf16_sum_in_rank_order
from glm_ep.app.files import read_hidden_states
from glm_ep.app.jobs import agreed_topology
from glm_ep.mlp.runtime import load_runtime, open_checkpoint
from glm_ep.dist.ranks import Ranks, mpi_world

OPS = ("linear", "router_logits", "router_topk", "swiglu", "combine", "add", "zero", "gate_up_act", "moe_gemv",
       "moe_gate_up_act", "union_table", "moe_gemv_union", "moe_gate_up_act_union", "sort_by_expert",
       "moe_gemm_sorted", "moe_gate_up_act_sorted", "expert_linear")


def digest(a: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser()
    for name in ("model", "input", "cpu_out", "topology"):
        ap.add_argument(name)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["plain", "fresh", "fresh-check", "plain", "observe", "sync-ops"])
    args = ap.parse_args()
    mpi = mpi_world()
    ranks = Ranks(mpi)
    topo = agreed_topology(argparse.Namespace(topology=args.topology, tp=None, ep=None, backend=None), ranks)
    rt = load_runtime(open_checkpoint(args.model, topo, ranks), topo, ranks)
    be, stack, comm = rt.be, rt.stack, rt.comm
    import cupy

    def dsync() -> None:
        cupy.cuda.runtime.deviceSynchronize()

    x = read_hidden_states(args.input, rt.model.hidden_size)
    ref = load_file(args.cpu_out)
    chunk = stack.max_rows
    flags: dict[str, int] = {}
    original_all_reduce = comm.all_reduce

    def flag(what: str, bad: bool) -> None:
        flags[what] = flags.get(what, 0) + int(bad)

    def fresh_all_reduce(buf, site="all-reduce", check=False):
        host = be.to_host(buf)
        bits = np.ascontiguousarray(host).view(np.uint16).reshape(-1)
        gathered = np.empty((comm.size, bits.size), dtype=np.uint16)
        comm.comm.Allgather(bits, gathered)
        if check:
            got = [digest(gathered[r]) for r in range(comm.size)]
        summed = bf16_sum_in_rank_order(gathered.view(ml_dtypes.bfloat16)).reshape(host.shape)
        be.from_host(buf, summed)
        if check:
            sent = comm.comm.allgather(digest(bits))
            flag("MPI transport", got != sent)
        return buf

    def observed_all_reduce(buf, site="all-reduce"):
        host = be.to_host(buf)
        dsync()
        flag("stale partial read", not np.array_equal(host.view(np.uint16), be.to_host(buf).view(np.uint16)))
        bits = np.ascontiguousarray(host).view(np.uint16).reshape(-1)
        gathered = np.empty((comm.size, bits.size), dtype=np.uint16)
        comm.comm.Allgather(bits, gathered)
        sent = comm.comm.allgather(digest(bits))
        flag("MPI transport", any(digest(gathered[r]) != sent[r] for r in range(comm.size)))
        summed = bf16_sum_in_rank_order(gathered.view(ml_dtypes.bfloat16)).reshape(host.shape)
        be.from_host(buf, summed)
        dsync()
        flag("upload of the sum", not np.array_equal(be.to_host(buf).view(np.uint16), summed.view(np.uint16)))
        return buf

    originals = {op: getattr(be, op) for op in OPS}

    def synced(fn):
        @functools.wraps(fn)
        def run(*a, **kw):
            out = fn(*a, **kw)
            dsync()
            return out
        return run

    def set_mode(mode: str) -> None:
        comm.all_reduce = {"observe": observed_all_reduce, "fresh": fresh_all_reduce, "sync-ops": fresh_all_reduce,
                           "fresh-check": functools.partial(fresh_all_reduce, check=True)}.get(mode, original_all_reduce)
        for op, fn in originals.items():
            setattr(be, op, synced(fn) if mode == "sync-ops" else fn)

    status = 0
    for mode in args.modes:
        set_mode(mode)
        for p in range(args.passes):
            flags.clear()
            streams: set[int] = set()
            bad, worst = [], 0.0
            for i in range(rt.model.num_hidden_layers):
                want_all = ref[f"layers.{i}"].astype(np.float64)
                for c, r in enumerate(range(0, x.shape[0], chunk)):
                    xc = x[r:r + chunk]
                    dev = be.asarray(xc)
                    t = xc.shape[0]
                    if mode == "setitem":
                        stack.h_buf[:t] = dev  # the site input copy as it was: on CuPy's current stream
                        streams.add(cupy.cuda.get_current_stream().ptr)
                    else:
                        be.copy(dev, stack.h_buf[:t])
                    if mode == "observe":
                        dsync()
                        flag("site input copy", not np.array_equal(be.to_host(stack.h_buf[:t]).view(np.uint16),
                                                                   xc.view(np.uint16)))
                    y = be.to_host(stack.sites[i](stack.h_buf[:t], stack.workspaces[i], stack.out_buf[:t]))
                    want = want_all[r:r + t]
                    err = float(np.linalg.norm(y.astype(np.float64) - want) / max(np.linalg.norm(want), 1e-30))
                    worst = max(worst, err)
                    if err > 0.05:
                        bad.append(f"L{i}c{c}")
            if streams:
                flags[f"current stream is the backend's: {streams == {be.stream.ptr}} {sorted(streams)}"] = 1
            every = mpi.allgather((bad, worst, dict(flags)))
            if ranks.rank == 0:
                for r, (b, w, f) in enumerate(every):
                    print(f"{mode:<9} pass {p} rank {r}: worst rel L2 {w:.2e}, {len(b)} bad chunks {b[:12]}, "
                          f"flags {f}", flush=True)
            if any(b for b, _, _ in every) and mode == "plain":
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())

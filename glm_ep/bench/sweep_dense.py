"""``glm-ep bench --sweep dense``: the bf16 projections of 1..64 rows on every engine that can take them, per
GLM-5.3-Flash shape, in ONE run on one GPU: what the dense dispatch's row tiers are set from (``dense.py``:
the batch-M GEMV to 8 rows, the warp-streaming GEMM ``wstream_takes``, cuBLAS).

Shapes: the dense FFN's gate + up + SwiGLU ([12288, 4096] each) and down ([4096, 12288]), the shared expert's
([2048, 4096], [4096, 2048]). Engines: ``gemv`` (1..8 rows), ``wstream`` (the warp-streaming GEMM, 1..16),
``cublas`` (gate, up, then the SwiGLU pass for gate + up), ``cublas_pair`` (gate and up in one batched call), and
``shipped``: the backend's own op (``gate_up_act``, ``linear``), i.e. the engine the dispatch picks, with the
backend's scratch bound as a job binds it. Each call
reads the next of several copies of the weights, together three times the L2 or more (``weight_copies``), so
every call streams its weights from HBM as a job's layers do; each engine a captured step can run is timed as a
CUDA graph over the copies at the 1..8 rows a step captures, and as back-to-back calls, marked †, where a job calls
them eagerly (past 8 rows) or a graph cannot hold them (cuBLAS) (``captured``).
Before, one copy was timed eagerly: the shared expert's 33 MB stayed in the L2 between calls and its small
launches were bound by the host, which favoured the batch-M GEMV over what a verify site measures. Writes
SWEEP_DENSE.md / sweep_dense.json to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any, Callable

from glm_ep.backend.base import KERNEL_LIMITS
from glm_ep.bench.common import (BF16, bench_meta, bench_workspace, copy_bandwidth, glm_model, gpu_bf16,
                                 graph_median_us, results_header, time_median, world1_cfg)
from glm_ep.bench.sweep_ring import _write

ROWS = (1, 2, 4, 5, 8, 9, 16, 24, 32, 48, 64)
MAX_ROWS = 64  # the widest call it sweeps (``--rows``)
ENGINES = ("gemv", "wstream", "cublas", "cublas_pair", "shipped")


def shapes(model: Any) -> dict[str, tuple[int, int, bool]]:
    """name -> (out width N, in width K, gate + up + SwiGLU)."""
    h, i, s = model.hidden_size, model.intermediate_size, model.shared_intermediate
    return {"dense gate + up": (i, h, True), "dense down": (h, i, False),
            "shared gate + up": (s, h, True), "shared down": (h, s, False)}


def run_sweep_dense(args: argparse.Namespace) -> int:
    import cupy as cp

    from glm_ep.backend.base import DenseResident
    from glm_ep.backend.cuda import CudaBackend
    from glm_ep.backend.cuda import dense as D
    from glm_ep.backend.cuda.elementwise import swiglu

    model = glm_model()
    rows = sorted(set(args.rows or ROWS))
    if rows[0] < 1 or rows[-1] > MAX_ROWS:
        from glm_ep.errors import ConfigError

        raise ConfigError(f"--sweep dense --rows {' '.join(map(str, rows))}: expected widths of 1..{MAX_ROWS}")
    be = CudaBackend(0)
    bench_workspace(be, world1_cfg(model), MAX_ROWS)  # binds the backend's scratch, as a job's workspace does
    s, limit = be.stream, model.swiglu_limit
    copy_gbs = copy_bandwidth(cp, s)
    l2 = cp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"]
    n_partials, n_arrived = D.wstream_scratch_sizes()
    partials, arrived = cp.empty(n_partials, cp.float32), cp.zeros(n_arrived, cp.uint32)
    results = []
    for name, (n, k, glu) in shapes(model).items():
        nbytes = (2 if glu else 1) * n * k * 2
        copies = weight_copies(nbytes, l2)
        with s:
            ws_ = []
            for _ in range(copies):
                w2 = gpu_bf16(cp, (2 if glu else 1, n, k), k ** -0.5)  # gate and up stacked, as upload_dense keeps
                # them; a plain projection's weight as "gate". Only gate and up are read (gate_up_act, linear).
                ws_.append(DenseResident(w2[0], w2[-1], w2[0]))
        for r in rows:
            x = gpu_bf16(cp, (r, k), 1.0)
            g, u, a = (cp.empty((r, n), BF16) for _ in range(3))
            gu = cp.empty((2, r, n), BF16)
            runs: dict[str, Callable[[int], None]] = {}  # engine -> a call on weight copy c
            if glu:
                if r <= D.GEMV_MAX_ROWS:
                    runs["gemv"] = lambda c: D.glu_bf16(x, ws_[c].gate, ws_[c].up, limit, g, u, a)
                if r <= D.WSTREAM_MAX_ROWS:
                    runs["wstream"] = lambda c: D.wstream_glu_bf16(x, ws_[c].gate, ws_[c].up, limit, g, u, a, partials,
                                                                   arrived)
                runs["cublas"] = lambda c: (D.gemm_bf16(x, ws_[c].gate, g), D.gemm_bf16(x, ws_[c].up, u),
                                            swiglu(g, u, limit, a))
                runs["cublas_pair"] = lambda c: (D.gemm_bf16_pair(x, ws_[c].gate, ws_[c].up, gu[0], gu[1]),
                                                 swiglu(gu[0], gu[1], limit, a))
                runs["shipped"] = lambda c: be.gate_up_act(x, ws_[c], limit, g, u, a)
            else:
                if r <= D.GEMV_MAX_ROWS:
                    runs["gemv"] = lambda c: D.gemv_bf16(x, ws_[c].gate, g)
                if r <= D.WSTREAM_MAX_ROWS:
                    runs["wstream"] = lambda c: D.wstream_gemm_bf16(x, ws_[c].gate, g, partials, arrived)
                runs["cublas"] = lambda c: D.gemm_bf16(x, ws_[c].gate, g)
                runs["shipped"] = lambda c: be.linear(x, ws_[c].gate, g)
            times, eager = {}, []
            with s:
                for engine, fn in runs.items():
                    if captured(engine, r):
                        times[engine] = graph_median_us(cp, s, be.capture, lambda: [fn(c) for c in range(copies)], 20,
                                                        per=copies)
                    else:  # cuBLAS cannot be captured: back-to-back calls, each on the next copy
                        turn = itertools.count()
                        times[engine] = time_median(cp, s, lambda: fn(next(turn) % copies), 4 * copies)
                        eager.append(engine)
            results.append({"shape": name, "rows": r, "bytes": nbytes, "copies": copies, "eager": eager, **times})
        ws_ = None
    meta = bench_meta(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), copy_gbs)
    return _write(Path(args.out), "dense", {"meta": meta, "results": results}, render_dense)


def weight_copies(nbytes: int, l2_bytes: int) -> int:
    """Distinct copies of a shape's weights a timed round cycles through: together at least three times the L2, so
    every call streams its weights from HBM as a job's layers do (one copy of the shared expert's 33 MB stays in an
    H100's 50 MB L2 between back-to-back calls)."""
    return max(2, -(-3 * l2_bytes // nbytes))


def captured(engine: str, rows: int) -> bool:
    """Whether an engine's calls are timed as a CUDA graph, as a job runs them: at the widths a step captures
    (1..8 rows) every engine but cuBLAS, which CuPy cannot capture; past them none (a job calls them eagerly, so the
    engines are compared as it sees them, launch costs included). Eager calls of a small projection are bound by
    the host's launch time, not the device's: at 1..8 rows only a graph shows the device."""
    return rows <= KERNEL_LIMITS.max_gemv_rows and engine not in ("cublas", "cublas_pair")


def fastest(r: dict[str, Any]) -> str:
    """The engine with the least time in a result row (``shipped`` is the dispatch, not an engine)."""
    return min((e for e in ENGINES[:-1] if r.get(e) is not None), key=lambda e: r[e])


def render_dense(data: dict[str, Any]) -> str:
    meta = data["meta"]
    lines = results_header("glm-ep bench --sweep dense", meta) + [
        "", "µs a call, each on the next of several copies of the weights (three times the L2 or more: streamed "
        "from HBM), timed as a CUDA graph at the 1..8 rows a step captures; † back-to-back eager calls (past 8 rows, "
        "as a job calls them, and cuBLAS, which a graph cannot hold). ★ the "
        "fastest engine; `shipped` is the backend's own op, the engine the dispatch picks (a captured 1..8-row step "
        "cannot call cuBLAS). TB/s: the weight bytes over the shipped time."]
    for shape in dict.fromkeys(r["shape"] for r in data["results"]):
        lines += ["", f"## {shape}", "", "| rows | " + " | ".join(ENGINES) + " | TB/s |",
                  "|---:|" + "---:|" * (len(ENGINES) + 1)]
        for r in (r for r in data["results"] if r["shape"] == shape):
            best = fastest(r)
            cells = ["—" if r.get(e) is None else f"{r[e]:.1f}" + ("†" if e in r.get("eager", ()) else "")
                     + (" ★" if e == best else "") for e in ENGINES]
            lines.append(f"| {r['rows']} | " + " | ".join(cells) + f" | {r['bytes'] / (r['shipped'] * 1e6):.2f} |")
    return "\n".join(lines) + "\n"

"""Wrappers of ``elementwise.cu``: the clamped SwiGLU, the residual add, the bf16 -> fp32 upcast and the
routed + shared combine (plain, or through the expert-sorted permutation).

Shape suffixes: T rows, H hidden, K top-k, S slots.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from glm_ep.backend.cuda.kernel_loader import (BF16, COMBINE_THREADS, COMBINE_VEC, ELEM_THREADS, F32, I32, cdiv, check,
                                        check_shape, i32, i64, launch)

ELEM_MAX_BLOCKS = 8192  # grid-stride beyond this


_ELEM = "elementwise.cu"


def _elem_grid(n: int) -> tuple[int, int, int]:
    return (max(1, min(cdiv(n, ELEM_THREADS), ELEM_MAX_BLOCKS)), 1, 1)


def _same(name: str, a: Any, like: Any, dtype: np.dtype) -> None:
    check(name, a, dtype, 2), check_shape(name, a, like.shape)


def swiglu(gate: Any, up: Any, limit: float, out: Any) -> None:
    _same("gate", gate, out, BF16), _same("up", up, out, BF16), _same("out", out, out, BF16)
    if out.size:
        launch(_ELEM, "swiglu_bf16", _elem_grid(out.size), (ELEM_THREADS, 1, 1),
               (gate, up, out, i64(out.size), np.float32(limit)))


def add(a: Any, b: Any, out: Any) -> None:
    _same("a", a, out, BF16), _same("b", b, out, BF16), _same("out", out, out, BF16)
    if out.size:
        launch(_ELEM, "add_bf16", _elem_grid(out.size), (ELEM_THREADS, 1, 1), (a, b, out, i64(out.size)))


def bf16_to_f32(a: Any, out: Any) -> None:
    _same("a", a, out, BF16), _same("out", out, out, F32)
    if out.size:
        launch(_ELEM, "bf16_to_f32_copy", _elem_grid(out.size), (ELEM_THREADS, 1, 1), (a, out, i64(out.size)))


def combine(routed_SH: Any, wts_TK: Any, shared_TH: Any | None, out_TH: Any, perm_TK: Any | None = None) -> None:
    """``out[t] = bf16(sum_k wts[t, k] * routed[row(t, k)] + shared[t])``, row ``t*K + k`` or
    ``perm[t, k]``; grid (H / (threads * 8), T)."""
    t, h = out_TH.shape
    k = wts_TK.shape[1]
    if h % COMBINE_VEC:
        raise ValueError(f"combine: hidden {h} is not a multiple of {COMBINE_VEC}")
    check("routed", routed_SH, BF16), check_shape("routed", routed_SH, (routed_SH.shape[0], h))
    check("wts", wts_TK, F32, 4), check_shape("wts", wts_TK, (t, k))
    check("out", out_TH, BF16)
    if shared_TH is not None:
        check("shared", shared_TH, BF16), check_shape("shared", shared_TH, (t, h))
    shared = shared_TH if shared_TH is not None else np.uint64(0)  # a null pointer
    grid = (cdiv(h, COMBINE_THREADS * COMBINE_VEC), t, 1)
    if t == 0:
        return
    if perm_TK is None:
        check_shape("routed", routed_SH, (t * k, h))
        launch(_ELEM, "moe_combine", grid, (COMBINE_THREADS, 1, 1), (routed_SH, wts_TK, shared, out_TH, i32(h), i32(k)))
    else:
        check("perm", perm_TK, I32, 4), check_shape("perm", perm_TK, (t, k))
        launch(_ELEM, "moe_combine_indexed", grid, (COMBINE_THREADS, 1, 1),
               (routed_SH, perm_TK, wts_TK, shared, out_TH, i32(h), i32(k)))

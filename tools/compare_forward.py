"""Compare two ``glm-ep forward`` outputs site by site (relative L2), e.g. CUDA against NumPy.

    python tools/compare_forward.py A.safetensors B.safetensors [--bound 1e-2]

Exit 1 if any site differs by more than the bound (or the files hold different sites).
"""

from __future__ import annotations

import argparse
import importlib
import sys

import numpy as np
from safetensors.numpy import load_file


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--bound", type=float, default=1e-2)
    args = ap.parse_args()
    importlib.import_module("ml_dtypes")  # registers bfloat16 for safetensors' NumPy reader
    a, b = load_file(args.a), load_file(args.b)
    if a.keys() != b.keys():
        print(f"different sites: {sorted(a)} vs {sorted(b)}")
        return 1
    worst = 0.0
    for key in sorted(a, key=lambda k: int(k.split(".")[1])):
        x, y = a[key].astype(np.float64), b[key].astype(np.float64)
        err = np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-300)
        same = np.mean(a[key].view(np.uint16) == b[key].view(np.uint16))
        print(f"{key}: rows {x.shape[0]}, relative L2 {err:.2e}, bitwise-equal elements {same:.1%}")
        worst = max(worst, err)
    print(f"{'OK' if worst <= args.bound else 'FAIL'}: worst relative L2 {worst:.2e} (bound {args.bound:g})")
    return 0 if worst <= args.bound else 1


if __name__ == "__main__":
    sys.exit(main())

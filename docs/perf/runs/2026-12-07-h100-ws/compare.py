"""Compare saved outputs of two kernel folders: python compare.py A B (the /tmp/out_A_* and /tmp/out_B_* files)."""
import sys, glob, numpy as np, ml_dtypes
a, b = sys.argv[1], sys.argv[2]
for fa in sorted(glob.glob(f"/tmp/out_{a}_*.npy")):
    fb = fa.replace(f"/tmp/out_{a}_", f"/tmp/out_{b}_")
    x = np.load(fa).view(ml_dtypes.bfloat16).astype(np.float32); y = np.load(fb).view(ml_dtypes.bfloat16).astype(np.float32)
    d = np.abs(x - y); rel = np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)
    print(fa.split("/")[-1], "max|d|", float(d.max()), "rel L2", float(rel), "equal", float(np.mean(x == y)), "finite", bool(np.isfinite(y).all()))

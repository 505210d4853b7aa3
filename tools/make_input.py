"""Write a ``glm-ep forward`` input: ``hidden_states`` bf16 [rows, hidden], seeded normal values.

    python tools/make_input.py OUT.safetensors --rows 5 --hidden 128 [--seed 0]
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--rows", type=int, required=True)
ap.add_argument("--hidden", type=int, required=True)
ap.add_argument("--seed", type=int, default=0)
args = ap.parse_args()
x = np.random.default_rng(args.seed).standard_normal((args.rows, args.hidden)).astype(ml_dtypes.bfloat16)
save_file({"hidden_states": x}, args.out)

#!/usr/bin/env bash
# Two ranks sharing one GPU (MPI host-staged all-reduce), an input wider than the workspace (2000
# rows in 512-row chunks), against one NumPy rank. Each variant runs the same forward and prints
# the per-layer relative L2 and which rows and chunks are off, to tell apart a device-ordering race
# (CUDA_LAUNCH_BLOCKING), the grouped-GEMM path (prefill_gemm = false) and the MPI transport (Open
# MPI's CUDA buffer support off; its ob1 + shared-memory transport instead of UCX):
#   bash tools/two_rank_chunks_check.sh      (QUICK=1: only the default and the MPI transport variants)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=python3
W=$(mktemp -d)
$PY -m glm_ep synth --preset tiny --out "$W/tiny" >/dev/null 2>&1
$PY tools/make_input.py "$W/in.safetensors" --rows 2000 --hidden 128 --seed 2000
$PY -m glm_ep forward --model "$W/tiny" --input "$W/in.safetensors" --output "$W/cpu.safetensors" --backend cpu \
    2>/dev/null
cp configs/h200-1x2.toml "$W/chunks.toml"
sed 's/^name = .*/name = "chunks-row-groups"/' configs/h200-1x2.toml >"$W/rowgroups.toml"
printf '[levers]\nprefill_gemm = false\n' >>"$W/rowgroups.toml"
sed -e 's/^name = .*/name = "chunks-tp-only"/' -e 's/^ep = 2/ep = 1/' configs/h200-1x2.toml >"$W/tponly.toml"
sed -e 's/^name = .*/name = "chunks-ep-only"/' -e 's/^tp = 2/tp = 1/' configs/h200-1x2.toml >"$W/eponly.toml"
run() {  # run NAME TOPOLOGY [mpirun flags...]
    local name=$1 topo=$2; shift 2
    mpirun --allow-run-as-root "$@" -n 2 $PY -m glm_ep forward --model "$W/tiny" --input "$W/in.safetensors" \
        --output "$W/$name.safetensors" --topology "$W/$topo.toml" 2>"$W/$name.log" || tail -3 "$W/$name.log"
    echo "== $name"
    $PY tools/compare_forward.py "$W/$name.safetensors" "$W/cpu.safetensors"
    $PY - "$W/$name.safetensors" "$W/cpu.safetensors" <<'EOF'
import sys

import ml_dtypes  # noqa: F401
import numpy as np
from safetensors.numpy import load_file

got, want = load_file(sys.argv[1]), load_file(sys.argv[2])
for key in sorted(want, key=lambda k: int(k.split(".")[1])):
    a, b = got[key].astype(np.float32), want[key].astype(np.float32)
    err = np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-30)
    bad = np.nonzero(err > 0.05)[0]
    if bad.size:
        print(f"{key}: {bad.size} rows off (first {bad[:8].tolist()}), chunks {sorted(set((bad // 512).tolist()))}")
EOF
}
run chunks chunks
run chunks-again chunks
[ -n "${QUICK:-}" ] || run tp-only tponly
[ -n "${QUICK:-}" ] || run row-groups rowgroups
[ -n "${QUICK:-}" ] || run launch-blocking chunks -x CUDA_LAUNCH_BLOCKING=1
run mpi-cuda-off chunks -x OMPI_MCA_opal_cuda_support=0
run mpi-cuda-off-again chunks -x OMPI_MCA_opal_cuda_support=0
run ob1-vader chunks --mca pml ob1 --mca btl self,vader
run ob1-vader-again chunks --mca pml ob1 --mca btl self,vader

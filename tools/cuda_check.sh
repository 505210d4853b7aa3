#!/usr/bin/env bash
# One-shot check of the CUDA backend on a GPU machine (from the repository root):
#   bash tools/cuda_check.sh [OUT_DIR]
# installs the package (no dependencies: the machine's CuPy, mpi4py and NumPy serve), runs the
# CUDA kernel and path tests and the 2-rank test under mpirun (timings: glm-ep bench, tools/device_check.sh).
# Logs go to OUT_DIR (default: ./cuda_check_out). Exit status: that of the first failing stage.
set -uo pipefail
OUT_DIR="${1:-${OUT:-./cuda_check_out}}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # MPI singletons inside the tests
PY="${PYTHON:-python3}"
status=0
run() {  # run NAME CMD...: log to OUT_DIR/NAME.log, remember the first failure
    local name=$1; shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc"
    [ "$status" -ne 0 ] || status=$rc
}
MPIRUN=(mpirun -n 2)
[ "$(id -u)" = 0 ] && MPIRUN=(mpirun --allow-run-as-root -n 2)
# no registry there: no build isolation; the source tree on PYTHONPATH serves if even that fails
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT_DIR/pip.log" 2>&1 || echo "pip install failed (see pip.log); using PYTHONPATH"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
run tests "$PY" -m pytest -q -rs -m cuda -p no:cacheprovider tests/cuda/test_cuda_*.py
WITH_MPI=()
"$PY" -c "import pytest_mpi" 2>/dev/null && WITH_MPI=(--with-mpi)  # pytest-mpi skips mpi tests without it
run mpi2 "${MPIRUN[@]}" "$PY" -m pytest -q -rs -m "cuda and mpi" -p no:cacheprovider "${WITH_MPI[@]}" \
    -o timeout_method=thread tests/cuda/test_cuda_paths.py
exit $status

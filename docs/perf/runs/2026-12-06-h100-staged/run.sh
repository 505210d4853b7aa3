#!/usr/bin/env bash
# The device calls behind this folder, one stage each (run from the repository root on the device; the lab folder
# .devrun held probe3.py, compare.py and kernels_prev, the kernel sources of tree 51a5471).
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
stage() { echo "== $* ($(date +%T))"; }
stage install; pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || echo "install failed"
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:-}" in
staged)  # run 1: x staged (stage_k64), the placed dequantization in the wgmma engine; tests, then against the engine before
  stage tests; timeout 230 python -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_paths.py tests/cuda/test_cuda_dense.py tests/cuda/test_kernels_build.py 2>&1 | tail -8 | tee $OUT/tests.txt
  stage probe tree; timeout 130 python .devrun/probe3.py --rows=512,1024,2048,4096 --variants=m64w4k64n,m128wg8k64 --save 2>&1 | grep -E "^[{]|not here|rror" | tee -a $OUT/times.txt
  stage probe prev; timeout 90 python .devrun/probe3.py --kdir=kernels_prev --rows=1024,2048,4096 --variants=m128wg8k64 --save 2>&1 | grep -E "^[{]|not here|rror" | tee -a $OUT/times.txt
  stage compare; python .devrun/compare.py tree kernels_prev 2>&1 | grep wg8 | tee $OUT/compare.txt
  stage probe tree again; timeout 70 python .devrun/probe3.py --rows=1024,4096 --variants=m128wg8k64 2>&1 | grep -E "^[{]|not here|rror" | tee -a $OUT/times.txt
  ;;
late4)  # run 2: tests of the staged engine and the 64- and 32-row wgmma tiles, then the bench (its variant table times every tile)
  stage tests; timeout 110 python -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_dense.py -k "stage or experts_sorted or staged or variants or split" 2>&1 | tail -4 | tee $OUT/tests.txt
  stage bench; timeout 220 python -m glm_ep bench --prefill --rows 64 1024 4096 --out $OUT 2>&1 | tail -3
  ;;
run3)  # run 3 (the machine still warm): the bit-exact dequantization and prefill path tests; the tiles at 1536 and 2048 rows
  timeout 75 python -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_paths.py -k "bit_exact or sorted or wide or prefill" 2>&1 | tail -3
  timeout 70 python .devrun/probe3.py --rows=1536,2048 --variants=m64w4k64n,m32wg4k64,m64wg4k64,m128wg8k64 2>&1 | grep -E "^[{]|rror"
  ;;
run4)  # run 4: the narrow 64-row tile against the 64-row wgmma tile at 384..768 rows
  timeout 60 python .devrun/probe3.py --rows=384,512,768 --variants=m64w4k64n,m64wg4k64 2>&1 | grep -E "^[{]|rror"
  ;;
run5)  # run 5: tree f71acc5 (the 64-row wgmma tile the default past 20 rows an expert, the 32-row one not built): its tests, then the shipped bench
  timeout 40 python -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py -k "experts_sorted or m64wg4k64" 2>&1 | tail -1 | tee $OUT/tests.txt
  timeout 85 python -m glm_ep bench --prefill --rows 64 1024 4096 --out $OUT 2>&1 | tail -2
  ;;
esac
stage done

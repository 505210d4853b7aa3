#!/usr/bin/env bash
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
stage() { echo "== $* ($(date +%T))"; }
stage install; pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || echo "install failed"
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:-}" in
narrow)  # run 1
  stage gemm tests; timeout 240 python -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_paths.py 2>&1 | tail -15 | tee $OUT/tests.txt
  stage probe; timeout 150 python .devrun/probe.py times --cross 2>&1 | grep -v Warn | tail -30 | tee $OUT/times.txt
  ;;
blocks)  # run 2: blocks per SM of the narrow tiles; ncu of the 8-row narrow tile
  for k in "" --kdir=kernels_mb6 --kdir=kernels_mb8 ""; do
    stage "probe $k"; timeout 100 python .devrun/probe.py times $k 2>&1 | grep "{" | tee -a $OUT/times.txt
  done
  stage cross; timeout 100 python .devrun/probe.py times --cross 2>&1 | grep "'rows'" | tee -a $OUT/cross.txt
  S="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats"
  stage ncu; timeout 150 ncu --kernel-name regex:"nvfp4_gemm_sorted_glu_m8w4k64n" --launch-count 1 $S python .devrun/probe.py once 64 m8w4k64n > $OUT/ncu_m8n_glu_64.txt 2>&1; tail -80 $OUT/ncu_m8n_glu_64.txt
  ;;
prefetch)  # run 3: an L2 prefetch of 128 / 256 bytes around every cp.async
  for k in "" --kdir=kernels_pf128 --kdir=kernels_pf256 --kdir=kernels_k128 "" --kdir=kernels_pf256; do
    stage "probe $k"; timeout 100 python .devrun/probe.py times $k 2>&1 | grep "{" | tee -a $OUT/times.txt
  done
  ;;
final)  # run 4: the L2 prefetch and the narrow 16-row tile's 128-k stages (the tree) against kernels_base (1ce8466)
  stage gemm tests; timeout 240 python -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_paths.py tests/cuda/test_cuda_dense.py 2>&1 | tail -8 | tee $OUT/tests.txt
  for k in --kdir=kernels_base "" --kdir=kernels_base ""; do
    stage "probe $k"; timeout 100 python .devrun/probe.py times $k 2>&1 | grep "{" | tee -a $OUT/times.txt
  done
  stage bench; timeout 330 python -m glm_ep bench --prefill --out $OUT 2>&1 | tail -40
  ;;
tests)  # run 5: the CUDA tests of the grouped GEMM and everything that launches it
  stage tests; timeout 420 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_paths.py tests/cuda/test_cuda_dense.py tests/cuda/test_cuda_balance.py tests/cuda/test_cuda_routed.py 2>&1 | tail -8 | tee $OUT/tests.txt
  ;;
bench)  # run 6: the shipped bench on the final tree
  stage bench; timeout 330 python -m glm_ep bench --prefill --out $OUT 2>&1 | tail -3
  ;;
h200)  # run 7: the H200 (if lent): the site's crossover with the narrow tiles, then the shipped bench
  stage cross; timeout 120 python .devrun/probe.py times --cross 2>&1 | grep "{" | tee $OUT/times.txt
  stage bench; timeout 300 python -m glm_ep bench --prefill --out $OUT 2>&1 | tail -3
  ;;
final_tests)  # run 8: the CUDA GEMM, path and dense tests on the final tree (128-k variants' partial tiles included)
  stage tests; timeout 300 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_paths.py tests/cuda/test_cuda_dense.py 2>&1 | tail -8 | tee $OUT/tests.txt
  ;;
esac
stage done

#!/usr/bin/env bash
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
stage() { echo "== $* ($(date +%T))"; }
stage install; pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || echo "install failed"
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:-}" in
run1)  # the wgmma engine with one stage's wgmma kept in flight, its loop unrolled by the 6 slots (tree) against 0974273's (kernels_cur); tests of the tree first, outputs compared (same sums, same order: equal), the shipped bench, then ncu of the tree if time is left
  stage tests; timeout 170 python -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_dense.py tests/cuda/test_cuda_paths.py -k "stage or experts_sorted or staged or variants or split or nvfp4 or sorted" 2>&1 | tail -4 | tee $OUT/tests.txt
  for k in "" --kdir=kernels_cur; do
    stage "probe $k"; OUT=/tmp timeout 60 python .devrun/probe3.py $k --rows=1024,4096 --variants=m64wg4k64,m128wg8k64 --save 2>&1 | grep -E "^[{]|not here|rror" | tee -a $OUT/times.txt
  done
  stage compare; python .devrun/compare.py tree kernels_cur 2>&1 | tee $OUT/compare.txt
  stage bench; timeout 230 python -m glm_ep bench --prefill --rows 64 1024 4096 --out $OUT 2>&1 | tail -3
  for rv in 4096:m128wg8k64 1024:m64wg4k64; do r=${rv%%:*}; v=${rv##*:}; n=tree_$r; [ $SECONDS -lt 520 ] || break
    stage "ncu $n"; OUT=/tmp timeout 60 ncu --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --kernel-name regex:"nvfp4_gemm_sorted_glu_$v" --launch-count 1 python .devrun/probe3.py --rows=$r --variants=$v > $OUT/ncu_$n.txt 2>&1; grep -E "Duration|Issue Slots|Warp Cycles Per Issued|Executed Ipc A|Eligible Warps|DRAM Throughput|Stall" $OUT/ncu_$n.txt | head -12
  done
  ;;
run2)  # run 2, on the same warm machine right after: every CUDA GEMM, path and dense test, then tree and kernels_cur again at 1024 / 2048 / 4096 rows
  timeout 200 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_paths.py tests/cuda/test_cuda_dense.py 2>&1 | tail -3 | tee $OUT/tests_full.txt
  for k in "" --kdir=kernels_cur; do OUT=/tmp timeout 60 python .devrun/probe3.py $k --rows=1024,2048,4096 --variants=m64wg4k64,m128wg8k64 2>&1 | grep -E "^[{]|rror" | tee -a $OUT/times2.txt; done
  ;;
run3)  # run 3: the wgmma variants on 8 slots (kernels_s8, .devrun/stages.py) against the tree's 6; their GEMM tests, outputs compared, times interleaved
  stage tests s8; timeout 70 python .devrun/stages.py 8 pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py -k "wg or experts_sorted or stage" 2>&1 | tail -3 | tee $OUT/tests_s8.txt
  stage probe tree; OUT=/tmp timeout 45 python .devrun/probe3.py --rows=1024,4096 --variants=m64wg4k64,m128wg8k64 --save 2>&1 | grep -E "^[{]|rror" | tee -a $OUT/times_s8.txt
  stage probe s8; OUT=/tmp timeout 45 python .devrun/stages.py 8 probe --kdir=kernels_s8 --rows=1024,4096 --variants=m64wg4k64,m128wg8k64 --save 2>&1 | grep -E "^[{]|rror" | tee -a $OUT/times_s8.txt
  stage compare; python .devrun/compare.py tree kernels_s8 2>&1 | tee $OUT/compare_s8.txt
  [ $SECONDS -lt 190 ] && { stage probe tree again; OUT=/tmp timeout 45 python .devrun/probe3.py --rows=1024,4096 --variants=m64wg4k64,m128wg8k64 2>&1 | grep -E "^[{]|rror" | tee -a $OUT/times_s8.txt; }
  [ $SECONDS -lt 240 ] && { stage probe s8 again; OUT=/tmp timeout 45 python .devrun/stages.py 8 probe --kdir=kernels_s8 --rows=1024,4096 --variants=m64wg4k64,m128wg8k64 2>&1 | grep -E "^[{]|rror" | tee -a $OUT/times_s8.txt; }
  ;;
esac
echo "== done ($(date +%T))"

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
staged2)  # run 2: the coalesced stage_k64; the wgmma switch (35.6 and 42.7 rows an expert); ncu of gate + up at 4096 rows; the shipped bench
  stage tests; timeout 120 python -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_dense.py -k "stage or experts_sorted or staged or nvfp4 or variants" 2>&1 | tail -4 | tee $OUT/tests.txt
  stage probe; timeout 110 python .devrun/probe3.py --rows=1280,1536,4096 --variants=m64w4k64n,m128wg8k64 2>&1 | grep -E "^[{]|not here|rror" | tee -a $OUT/times.txt
  stage ncu; timeout 100 ncu --kernel-name regex:"nvfp4_gemm_sorted_glu_m128wg8k64" --launch-count 1 --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__cycles_elapsed.avg" python .devrun/probe3.py --rows=4096 --variants=m128wg8k64 > $OUT/ncu.txt 2>&1
  stage bench; timeout 300 python -m glm_ep bench --prefill --rows 64 1024 4096 --out $OUT 2>&1 | tail -3
  ;;
esac
stage done

#!/usr/bin/env bash
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
stage() { echo "== $* ($(date +%T))"; }
stage install; pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || echo "install failed"
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:-}" in
wgreg)  # 2026-12-06 night run 1: the register-weight wgmma engine (m128wrk64); its tests, then against wgmma and the narrow 64-row tile
  stage tests; timeout 200 python -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py -k "wrk64" 2>&1 | tail -8 | tee $OUT/tests.txt
  stage probe; timeout 200 python .devrun/probe2.py --rows=64,256,1024,2048,4096 --variants=m16w4k128n,m64w4k64n,m128wgk64,m128wrk64 2>&1 | grep -E "^[{]|not here|rror" | tee $OUT/times_wgreg.txt
  stage probe wr1; timeout 120 python .devrun/probe2.py --kdir=kernels_wr1 --rows=64,256,1024,2048,4096 --variants=m128wrk64 2>&1 | grep -E "^[{]|not here|rror" | tee $OUT/times_wr1.txt
  stage ncu stalls; timeout 90 ncu --kernel-name regex:"nvfp4_gemm_sorted_glu_m128wrk64" --launch-count 1 --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum" python .devrun/probe2.py --rows=4096 --variants=m128wrk64 > $OUT/ncu_wr.txt 2>&1; grep -E "stalled|==|pct|wavefronts" $OUT/ncu_wr.txt | sort -k3 -n -r | head -30
  ;;
wgreg2)  # night run 2: the register-weight engine on 2 and 4 warpgroups (m128wr4k64, m128wr8k64), its weights' copies prefetching into L2, its out tile stored through shared memory (kernels_ep0: stored from registers)
  stage tests; timeout 200 python -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py -k "wr4k64 or wr8k64" 2>&1 | tail -8 | tee $OUT/tests.txt
  stage probe; timeout 200 python .devrun/probe2.py --rows=256,1024,2048,4096 --variants=m64w4k64n,m128wgk64,m128wr4k64,m128wr8k64 2>&1 | grep -E "^[{]|not here|rror" | tee $OUT/times_wgreg2.txt
  stage probe ep0; timeout 120 python .devrun/probe2.py --kdir=kernels_ep0 --rows=1024,4096 --variants=m128wr4k64,m128wr8k64 2>&1 | grep -E "^[{]|not here|rror" | tee $OUT/times_ep0.txt
  stage ncu; timeout 120 ncu --kernel-name regex:"nvfp4_gemm_sorted_glu_m128wr" --launch-count 2 --metrics "regex:smsp__average_warps_issue_stalled_(wait|not_selected|math_pipe_throttle|barrier|short_scoreboard|long_scoreboard|gmma|mio_throttle)_per_issue_active\.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum" python .devrun/probe2.py --rows=4096 --variants=m128wr4k64,m128wr8k64 > $OUT/ncu_wr2.txt 2>&1; grep -E "stalled|==PROF== Prof|pct|wavefronts|inst_exec" $OUT/ncu_wr2.txt | head -40
  ;;
wgreg3)  # night run 3: the register-weight engine's shipped form (out tile stored from registers); tests; wgmma against 2 and 4 warpgroups at 1536..4096 rows, twice; the placed narrow tiles with x paired once a stage in shared memory (kernels_ep0: at every mma step)
  stage tests; timeout 200 python -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py -k "wr4k64 or wr8k64" 2>&1 | tail -8 | tee $OUT/tests.txt
  stage probe; timeout 240 python .devrun/probe2.py --rows=1536,2048,3072,4096,1536,2048,3072,4096 --variants=m128wgk64,m128wr4k64,m128wr8k64 2>&1 | grep -E "^[{]|not here|rror" | tee $OUT/times_ab.txt
  stage probe narrow; timeout 100 python .devrun/probe2.py --rows=1536,2048,1536,2048 --variants=m64w4k64n 2>&1 | grep -E "^[{]|not here|rror" | tee $OUT/times_ab_narrow.txt
  stage placed tests; timeout 150 python -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py -k "k64p or k128p" 2>&1 | tail -4 | tee $OUT/tests_placed.txt
  stage probe placed; timeout 150 python .devrun/probe2.py --rows=64,256,1024,64,256,1024 --variants=m16w4k128n,m16w4k128p,m64w4k64n,m64w4k64p 2>&1 | grep -E "^[{]|not here|rror" | tee $OUT/times_placed.txt
  stage probe placed per step; timeout 100 python .devrun/probe2.py --kdir=kernels_ep0 --rows=64,256,64,256 --variants=m16w4k128p 2>&1 | grep -E "^[{]|not here|rror" | tee $OUT/times_placed_ep0.txt
  ;;
final3)  # night run 4: the final tree (the wgmma engine replaced by the register-weight one on 4 warpgroups, m128wg8k64); tests; the shipped bench at 64 / 1024 / 4096 rows (the widths where the engine or the one-expert choice it makes can differ, and 1024 for reference)
  stage tests; timeout 200 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_dense.py 2>&1 | tail -6 | tee $OUT/tests.txt
  stage bench; timeout 200 python -m glm_ep bench --prefill --rows 64 1024 4096 --out $OUT 2>&1 | tail -3
  ;;
esac
stage done

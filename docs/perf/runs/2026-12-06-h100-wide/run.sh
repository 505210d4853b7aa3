#!/usr/bin/env bash
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
stage() { echo "== $* ($(date +%T))"; }
stage install; pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || echo "install failed"
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:-}" in
wide)  # 2026-12-06 evening run 1: the skip of empty x tiles, narrow 32- and 64-row tiles; tests, then variants tree vs base
  stage gemm tests; timeout 270 python -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_paths.py 2>&1 | tail -6 | tee $OUT/tests.txt
  stage probe tree; timeout 200 python .devrun/probe2.py 2>&1 | grep "{" | tee $OUT/times_tree.txt
  stage probe base; timeout 120 python .devrun/probe2.py --kdir=kernels_base --rows=16,64,256,1024 2>&1 | grep "{" | tee $OUT/times_base.txt
  stage ncu stalls; timeout 100 ncu --kernel-name regex:"nvfp4_gemm_sorted_glu_m8w4k64n" --launch-count 1 --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" python .devrun/probe2.py --rows=64 --variants=m8w4k64n > $OUT/ncu_stalls.txt 2>&1; grep -E "stalled|==" $OUT/ncu_stalls.txt | sort -k3 -n -r | head -30
  ;;
wide2)  # evening run 2: the K loops as member templates (NVRTC for sm_90a refused run 1's generic lambdas); tests; 512..4096 rows
  stage nvrtc sm_90a; timeout 200 python -c "
from glm_ep.backend.cuda import kernel_loader as L
try:
    print('built', L._arch_cubin('gemm_nvfp4.cu', 'sm_90a'))
except Exception as e:
    print(str(e)[:3000])
" 2>&1 | tail -40 | tee $OUT/nvrtc.txt
  stage path tests; timeout 150 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_paths.py 2>&1 | tail -6 | tee $OUT/tests.txt
  for k in --kdir=kernels_placed ""; do
    stage "probe narrow $k"; timeout 100 python .devrun/probe2.py $k --rows=16,64,256 --variants=m8w4k64n,m16w4k128n,m16w4k64n --save 2>&1 | grep -E "^[{]|not here|rror" | tee -a $OUT/times_placed.txt
  done
  stage compare; python .devrun/compare.py tree kernels_placed 2>&1 | tee $OUT/compare.txt
  stage bench; timeout 280 python -m glm_ep bench --prefill --out $OUT 2>&1 | tail -3
  ;;
final2)  # evening run 3: the final tree (the placed 16-row tile to 2 rows an expert, the narrow 64-row tile past 16, wgmma past 32)
  stage tests; timeout 200 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_paths.py tests/cuda/test_cuda_dense.py 2>&1 | tail -6 | tee $OUT/tests.txt
  stage bench; timeout 250 python -m glm_ep bench --prefill --out $OUT 2>&1 | tail -3
  ;;
switch)  # evening run 4: the narrow 64-row tile against wgmma between 28 and 114 rows an expert (the switch at 32)
  stage probe; timeout 200 python .devrun/probe2.py --rows=1536,2048,3072 --variants=m64w4k64n,m128wgk64 2>&1 | grep -E "^[{]|not here|rror" | tee $OUT/times_switch.txt
  ;;
esac
stage done

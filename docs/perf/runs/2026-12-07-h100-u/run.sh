#!/usr/bin/env bash
# The four calls of 2026-12-07's second device session (one H100), as run from the repository root with the
# lab folder .devrun/ carried: kdir.py and test_union_stale.py are ../2026-12-07-h100-ws/'s, kernels_u is that
# folder's kernels_u.patch on tree 3dc9f3f, kernels_b2 is kernels_b2.patch beside this file, stages.py is
# ../2026-12-06-h100-pipelined/stages.py with its kernel folder taken from $KDIR, probe3.py and compare.py those
# recorded in ../2026-12-07-h100-ws/README.md.
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -q -e .
case "$1" in
1)  # tree 3dc9f3f: the union tests on kernels_u (with the NaN-first test), then the tree's CUDA suite (cut at 300 s)
  cp .devrun/test_union_stale.py tests/cuda/test_lab_union_stale.py
  timeout 240 python .devrun/kdir.py kernels_u pytest -q -p no:cacheprovider tests/cuda/test_cuda_union.py \
      tests/cuda/test_lab_union_stale.py | tail -3 | tee $OUT/tests_union_u.txt
  timeout 300 python -m pytest -q -p no:cacheprovider tests/cuda | tail -3 | tee $OUT/tests_tree.txt ;;
2)  # tree 3dc9f3f: the whole CUDA suite as three concurrent pytest processes, files dealt round-robin
  F=$(ls tests/cuda/test_*.py); i=0; for f in $F; do echo $f >> /tmp/g$((i%3)); i=$((i+1)); done
  for g in 0 1 2; do (timeout 450 python -m pytest -q -p no:cacheprovider $(cat /tmp/g$g) > $OUT/tree_g$g.txt 2>&1
      echo "rc=$?" >> $OUT/tree_g$g.txt) & done; wait ;;
3)  # tree 3dc9f3f + kernels_u's gemv_nvfp4_union.cu: the union sweep; one barrier for two stages (kernels_b2)
  timeout 150 python -m glm_ep bench --sweep union --out $OUT
  KDIR=kernels_b2 timeout 70 python .devrun/stages.py 8 pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py \
      -k "wg or experts_sorted or stage" | tail -2 | tee $OUT/tests_b2.txt
  R=1024,4096; V=m64wg4k64,m128wg8k64
  OUT=/tmp timeout 40 python .devrun/probe3.py --rows=$R --variants=$V --save | grep -E "^[{]|rror" | tee -a $OUT/times_b2.txt
  KDIR=kernels_b2 OUT=/tmp timeout 40 python .devrun/stages.py 8 probe --kdir=kernels_b2 --rows=$R --variants=$V --save \
      | grep -E "^[{]|rror" | tee -a $OUT/times_b2.txt
  python .devrun/compare.py tree kernels_b2 | tee $OUT/compare_b2.txt
  OUT=/tmp timeout 30 python .devrun/probe3.py --rows=$R --variants=$V | grep -E "^[{]|rror" | tee -a $OUT/times_b2.txt
  KDIR=kernels_b2 OUT=/tmp timeout 30 python .devrun/stages.py 8 probe --kdir=kernels_b2 --rows=$R --variants=$V \
      | grep -E "^[{]|rror" | tee -a $OUT/times_b2.txt ;;
4)  # the same tree: stall reasons of the 128-row wgmma tile's gate + up at 4096 rows; the one-row ring sweep
  OUT=/tmp timeout 90 ncu --kernel-name regex:"nvfp4_gemm_sorted_glu_m128wg8k64" --launch-count 1 --metrics \
      "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active" \
      python .devrun/probe3.py --rows=4096 --variants=m128wg8k64 > $OUT/ncu_stalls_4096.txt 2>&1
  mkdir -p $OUT/ring; timeout 200 python -m glm_ep bench --sweep ring --out $OUT/ring ;;
esac

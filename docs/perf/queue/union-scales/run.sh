#!/usr/bin/env bash
# The union and row-group GEMVs' block scales by bit placement (scales.patch), one stage a call, from the repository
# root (docs/perf/queue/union-scales/run.sh U0):
#   U0  the GEMV, ring and union tests with the patch
#   U1  bench --sweep union (the verify kernels side by side) and the decode bench (1 row, verify 2..8), on the tree
#       and then with the patch, one card
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
Q=docs/perf/queue/union-scales
TOPO=h100-1; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && TOPO=h200-1
pip install --no-deps -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
run() {  # run NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  timeout $limit "$@" > $OUT/$name.log 2>&1; echo "rc $?" >> $OUT/$name.log; tail -2 $OUT/$name.log
}
case "$1" in
U0) git apply $Q/scales.patch && { run tests 560 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_union.py \
        tests/cuda/test_cuda_ring.py tests/cuda/test_cuda_routed.py; git apply -R $Q/scales.patch; } ;;
U1) for side in tree patch; do
      [ $side = patch ] && { git apply $Q/scales.patch || break; }
      run sweep_$side 130 python -m glm_ep bench --sweep union --topology $TOPO --out /tmp/sweep_$side
      cp /tmp/sweep_$side/SWEEP_*.md $OUT/sweep_$side.md 2>/dev/null
      run decode_$side 140 python -m glm_ep bench --topology $TOPO --no-peer --out /tmp/decode_$side
      cp /tmp/decode_$side/BENCH_*.md $OUT/decode_$side.md 2>/dev/null
      [ $side = patch ] && git apply -R $Q/scales.patch
    done ;;
esac
git status --short > $OUT/tree_after.txt

#!/usr/bin/env bash
# The narrow lanes' device stages, one a call (run from the repository root: docs/perf/queue/narrow-lanes/run.sh Q0):
#   Q0  correctness: B.patch, then A.patch, each through the grouped-GEMM, prefill-path and dense tests
#   Q1  the tree, then B.patch: bench --prefill --stages (no peers), same process order, one card
#   Q2  A.patch, then the tree again: the other half, the tree's run a second baseline
# Each writes its logs and tables under $OUT; the tree is left as it was found.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
Q=docs/perf/queue/narrow-lanes
TOPO=h100-1; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && TOPO=h200-1
pip install --no-deps -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
W="16 64 128 256 448 1024 4096"
bench() {  # bench NAME: the prefill stages and variant tables of the tree as it now is
  timeout 280 python -m glm_ep bench --prefill --stages --topology $TOPO --rows $W --no-peer --out /tmp/$1 > $OUT/$1.log 2>&1
  echo "bench rc $?" >> $OUT/$1.log
  cp /tmp/$1/PREFILL_*.md $OUT/$1.md 2>/dev/null
  tail -1 $OUT/$1.log
}
tests() {  # tests NAME: the GPU tests the patches touch
  timeout 170 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_paths.py \
    tests/cuda/test_cuda_dense.py > $OUT/$1.log 2>&1
  echo "tests rc $?" >> $OUT/$1.log
  tail -2 $OUT/$1.log
}
case "$1" in
Q0) git apply $Q/B.patch && { tests tests_B; git apply -R $Q/B.patch; }
    git apply $Q/A.patch && { tests tests_A; git apply -R $Q/A.patch; } ;;
Q1) bench tree_1
    git apply $Q/B.patch && { bench B; git apply -R $Q/B.patch; } ;;
Q2) git apply $Q/A.patch && { bench A; git apply -R $Q/A.patch; }
    bench tree_2 ;;
esac
git status --short > $OUT/tree_after.txt

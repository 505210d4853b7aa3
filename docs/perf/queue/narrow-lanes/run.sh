#!/usr/bin/env bash
# The narrow lanes' device stages, one a call (run from the repository root: docs/perf/queue/narrow-lanes/run.sh Q0):
#   Q0  correctness: C.patch through the grouped-GEMM, prefill-path and dense tests
#   Q0b B.patch and A.patch through the grouped-GEMM tests
#   Q1  the tree, then C.patch: bench --prefill --stages (no peers) at 16..4096 rows, same process order, one card
#   Q2  B.patch, A.patch, then the tree again, at 16 / 128 / 448 / 1024 rows (on the machine Q1 ran on)
# Each writes its logs and tables under $OUT; the tree is left as it was found (tree_after.txt says so).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
Q=docs/perf/queue/narrow-lanes
TOPO=h100-1; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && TOPO=h200-1
pip install --no-deps -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
bench() {  # bench NAME SECONDS ROWS...: the prefill stages and variant tables of the tree as it now is
  local name=$1 limit=$2; shift 2
  timeout $limit python -m glm_ep bench --prefill --stages --topology $TOPO --rows "$@" --no-peer --out /tmp/$name \
    > $OUT/$name.log 2>&1
  echo "bench rc $?" >> $OUT/$name.log
  cp /tmp/$name/PREFILL_*.md $OUT/$name.md 2>/dev/null
  tail -1 $OUT/$name.log
}
tests() {  # tests NAME SECONDS FILES...
  local name=$1 limit=$2; shift 2
  timeout $limit python -m pytest -q -p no:cacheprovider "$@" > $OUT/$name.log 2>&1
  echo "tests rc $?" >> $OUT/$name.log
  tail -2 $OUT/$name.log
}
case "$1" in
Q0) git apply $Q/C.patch && { tests tests_C 240 tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_paths.py \
        tests/cuda/test_cuda_dense.py; git apply -R $Q/C.patch; } ;;
Q0b) git apply $Q/B.patch && { tests tests_B 130 tests/cuda/test_cuda_gemm.py; git apply -R $Q/B.patch; }
    git apply $Q/A.patch && { tests tests_A 130 tests/cuda/test_cuda_gemm.py; git apply -R $Q/A.patch; } ;;
Q1) W="16 64 128 256 448 1024 4096"
    bench tree_1 270 $W
    git apply $Q/C.patch && { bench C 270 $W; git apply -R $Q/C.patch; } ;;
Q2) W="16 128 448 1024"
    git apply $Q/B.patch && { bench B 175 $W; git apply -R $Q/B.patch; }
    git apply $Q/A.patch && { bench A 175 $W; git apply -R $Q/A.patch; }
    bench tree_2 175 $W ;;
esac
git status --short > $OUT/tree_after.txt

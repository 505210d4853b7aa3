#!/usr/bin/env bash
# The narrow lanes' device stages on one H100 (2026-12-07), one a call, from the repository root
# (docs/perf/runs/2026-12-07-narrow-lanes/run.sh Q0). Q0..Q2 ran on tree 655234b with the patches applied in turn (the
# patches then in docs/perf/queue/narrow-lanes); P1 and P2 on that tree with A applied (A is commit 5cea6af); P3 on
# the tree with A and pdl_sorted (2dc22de).
#   Q0  correctness: C.patch through the grouped-GEMM, prefill-path and dense tests        -> q0_tests_C.log
#   Q1  the tree, then C.patch: bench --prefill --stages (no peers) at 16..4096 rows        -> q1_tree.md, q1_C.md
#   Q2  B.patch, A.patch, then the tree again, at 16 / 128 / 448 / 1024 rows                -> q2_B.md, q2_A.md, q2_tree.md
#   P1  A.patch through the grouped-GEMM, prefill-path and dense tests                      -> p1_tests_A.log
#   P2  A.patch: bench --prefill --stages with its peers, 16..4096 rows                     -> p2_PREFILL_H100_A.md
#   P3  the tree (A and pdl_sorted landed): the prefill-path tests, then bench --prefill --stages (no peers) with
#       pdl_sorted = true added to the card's topology: its "site" column with programmatic launches on the sorted
#       path (the lever's old behaviour), its last column the whole site plain (the new default) -> p3_*
# (Q0b, B's and A's grouped-GEMM tests alone, was not run: P1 covers A.)
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
Q=docs/perf/runs/2026-12-07-narrow-lanes
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
Q1) W="16 64 128 256 448 1024 4096"
    bench tree_1 270 $W
    git apply $Q/C.patch && { bench C 270 $W; git apply -R $Q/C.patch; } ;;
Q2) W="16 128 448 1024"
    git apply $Q/B.patch && { bench B 175 $W; git apply -R $Q/B.patch; }
    git apply $Q/A.patch && { bench A 175 $W; git apply -R $Q/A.patch; }
    bench tree_2 175 $W ;;
P1) git apply $Q/A.patch && { tests tests_A_full 250 tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_paths.py \
        tests/cuda/test_cuda_dense.py; git apply -R $Q/A.patch; } ;;
P2) git apply $Q/A.patch && {
      timeout 430 python -m glm_ep bench --prefill --stages --topology $TOPO --rows 16 64 128 256 512 1024 4096 \
        --out /tmp/prefill > $OUT/prefill_A.log 2>&1; echo "bench rc $?" >> $OUT/prefill_A.log
      cp /tmp/prefill/PREFILL_* /tmp/prefill/prefill_* $OUT/ 2>/dev/null; git apply -R $Q/A.patch; } ;;
P3) git log --oneline -1 > $OUT/tree.txt
    tests p3_tests_paths 150 tests/cuda/test_cuda_paths.py
    sed 's/^\[levers\]$/[levers]\npdl_sorted = true/' configs/$TOPO.toml > /tmp/pdl_sorted.toml
    grep -q "^pdl_sorted = true" /tmp/pdl_sorted.toml && TOPO=/tmp/pdl_sorted.toml && bench p3_pdl 150 16 64 128 256 448 1024 4096 ;;
P3b) git log --oneline -1 > $OUT/tree.txt  # P3's bench alone, fewer widths, for a short budget
    sed 's/^\[levers\]$/[levers]\npdl_sorted = true/' configs/$TOPO.toml > /tmp/pdl_sorted.toml
    grep -q "^pdl_sorted = true" /tmp/pdl_sorted.toml && TOPO=/tmp/pdl_sorted.toml && bench p3b_pdl 150 64 128 256 4096 ;;
esac
git status --short > $OUT/tree_after.txt

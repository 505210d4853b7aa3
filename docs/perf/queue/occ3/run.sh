#!/usr/bin/env bash
# The placed 16-row tile at three blocks an SM instead of four (occ3.patch: 20 KB of shared memory a block asked for and never used), one stage a call, from the repository
# root (docs/perf/queue/occ3/run.sh S1):
#   S1  bench --prefill --stages (no peers) at 16 / 64 / 128 / 256 / 448 rows: the tree, the patch, the tree, the
#       patch, each in a process of its own; then the grouped-GEMM and prefill-path tests with the patch
#   S1b S1 for a short budget: 16 / 64 / 256 rows, the tree and the patch alternated twice, then the tests (what time
#       is left)
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
Q=docs/perf/queue/occ3
TOPO=h100-1; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && TOPO=h200-1
pip install --no-deps -e . >/dev/null 2>&1
# a call brings back 8 files at most: the bench logs stay on the device, their last lines go to info.txt
{ nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1; } > $OUT/info.txt
bench() {  # bench NAME SECONDS ROWS...
  local name=$1 limit=$2; shift 2
  timeout $limit python -m glm_ep bench --prefill --stages --topology $TOPO --rows "$@" --no-peer --out /tmp/$name \
    > /tmp/$name.log 2>&1
  echo "$name: bench rc $?" >> /tmp/$name.log
  cp /tmp/$name/PREFILL_*.md $OUT/$name.md 2>/dev/null
  tail -2 /tmp/$name.log | tee -a $OUT/info.txt
}
ab() {  # ab SECONDS_A_BENCH SECONDS_FOR_TESTS ROWS...: tree and patch alternated twice, then the tests with the patch
  local limit=$1 tlimit=$2; shift 2
  for pass in 1 2; do
    bench tree_$pass $limit "$@"
    git apply $Q/occ3.patch && { bench occ3_$pass $limit "$@"; git apply -R $Q/occ3.patch; }
  done
  git apply $Q/occ3.patch && {
    timeout $tlimit python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_paths.py \
      > $OUT/tests_occ3.log 2>&1; echo "tests rc $?" >> $OUT/tests_occ3.log; tail -2 $OUT/tests_occ3.log
    git apply -R $Q/occ3.patch; }
}
case "$1" in
S1) ab 90 200 16 64 128 256 448 ;;
S1b) ab 80 150 16 64 256 ;;  # 80 s: on a fresh machine the first bench compiles its kernels (60 s ran out)
esac
git status --short >> $OUT/info.txt

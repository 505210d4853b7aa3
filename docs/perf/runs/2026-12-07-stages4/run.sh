#!/usr/bin/env bash
# The placed 16-row tile with four stages instead of three (stages4.patch), one stage a call, from the repository
# root (docs/perf/runs/2026-12-07-stages4/run.sh S1; run from docs/perf/queue/stages4):
#   S1  bench --prefill --stages (no peers) at 16 / 64 / 128 / 256 / 448 rows: the tree, the patch, the tree, the
#       patch, each in a process of its own; then the grouped-GEMM and prefill-path tests with the patch
#   S2  ncu on the tree's grouped GEMM in the site (ncu_probe.py): gate + up and down of the placed 16-row tile at 16
#       and 256 rows, of the 64-row wgmma tile at 1024 rows
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
Q=docs/perf/runs/2026-12-07-stages4
TOPO=h100-1; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && TOPO=h200-1
pip install --no-deps -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
git log --oneline -1 > $OUT/tree.txt
bench() {  # bench NAME SECONDS ROWS...
  local name=$1 limit=$2; shift 2
  timeout $limit python -m glm_ep bench --prefill --stages --topology $TOPO --rows "$@" --no-peer --out /tmp/$name \
    > $OUT/$name.log 2>&1
  echo "bench rc $?" >> $OUT/$name.log
  cp /tmp/$name/PREFILL_*.md $OUT/$name.md 2>/dev/null
  tail -1 $OUT/$name.log
}
case "$1" in
S1) W="16 64 128 256 448"
    for pass in 1 2; do
      bench tree_$pass 90 $W
      git apply $Q/stages4.patch && { bench stages4_$pass 90 $W; git apply -R $Q/stages4.patch; }
    done
    git apply $Q/stages4.patch && {
      timeout 200 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_paths.py \
        > $OUT/tests_stages4.log 2>&1; echo "tests rc $?" >> $OUT/tests_stages4.log; tail -2 $OUT/tests_stages4.log
      git apply -R $Q/stages4.patch; } ;;
S2) S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats
       --section Occupancy --section LaunchStats"
    for rv in "16 m16w4k128p" "256 m16w4k128p" "1024 m64wg4k64"; do
      set -- $rv
      timeout 150 ncu --kernel-name regex:"nvfp4_gemm_sorted_(glu_)?$2\$" --launch-skip 6 --launch-count 2 $S \
        python $Q/ncu_probe.py $1 > $OUT/ncu_$1.txt 2>&1
      echo "ncu rc $?" >> $OUT/ncu_$1.txt; tail -1 $OUT/ncu_$1.txt
    done ;;
esac
git status --short > $OUT/tree_after.txt

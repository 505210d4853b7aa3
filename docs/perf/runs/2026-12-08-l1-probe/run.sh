#!/usr/bin/env bash
# Two probes of why four stages and five blocks an SM made the placed 16-row tile slower, one call, from the
# repository root (docs/perf/queue/inflight/run.sh P1):
#   P1  bench --prefill --stages (no peers) at 16 / 64 / 256 rows: the tree, occ3.patch (three blocks an SM), l1.patch
#       (four blocks, the shared-memory carveout at its most: L1 at its least), twice over, each in a process of its own
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
Q=docs/perf/queue/inflight
TOPO=h100-1; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && TOPO=h200-1
pip install --no-deps -e . >/dev/null 2>&1
# a call brings back 8 files at most: the bench logs stay on the device, their last lines go to info.txt
{ nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1; } > $OUT/info.txt
bench() {  # bench NAME SECONDS [PATCH]: the tree, or the tree with PATCH applied
  local name=$1 limit=$2 patch=$3
  [ -n "$patch" ] && { git apply $Q/$patch || return; }
  timeout $limit python -m glm_ep bench --prefill --stages --topology $TOPO --rows 16 64 256 --no-peer \
    --out /tmp/$name > /tmp/$name.log 2>&1
  echo "$name: bench rc $?" >> /tmp/$name.log
  [ -n "$patch" ] && git apply -R $Q/$patch
  cp /tmp/$name/PREFILL_*.md $OUT/$name.md 2>/dev/null
  tail -2 /tmp/$name.log | tee -a $OUT/info.txt
}
case "$1" in
P1) bench tree_1 120; bench occ3_1 60 occ3.patch; bench l1_1 60 l1.patch  # 120 s: the first compiles the kernels
    bench tree_2 60; bench occ3_2 60 occ3.patch; bench l1_2 60 l1.patch ;;
esac
git status --short >> $OUT/info.txt

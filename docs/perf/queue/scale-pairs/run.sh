#!/usr/bin/env bash
# The narrow 128-k tiles' block scales copied two stages at a time (16-byte cp.async.cg into a ring of their own)
# instead of 8 bytes a stage by cp.async.ca, which keeps every row's scale line in L1. From the repository root, one
# stage a call (docs/perf/queue/scale-pairs/run.sh S1):
#   S1  with pairs.patch applied, the GPU tests of the 128-k tiles (the stage sweep's among them); then bench --prefill
#       --stages --no-peer at 16 / 64 / 256 rows alternating the pairs and the tree, twice while the call has time
#       (about 500 s on a fresh H100)
#   S2  the pairs with the stage sweep's variant table (--gemm-stages: the placed tile at 2 and 4 stages beside its
#       3, and the other default tiles' counts), and with five blocks an SM (occ5.patch, the patch of
#       ../../runs/2026-12-08-occ5/, on top of pairs.patch), alternating with the pairs alone
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
Q=docs/perf/queue/scale-pairs
TOPO=h100-1; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && TOPO=h200-1
pip install --no-deps -e . >/dev/null 2>&1
{ nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1; } > $OUT/info.txt
bench() {  # bench NAME SECONDS [PATCH ...]: the tree with the patches applied in order, then taken back
  local name=$1 limit=$2; shift 2
  local p applied=()
  for p in "$@"; do git apply $Q/$p || { echo "$name: $p failed" >> $OUT/info.txt; break; }; applied=($p "${applied[@]}"); done
  timeout $limit python -m glm_ep bench --prefill --stages --topology $TOPO --rows 16 64 256 --no-peer $EXTRA \
    --out /tmp/$name > /tmp/$name.log 2>&1
  echo "$name: bench rc $?" >> /tmp/$name.log
  for p in "${applied[@]}"; do git apply -R $Q/$p; done
  grep -E "^\| (16|64|256) \| [0-9]+ \|" /tmp/$name/PREFILL_*.md 2>/dev/null | sed "s/^/$name /" >> $OUT/info.txt
  grep -E "^\| (16|64|256) \| [0-9.]+ \| router" /tmp/$name/PREFILL_*.md 2>/dev/null | sed "s/^/$name /" >> $OUT/stages.txt
  cp /tmp/$name/PREFILL_*.md $OUT/$name.md 2>/dev/null
  tail -1 /tmp/$name.log >> $OUT/info.txt
}
case "$1" in
S1) git apply $Q/pairs.patch
    timeout 240 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_gemm.py -k "k128 or k_split" \
      > $OUT/tests.log 2>&1; echo "tests rc $?" >> $OUT/info.txt; tail -3 $OUT/tests.log >> $OUT/info.txt
    git apply -R $Q/pairs.patch
    bench pairs_1 120 pairs.patch; bench tree_1 120
    [ $SECONDS -lt 420 ] && bench pairs_2 60 pairs.patch; [ $SECONDS -lt 490 ] && bench tree_2 60 ;;
S2) EXTRA=--gemm-stages bench sweep_1 240 pairs.patch; bench o5_1 120 pairs.patch occ5.patch
    bench pairs_3 120 pairs.patch; [ $SECONDS -lt 480 ] && bench o5_2 60 pairs.patch occ5.patch ;;
esac
git status --short >> $OUT/info.txt

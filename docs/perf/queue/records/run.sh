#!/usr/bin/env bash
# Records of the tree as it is, stale or never made on it (run from the repository root, one stage a call):
#   R1  glm-ep bench --prefill --stages with its peers at 16..4096 rows: PREFILL_<card>.md on the current defaults,
#       with the site on plain launches (the stage table's last column, 3d80086: not yet run on a GPU)
#   R2  glm-ep bench (decode, 1 row and verify 2..8) with its peers: BENCH_<card>.md (the H200's is from 2026-12-04)
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
TOPO=h100-1; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && TOPO=h200-1
pip install --no-deps -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
git log --oneline -1 > $OUT/tree.txt
case "$1" in
R1) timeout 420 python -m glm_ep bench --prefill --stages --topology $TOPO --rows 16 64 128 256 512 1024 4096 \
      --out /tmp/prefill > $OUT/prefill.log 2>&1; echo "bench rc $?" >> $OUT/prefill.log
    cp /tmp/prefill/PREFILL_* /tmp/prefill/prefill_* $OUT/ 2>/dev/null
    tail -2 $OUT/prefill.log ;;
R2) timeout 400 python -m glm_ep bench --topology $TOPO --out /tmp/decode > $OUT/decode.log 2>&1
    echo "bench rc $?" >> $OUT/decode.log
    cp /tmp/decode/BENCH_* /tmp/decode/bench_* $OUT/ 2>/dev/null
    tail -2 $OUT/decode.log ;;
esac

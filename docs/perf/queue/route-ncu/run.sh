#!/usr/bin/env bash
# Every kernel of the sparse site at 16 and 64 rows under ncu, its GPU time each: what the route stage's 30 µs (the
# router's logits, the one-warp-a-row top-k at 8 µs whatever the width, the shared gate + up) and the shared down +
# combine's 16 µs are made of, cold (ncu flushes the caches before each kernel, as the stage table flushes the L2)
# and hot (as inside a site). ncu runs the kernels one at a time at its base clock. From the repository root:
#   N1  ncu_probe.py of ../../runs/2026-12-07-stages4/ (4 site calls) under ncu at 16 and 64 rows, caches flushed
#       and not; about 300 s
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
P=docs/perf/runs/2026-12-07-stages4/ncu_probe.py  # four site calls on the card's levers
pip install --no-deps -e . >/dev/null 2>&1
{ nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1; } > $OUT/info.txt
python $P 16 >> $OUT/info.txt 2>&1  # compiles the kernels outside ncu
case "$1" in
N1) for rows in 16 64; do
      for cc in all none; do
        timeout 120 ncu --cache-control $cc --metrics gpu__time_duration.sum --print-summary per-kernel \
          python $P $rows > $OUT/ncu_${rows}_$cc.txt 2>&1
        echo "ncu $rows rows, caches $cc: rc $?" >> $OUT/info.txt
      done
    done ;;
esac

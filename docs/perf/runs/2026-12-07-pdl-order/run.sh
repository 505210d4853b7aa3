#!/usr/bin/env bash
# The stage table's plain-launch column against its place in the run (order_probe.py), one call, from the repository
# root (docs/perf/runs/2026-12-07-pdl-order/run.sh O1; run from docs/perf/queue/pdl-order):
#   O1  order_probe.py on the tree (pdl_sorted as built), then with pdl_sorted = true
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
Q=docs/perf/runs/2026-12-07-pdl-order
pip install --no-deps -e . >/dev/null 2>&1
case "$1" in
O1) { nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1; } > $OUT/order.log
    timeout 150 python $Q/order_probe.py >> $OUT/order.log 2>&1; echo "probe rc $?" >> $OUT/order.log
    timeout 150 python $Q/order_probe.py pdl_sorted >> $OUT/order.log 2>&1; echo "probe rc $?" >> $OUT/order.log
    tail -5 $OUT/order.log ;;
esac

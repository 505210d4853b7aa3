#!/usr/bin/env bash
# 2026-12-07, one H100, three calls on one warm card, each in the repository root of the device machine ($OUT an
# empty folder), the tree with a 6-row union stage (UNION_RING_ROWS = (2, 4, 6, 8)) and the (slab 2, depth 2)
# union kernels instantiated.
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -q -e .
case "${1:-}" in
ab)  # 348 s: r6_{1,2}.log (the tree, configs/h100-1.toml as it was), r8_{1,2}.log (cli_r8.py: stages of 2, 4 or 8
     # rows, as before), d2_{1,2}.log (d2.toml: h100-1 with ring_union_depth = [2, 3], the down projection's union
     # ring at depth 2), alternating; test_cuda_union.py first, cut by its 200 s timeout while compiling (rerun below)
  cp configs/h100-1.toml $OUT/d2.toml; sed -i 's/^name = .*/name = "h100-1-d2"/' $OUT/d2.toml
  echo 'ring_union_depth = [2, 3]' >> $OUT/d2.toml
  for i in 1 2; do
    python -m glm_ep bench --topology h100-1 --no-peer --out $OUT/r6_$i > $OUT/r6_$i.log 2>&1
    python cli_r8.py bench --topology h100-1 --no-peer --out $OUT/r8_$i > $OUT/r8_$i.log 2>&1
    python -m glm_ep bench --topology $OUT/d2.toml --no-peer --out $OUT/d2_$i > $OUT/d2_$i.log 2>&1
  done ;;
tests)  # 220 s: tests.txt
  python -m pytest -q -p no:cacheprovider -x tests/cuda/test_cuda_union.py ;;
bench)  # 52 s, configs/h100-1.toml with ring_union_depth = [2, 3]: bench.log, docs/perf/BENCH_H100.md
  python -m glm_ep bench --topology h100-1 --out $OUT/bench > $OUT/bench.log 2>&1 ;;
esac

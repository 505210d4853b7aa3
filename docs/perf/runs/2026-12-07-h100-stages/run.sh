#!/usr/bin/env bash
# 2026-12-07, one H100 (tree e3cdcdf): the decode bench and the prefill bench on the H100's one-rank levers
# (configs/h100-1.toml), each run in the repository root of the device machine, $OUT an empty folder.
# Outputs: docs/perf/BENCH_H100.md, bench_h100.json/.png, PREFILL_H100.md, prefill_h100.json/.png; the logs here.
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -q -e .
case "${1:-}" in
bench)  # 84 s
  python -m glm_ep bench --topology h100-1 --out $OUT/bench 2>&1 | tee $OUT/bench.log ;;
prefill)  # 92 s
  python -m glm_ep bench --prefill --topology h100-1 --out $OUT/prefill 2>&1 | tee $OUT/prefill.log ;;
esac

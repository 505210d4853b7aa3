#!/usr/bin/env bash
# How the files here were made, on one H100 (device call of 2026-12-07), from the repository root of tree e598366
# (ring claims from 3 items a warp). Outputs go to $OUT (default: this folder); the results files are
# docs/perf/BENCH_H100.md and PREFILL_H100.md (their json and png did not come back from the device).
set -e
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=docs/perf/runs/2026-12-07-h100-claims3
OUT=${OUT:-$R}
pip install --no-deps -e . >/dev/null
python -m pytest -q tests/cuda/test_cuda_union.py tests/cuda/test_cuda_ring.py -k claims > $OUT/run1_tests_claims.txt 2>&1
python -m glm_ep bench --topology h100-1 --out $OUT/bench > $OUT/run1_bench.log 2>&1  # $OUT: /root/out there
python -m glm_ep bench --topology h100-1 --no-peer --out /tmp/m3 > $OUT/run1_bench_nopeer.log 2>&1
python -m glm_ep bench --prefill --stages --topology h100-1 --out /tmp/prefill > $OUT/run1_prefill.log 2>&1

#!/usr/bin/env bash
# 2026-12-07, one H100, one call (181 s), in the repository root of the device machine ($OUT an empty folder).
# "new": the tree with gemv_bf16.cu's gemv_combine reading its owner lanes' routed terms before the K loop,
# ring_down_combine.cuh's combine reading in rounds of 8, and elementwise.cu's combine reading its slots in rounds
# of 8 (elementwise_rounds.patch: measured, not kept). "old": those three files as in tree 5910c19.
# tests.txt: the GPU tests of the new kernels (210 passed); b1..b4: the decode bench, new / old alternating.
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -q -e .
python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_elementwise.py tests/cuda/test_cuda_dense.py \
  tests/cuda/test_cuda_ring.py -k "combine or gemv or elementwise or glu or dense"
i=0
for v in new old new old; do  # the three files of $v copied into glm_ep/backend/cuda/kernels/ first
  i=$((i+1)); python -m glm_ep bench --topology h100-1 --no-peer --out $OUT/b${i}_$v > b${i}_$v.log 2>&1
done
# bench (a later call, another H100 start, tree 484c1ba: the GEMV and ring changes kept, the combine kernel as
# before): bench.log, docs/perf/BENCH_H100.md and its json and png.
python -m glm_ep bench --topology h100-1 --out $OUT/bench > bench.log 2>&1

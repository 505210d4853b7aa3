#!/usr/bin/env bash
# 2026-12-07, one H100, two calls on one warm card, each in the repository root of the device machine ($OUT an
# empty folder), tree 99084d3.
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -q -e .
case "${1:-}" in
tests)  # 430 s: tests_ring_router_elementwise_dense.txt (327 passed), tests_union.txt (52 passed)
  python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_ring.py tests/cuda/test_cuda_router.py \
    tests/cuda/test_cuda_elementwise.py tests/cuda/test_cuda_dense.py
  python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_union.py ;;
sweeps)  # 11 s: SWEEP_RING.md / sweep_ring.json, SWEEP_UNION.md / sweep_union.json
  python -m glm_ep bench --sweep ring --out $OUT/ring
  python -m glm_ep bench --sweep union --out $OUT/union ;;
esac

#!/usr/bin/env bash
# How the files here were made, on one H200, from the repository root of tree 48ebfba, $OUT the outputs' folder:
# stream.patch applied, the streaming variants' GEMM tests, then stream_probe.py on the H200's topology.
set -e
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=docs/perf/runs/2026-12-07-h200-stream
git apply $R/stream.patch
pip install --no-deps -e . >/dev/null
python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_gemm.py -k "variants and (d4s or d3s)" > $OUT/s_tests.log 2>&1 || true
python $R/stream_probe.py configs/h200-1.toml 16 64 128 256 1024 > $OUT/s_probe.log 2>&1

#!/usr/bin/env bash
# How the files here were made, from the repository root of tree 48ebfba (the stream test's fix applied), $OUT the
# outputs' folder; TOPO=h200-1 on the H200, h100-1 on the H100. route_stage.py is this folder's (on the H200 it ran
# without its eager columns and the cuBLAS pair: h200_route_stage_before.log's header says which columns it had).
set -e
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=docs/perf/runs/2026-12-07-h100-route
pip install --no-deps -e . >/dev/null
if [ "$TOPO" = h200-1 ]; then  # first call, the H200: the stage table at 16..1024 rows and the route stage op by op
  python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_stream.py > $OUT/h200_tests.log 2>&1 || true
  python -m glm_ep bench --prefill --stages --topology $TOPO --rows 16 64 128 256 1024 --no-peer --out /tmp/prefill \
    > $OUT/h200_prefill_stages_before.log 2>&1
  python $R/route_stage.py configs/$TOPO.toml > $OUT/h200_route_stage_before.log 2>&1
  exit 0
fi
# the H100: the flush test, the route stage op by op, the stage table before and after route.patch, its tests
python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_stream.py > $OUT/tests.log 2>&1
python $R/route_stage.py configs/$TOPO.toml > $OUT/route_stage.log 2>&1
python -m glm_ep bench --prefill --stages --topology $TOPO --rows 16 64 --no-peer --out /tmp/pb > $OUT/prefill_before.log 2>&1
git apply $R/route.patch
python -m glm_ep bench --prefill --stages --topology $TOPO --rows 16 64 --no-peer --out /tmp/pa > $OUT/prefill_after.log 2>&1
python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_router.py tests/cuda/test_cuda_dense.py > $OUT/route_tests.log 2>&1

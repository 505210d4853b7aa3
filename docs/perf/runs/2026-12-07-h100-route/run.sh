R)
  # the flush test (built before its spin), the route stage op by op with cuBLAS beside, the prefill stage table
  # before and after the route patch (router logits and the shared gate + up on cuBLAS from 9 rows)
  stage tests
  timeout 100 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_stream.py > $OUT/tests.log 2>&1; echo rc $?; tail -2 $OUT/tests.log
  stage route-stage
  timeout 150 python .devrun/route_stage.py configs/$TOPO.toml > $OUT/route_stage.log 2>&1; echo rc $?; grep -v INFO $OUT/route_stage.log | tail -12
  stage prefill-before
  timeout 120 python -m glm_ep bench --prefill --stages --topology $TOPO --rows 16 64 --no-peer --out /tmp/pb > $OUT/prefill_before.log 2>&1; echo rc $?; grep -A4 "^| rows | site" $OUT/prefill_before.log | cut -c1-330
  (git apply .devrun/route.patch 2>/dev/null || patch -p1 -s < .devrun/route.patch) && echo "route patch applied"
  stage prefill-after
  timeout 120 python -m glm_ep bench --prefill --stages --topology $TOPO --rows 16 64 --no-peer --out /tmp/pa > $OUT/prefill_after.log 2>&1; echo rc $?; grep -A4 "^| rows | site" $OUT/prefill_after.log | cut -c1-330
  stage route-tests
  timeout 150 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_router.py tests/cuda/test_cuda_dense.py > $OUT/route_tests.log 2>&1; echo rc $?; tail -2 $OUT/route_tests.log
  stage done ;;

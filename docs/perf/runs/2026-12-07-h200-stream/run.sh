S)
  # the streaming grouped-GEMM variants (patch from the stream branch): their tests, then against the narrow tiles
  (git apply .devrun/stream.patch 2>/dev/null || patch -p1 -s < .devrun/stream.patch) && echo "stream patch applied"
  stage s-tests
  timeout 240 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_gemm.py -k "variants and (d4s or d3s)" > $OUT/s_tests.log 2>&1; echo rc $?; tail -5 $OUT/s_tests.log
  stage s-probe
  timeout 240 python .devrun/stream_probe.py configs/$TOPO.toml 16 64 128 256 1024 > $OUT/s_probe.log 2>&1; echo rc $?; grep -v INFO $OUT/s_probe.log | tail -8
  stage done ;;

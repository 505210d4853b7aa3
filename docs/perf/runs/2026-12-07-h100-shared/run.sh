#!/usr/bin/env bash
# 2026-12-07, one H100, two calls, each in the repository root of the device machine ($OUT an empty folder).
# The shared expert's bf16 projections at 4..8 rows: the batch-M GEMV against the warp-streaming GEMM.
# cli_on.py sets glm_ep.backend.cuda.dense.WSTREAM_SMALL_MIN_ROWS to its first argument, then runs the CLI:
#   import sys; import glm_ep.backend.cuda.dense as d; d.WSTREAM_SMALL_MIN_ROWS = int(sys.argv.pop(1))
#   from glm_ep.app.cli import main; raise SystemExit(main())
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -q -e .
case "${1:-}" in
ab)  # tree d72e543 (the lever 0 by default), 180 s: ab_sweep.log, ab_on.log, ab_off.log, ab_tests_on.log
  python cli_on.py 0 bench --sweep dense --rows 2 4 5 6 8 --out $OUT/sweep > $OUT/sweep.log 2>&1
  python cli_on.py 4 bench --topology h100-1 --out $OUT/on > $OUT/on.log 2>&1
  python cli_on.py 0 bench --topology h100-1 --no-peer --out $OUT/off > $OUT/off.log 2>&1
  # with the lever at 4: test_route_and_glu_fused then asserted the fused launch it no longer takes (fixed since)
  python -m pytest -q -p small_on -x tests/cuda/test_cuda_paths.py tests/cuda/test_cuda_router.py > $OUT/tests_on.log 2>&1 ;;
default)  # the lever at 5 in the tree, 153 s: tests.log, bench.log (docs/perf/BENCH_H100.md), SWEEP_DENSE.md
  python -m pytest -q tests/cuda/test_cuda_router.py tests/cuda/test_cuda_elementwise.py tests/cuda/test_cuda_dense.py \
      tests/cuda/test_cuda_paths.py > $OUT/tests.log 2>&1
  python -m glm_ep bench --topology h100-1 --out $OUT/bench > $OUT/bench.log 2>&1
  python cli_on.py 5 bench --sweep dense --rows 4 5 8 --out $OUT/sweep > $OUT/sweep.log 2>&1 ;;
fused)  # router_wstream_glu.patch applied (not kept), 149 s: fused_tests.log, fused_bench.log, fused_memcheck.log,
        # fused_racecheck.log
  python -m pytest -q tests/cuda/test_cuda_router.py tests/cuda/test_cuda_elementwise.py tests/cuda/test_cuda_dense.py \
      tests/cuda/test_cuda_paths.py > $OUT/tests.log 2>&1
  python -m glm_ep bench --topology h100-1 --out $OUT/bench > $OUT/bench.log 2>&1
  compute-sanitizer --tool memcheck --error-exitcode 9 python -m pytest -q tests/cuda/test_cuda_router.py \
      -k "glu_fused and 288 and (5 or 8)" > $OUT/memcheck.log 2>&1
  compute-sanitizer --tool racecheck --error-exitcode 9 python -m pytest -q tests/cuda/test_cuda_router.py \
      -k "glu_fused and 32-256 and 5" > $OUT/racecheck.log 2>&1 ;;
ab2)  # the patch applied, 64 s: ab2_fused{1,2}.log against ab2_sep{1,2}.log, alternating on one warm card.
      # cli_sep.py replaces route_kernels.router_topk_wstream_glu by the two launches it fuses
      # (route_kernels.router_topk_fused, then dense.wstream_glu_bf16), then runs the CLI
  for i in 1 2; do
    python -m glm_ep bench --topology h100-1 --no-peer --out $OUT/fused$i > $OUT/fused$i.log 2>&1
    python cli_sep.py bench --topology h100-1 --no-peer --out $OUT/sep$i > $OUT/sep$i.log 2>&1
  done ;;
esac

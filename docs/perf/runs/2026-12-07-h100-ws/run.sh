#!/usr/bin/env bash
# The commands of these runs (one H100, 2026-12-07), each run one device call from the repository root with the lab
# kernel folders beside it: .devrun/kernels_ws (kernels_ws.patch: one producer warp), kernels_ws2 (the same, its
# gemm_nvfp4.cu line GEMM_WGMMA_WS(64, 4, 6, 2, 2): two), kernels_mb (kernels_mb.patch), kernels_u (kernels_u.patch),
# and under .devrun/ the helpers: kdir.py, ws.py and test_union_stale.py (here), compare.py
# (../2026-12-06-h100-wide/compare.py) and probe3.py (../2026-12-06-h100-staged/probe3.py with probe3.patch).
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
T=(-q -x -p no:cacheprovider tests/cuda/test_cuda_gemm.py -k "wg or experts_sorted or stage or variants")
case "$1" in
run1)  # the producer-warp 64-row tile against the tree: its tests, two passes of timings, outputs compared (run1_*)
  python .devrun/ws.py pytest "${T[@]}"
  R=1024,2048,4096
  OUT=/tmp python .devrun/probe3.py --rows=$R --variants=m64wg4k64 --save
  OUT=/tmp python .devrun/ws.py probe --rows=$R --variants=m64wg4k64 --save
  python .devrun/compare.py tree kernels_ws
  OUT=/tmp python .devrun/probe3.py --rows=$R --variants=m64wg4k64
  OUT=/tmp python .devrun/ws.py probe --rows=$R --variants=m64wg4k64
  ;;
run2)  # the engine on mbarriers (both tiles) against the tree; two producer warps at 1024 rows (run2_*)
  python .devrun/kdir.py kernels_mb pytest "${T[@]}"
  R=1024,2048,4096
  OUT=/tmp python .devrun/probe3.py --kdir=kernels_mb --rows=$R --variants=m64wg4k64,m128wg8k64 --save
  OUT=/tmp python .devrun/probe3.py --rows=$R --variants=m64wg4k64,m128wg8k64 --save
  python .devrun/compare.py tree kernels_mb
  KDIR=kernels_ws2 PW=2 OUT=/tmp python .devrun/ws.py probe --rows=1024 --variants=m64wg4k64
  ;;
run3)  # two producer warps: tests, then tree and ws2 alternated twice at 1024..2048 rows (run3_*)
  KDIR=kernels_ws2 PW=2 python .devrun/ws.py pytest "${T[@]}"
  for i in 1 2; do
    OUT=/tmp python .devrun/probe3.py --rows=1024,1536,2048 --variants=m64wg4k64
    KDIR=kernels_ws2 PW=2 OUT=/tmp python .devrun/ws.py probe --rows=1024,1536,2048 --variants=m64wg4k64
  done
  ;;
run4)  # the union sweep of the tree (run4_*)
  python -m glm_ep bench --sweep union --out $OUT
  ;;
run5)  # the union ring with an absent row's copies left out: its tests under a 60 s timeout, the stale-row test, the sweep (run5_*)
  timeout 60 python .devrun/kdir.py kernels_u pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_union.py
  cp .devrun/test_union_stale.py tests/cuda/test_lab_union_stale.py
  python .devrun/kdir.py kernels_u pytest -q -p no:cacheprovider tests/cuda/test_lab_union_stale.py
  python -m pytest -q -p no:cacheprovider tests/cuda/test_lab_union_stale.py
  python .devrun/kdir.py kernels_u glm_ep bench --sweep union --out $OUT/u
  ;;
run6)  # the same union tests again under a 90 s timeout (run6_*)
  timeout 90 python .devrun/kdir.py kernels_u pytest -q -p no:cacheprovider tests/cuda/test_cuda_union.py tests/cuda/test_lab_union_stale.py
  ;;
esac

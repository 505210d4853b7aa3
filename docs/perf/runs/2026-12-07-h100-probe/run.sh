#!/usr/bin/env bash
# How the files here were made, on one H100 (device calls of 2026-12-07), from the repository root. run1 ran on
# tree d15bc9b with ring_probe.py's first form (the same marks, at the pipeline's lines of that tree); the
# ring_probe.py here marks the pipeline as committed with the claims. The probes patch the kernel sources in memory
# (never the tree): see each script's docstring. Outputs go to $OUT (default: this folder).
set -e
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
pip install --no-deps -e . >/dev/null
R=docs/perf/runs/2026-12-07-h100-probe
OUT=${OUT:-$R}
case "${1:-}" in
run1)  # tree d15bc9b, before the claims (ring_probe.py then marked the same points of the pipeline as it was):
       # per-warp timelines of the rings, per-block ones of the grouped GEMM in the sparse site, ncu of the decode
       # ring's two launches
  python $R/ring_probe.py > $OUT/run1_ring_probe.txt
  python $R/gemm_probe.py h100-1 > $OUT/run1_gemm_probe.txt
  ncu --launch-skip 6 --launch-count 1 -k regex:nvfp4_ring_moe_glu --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats \
      python $R/ring_ncu.py > $OUT/run1_ncu_ring_glu.txt
  ncu --launch-skip 6 --launch-count 1 -k regex:nvfp4_ring_moe_down_combine --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats \
      python $R/ring_ncu.py > $OUT/run1_ncu_ring_down.txt ;;
run2)  # the claims' tests, then the decode bench with the ring's items claimed (the shipped levers) and at a fixed
       # stride, alternating; every ring launch then claimed (the committed tree claims from 4 items a warp)
  cp configs/h100-1.toml /tmp/fixed.toml; sed -i 's/^name = .*/name = "h100-1-fixed"/' /tmp/fixed.toml
  echo 'ring_claims = false' >> /tmp/fixed.toml
  timeout 170 python -m pytest -q tests/cuda/test_cuda_ring.py tests/cuda/test_cuda_union.py \
      -k "claims or down_combine_ring or (decode_ring and (w3 or w5 or default)) or t2d3-w3 or t2d2-w3 or rows_independent" \
      > $OUT/${1}_tests.txt  # cut by the 170 s limit after 27 passed, none failed
  for i in 1 2; do
    python -m glm_ep bench --topology h100-1 --no-peer --out /tmp/on$i > $OUT/${1}_bench_on$i.log
    python -m glm_ep bench --topology /tmp/fixed.toml --no-peer --out /tmp/off$i > $OUT/${1}_bench_off$i.log
  done ;;
*) echo "usage: $0 run1|run2"; exit 2 ;;
esac

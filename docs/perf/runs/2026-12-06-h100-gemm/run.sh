#!/usr/bin/env bash
# The four device calls of 2026-12-06 (one H100), from the repository root with this folder copied to .devrun/
# (probe.py's --kdir=NAME reads the kernel sources from .devrun/NAME instead of the tree's). What each call ran:
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
pip install --no-deps --no-build-isolation -q -e .
case "${1:-}" in
run1)  # the m16 GEMM at 16/64/256 rows and the crossover at 9..24 rows, then ncu on single launches
    python .devrun/probe.py times --cross
    S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats"
    S="$S --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section InstructionStats"
    ncu --kernel-name regex:"nvfp4_gemm_sorted(_glu)?_m16w4k64" --launch-count 2 $S python .devrun/probe.py once 64
    ncu --kernel-name regex:"ring" --launch-count 3 $S python .devrun/probe.py once 1
    ncu --kernel-name regex:"nvfp4_gemm_sorted_glu_m16w4k64" --launch-count 1 --set full --import-source no \
        -o m16glu python .devrun/probe.py once 64
    ncu -i m16glu.ncu-rep --page source --print-source sass --csv ;;  # the instruction mix of DESIGN-NOTES
run2)  # the per-thread dequantization table: kernels_before = the tree's kernels at c1566bd; then the tree
       # (70d423e's table, plus a m16w4k128 variant that was not kept)
    pytest -q tests/cuda/test_cuda_gemm.py
    python .devrun/probe.py times --kdir=kernels_before
    python .devrun/probe.py times ;;
run3)  # register caps: kernels_mb5 / kernels_mb6 = the tree (70d423e) with GEMM_VARIANT(16, 1, 4, 64, 4, 5 or 6)
    for k in "" --kdir=kernels_mb5 --kdir=kernels_mb6 ""; do python .devrun/probe.py times $k; done ;;
run4)  # the copies without address arithmetic (93a6788) against kernels_head = dbbdcc0's kernels
    pytest -q tests/cuda/test_cuda_gemm.py tests/cuda/test_cuda_paths.py
    for k in --kdir=kernels_head "" --kdir=kernels_head ""; do python .devrun/probe.py times $k; done ;;
esac

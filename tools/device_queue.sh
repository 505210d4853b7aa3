#!/usr/bin/env bash
# What is waiting for a device, in calls that each fit the device tool's 10 minutes (repository root):
#   bash tools/device_queue.sh a   # the CUDA tests not yet passed on a GPU (NVFP4 dense site, every union row against
#                                  # its decode), the 2-rank test, the ring's forms,
#                                  # glm-ep bench (its NVFP4 dense rows: ring against block kernels)
#   bash tools/device_queue.sh b   # the rest of the CUDA suite (~8 min)
#   bash tools/device_queue.sh c   # the dense down projection's K split, wide calls' host cost, bench --prefill
#   bash tools/device_queue.sh ablate # the one-row ring without its dequantization / math, and the glu's slot sweep
#                                  # built each way (~2 min; NOTES "Where the one-row ring's time goes")
#   bash tools/device_queue.sh one # a session with one call's time: a's tests and ring forms, the ring without
#                                  # its dequantization or math (where its time goes), bench --prefill at 16 and
#                                  # 64 rows (the dense site against its byte floor, the peers)
#   bash tools/device_queue.sh split # the grouped GEMM's K split: its tests, the NVFP4 dense site's paths, its
#                                  # launches by split count (tools/ksplit_probe.py), bench --prefill at 16 and
#                                  # 64 rows (its NVFP4 dense sweep, the peers)
#   bash tools/device_queue.sh items # the ring's min items an SM: its tests, one expert's one-row launches on the
#                                  # ring and the block kernels, glm-ep bench (the NVFP4 dense rows)
#   bash tools/device_queue.sh next # what waits (2026-12-05, last): the sort's tests at capped grids, its scratch
#                                  # made at upload and its shared memory checked at load (make_backend),
#                                  # one row of the NVFP4 dense FFN on the ring / block kernels,
#                                  # glm-ep bench (on an H200: then stage dequant for PREFILL.md)
#   bash tools/device_queue.sh dequant # the NVFP4 dense FFN through bf16 weights and cuBLAS: its tests (with the
#                                  # split tests not yet run on a GPU), then bench --prefill (its sweep, the peers)
#   bash tools/device_queue.sh wide # the CUDA tests not yet run on a GPU (next's and dequant's), then bench --prefill
#   bash tools/device_queue.sh sort # the multi-block sort by expert: its tests and the sorted paths', bench --prefill
#   bash tools/device_queue.sh shared # the shared expert's projections on cuBLAS from 9 / 17 rows: tests, bench --prefill
#   bash tools/device_queue.sh pair # the shared expert's gate + up in one batched cuBLAS call: its tests, the
#                                  # cuBLAS probe, bench --prefill
# Logs and results under $OUT (or /tmp/out).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
NEW="nvfp4_dense or rows_independent or union_ring"
stage() { date -u +"== %H:%M:%S $*"; }
one_row_and_bench() {  # one row of the NVFP4 dense FFN (ring, as shipped, block kernels), then glm-ep bench
    stage "one row of the NVFP4 dense FFN: ring, as shipped, block kernels"
    timeout 60 python3 tools/ksplit_probe.py --one-row 2>&1 | grep -v "^\[rank" | tee "$O/one_row.log"
    stage "bench"
    timeout 240 python3 -m glm_ep bench --out "$O/decode" 2>"$O/decode.err" | tail -24
}
cuda_tests() {  # cuda_tests NAME SECONDS EXPR FILE...: the CUDA tests of FILEs matching EXPR into NAME_tests.log;
    # succeeds only where some passed and none failed (the stages bench only what their tests passed)
    local name=$1 secs=$2 expr=$3
    shift 3
    stage "$name tests"
    timeout "$secs" python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m cuda "$@" -k "$expr" 2>&1 \
        | tee "$O/${name}_tests.log" | tail -8
    grep -q " passed" "$O/${name}_tests.log" && ! grep -Eq "^(FAILED|ERROR) | [0-9]+ (failed|errors?)\b" \
        "$O/${name}_tests.log" \
        || { echo "tests failed: no bench"; return 1; }
}
pip install -q --no-deps --no-build-isolation -e . > "$O/pip.log" 2>&1 || echo "pip failed (see pip.log)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$O/gpu.txt"
case "${1:-a}" in
a)
    stage "tests not yet passed on a GPU"
    timeout 200 python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m cuda tests/cuda/test_cuda_*.py -k "$NEW" 2>&1 \
        | tee "$O/new_tests.log" | tail -15
    stage "2 ranks"
    timeout 90 mpirun --allow-run-as-root -n 2 python3 -m pytest -q -p no:cacheprovider -m "cuda and mpi" \
        tests/cuda/test_cuda_paths.py 2>&1 | tail -3 | tee "$O/mpi2.log"  # the device has no pytest-mpi
    stage "ring variants"
    timeout 100 python3 tools/kernel_timing.py --ring-variants 2>&1 | tee "$O/ring_variants.log" | tail -22
    stage "bench"
    timeout 200 python3 -m glm_ep bench --out "$O/bench" 2>"$O/bench.err" | tail -30
    tail -3 "$O/bench.err" ;;
b)
    stage "suite"
    timeout 560 python3 -m pytest -q -rf --tb=line -p no:cacheprovider -m cuda tests/cuda/test_cuda_*.py -k "not ($NEW)" 2>&1 \
        | tee "$O/suite.log" | tail -25 ;;
c)
    stage "dense tiers"
    timeout 60 python3 tools/dense_tiers.py --rows 5 6 8 --shapes dense_down --wstream-splits 4 6 2>&1 \
        | tee "$O/dense_tiers.log" | tail -8
    stage "wide overhead"
    timeout 120 python3 tools/wide_overhead.py --rows 16 64 256 2>&1 | tee "$O/wide_overhead.log" | tail -20
    stage "bench --prefill"
    timeout 400 python3 -m glm_ep bench --prefill --out "$O/prefill" 2>"$O/prefill.err" | tail -40 ;;
split)
    stage "K split tests"
    timeout 240 python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m cuda tests/cuda/test_cuda_gemm.py \
        tests/cuda/test_cuda_paths.py -k "k_split or nvfp4_dense or glm_shape" 2>&1 | tee "$O/split_tests.log" | tail -15
    stage "K split probe"
    timeout 150 python3 tools/ksplit_probe.py --splits 1 2 4 8 16 2>&1 | grep -v "^\[rank" | tee "$O/ksplit_probe.log"
    stage "bench --prefill 16 64"
    timeout 300 python3 -m glm_ep bench --prefill --rows 16 64 --out "$O/prefill" 2>"$O/prefill.err" | tail -45
    tail -3 "$O/prefill.err" ;;
items)
    stage "ring min items tests"
    timeout 200 python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m cuda tests/cuda/test_cuda_ring.py \
        tests/cuda/test_cuda_paths.py -k "few_items or nvfp4_dense or default" 2>&1 | tee "$O/items_tests.log" | tail -8
    one_row_and_bench ;;
next)
    cuda_tests next 240 "sort_by_expert or sort_scratch or prefill_paths or make_backend" tests/cuda/test_cuda_kernels.py \
        tests/cuda/test_cuda_paths.py || exit 1
    one_row_and_bench ;;
dequant)
    cuda_tests dequant 220 "dequant or nvfp4_dense or partial_tiles or k_split" tests/cuda/test_cuda_gemm.py \
        tests/cuda/test_cuda_paths.py || exit 1
    stage "bench --prefill"
    timeout 360 python3 -m glm_ep bench --prefill --out "$O/prefill" 2>"$O/prefill.err" | tail -45
    tail -3 "$O/prefill.err" ;;
wide)
    stage "CUDA tests not yet run on a GPU"
    timeout 230 python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m cuda tests/cuda/test_cuda_gemm.py \
        tests/cuda/test_cuda_kernels.py tests/cuda/test_cuda_paths.py \
        -k "ragged_and_grid_stride or gemm_bf16_pair or upload_dense or dequant or nvfp4_dense or k_split" 2>&1 \
        | tee "$O/wide_tests.log" | tail -8
    stage "bench --prefill"
    timeout 330 python3 -m glm_ep bench --prefill --out "$O/prefill" 2>"$O/prefill.err" | tail -45
    tail -3 "$O/prefill.err" ;;
sort)
    cuda_tests sort 240 "sort or prefill_paths or sorted" tests/cuda/test_cuda_kernels.py tests/cuda/test_cuda_paths.py \
        tests/cuda/test_cuda_gemm.py || exit 1
    stage "dense tiers: the shared expert's shapes"
    timeout 90 python3 tools/dense_tiers.py --shapes shared_glu shared_down --rows 16 24 32 48 64 96 128 2>&1 \
        | tee "$O/dense_tiers.log" | tail -40
    stage "bench --prefill 256 1024 4096, no peers"
    timeout 200 python3 -m glm_ep bench --prefill --rows 256 1024 4096 --no-peer --out "$O/prefill" \
        2>"$O/prefill.err" | sed -n '/Routed-expert GEMMs alone/,/Grouped-GEMM variants/p' ;;
shared)
    cuda_tests shared 200 "linear or gate_up_act or mma_gemm or sort or prefill_paths or site" \
        tests/cuda/test_cuda_kernels.py tests/cuda/test_cuda_paths.py || exit 1
    stage "bench --prefill 16 64 128"
    timeout 240 python3 -m glm_ep bench --prefill --rows 16 64 128 --out "$O/prefill" 2>"$O/prefill.err" \
        | sed -n '/^## Sparse site/,/^## Routed/p;/^## Dense site, shared/,/^## Crossover sweep: row/p' ;;
pair)
    cuda_tests pair 240 "pair or upload_dense or gate_up_act or linear or 300 or site" tests/cuda/test_cuda_kernels.py \
        tests/cuda/test_cuda_paths.py || exit 1
    stage "cuBLAS probe"
    timeout 100 python3 tools/cublas_probe.py 2>&1 | grep -v "^\[rank" | tee "$O/cublas_probe.log"
    stage "bench --prefill"
    timeout 300 python3 -m glm_ep bench --prefill --out "$O/prefill" 2>"$O/prefill.err" | head -40 ;;
ablate)
    stage "ring ablation"
    timeout 150 python3 tools/kernel_timing.py --ring-ablation 2>&1 | tee "$O/ring_ablation.log" | tail -9
    for a in 0 2 1; do
        stage "glu sweep, RING_ABLATE=$a"
        timeout 100 python3 tools/glu_occupancy_probe.py --sweep --ring-ablate "$a" 2>&1 \
            | tee -a "$O/sweep_ablation.log" | tail -8
    done ;;
one)
    stage "tests not yet passed on a GPU"
    timeout 150 python3 -m pytest -q -rf --tb=short -p no:cacheprovider -m cuda tests/cuda/test_cuda_*.py -k "$NEW" 2>&1 \
        | tee "$O/new_tests.log" | tail -15
    stage "2 ranks"
    timeout 60 mpirun --allow-run-as-root -n 2 python3 -m pytest -q -p no:cacheprovider -m "cuda and mpi" \
        tests/cuda/test_cuda_paths.py 2>&1 | tail -3 | tee "$O/mpi2.log"
    stage "ring variants"
    timeout 100 python3 tools/kernel_timing.py --ring-variants 2>&1 | tee "$O/ring_variants.log" | tail -22
    stage "ring ablation"
    timeout 90 python3 tools/kernel_timing.py --ring-ablation 2>&1 | tee "$O/ring_ablation.log" | tail -9
    stage "bench --prefill 16 64"
    timeout 150 python3 -m glm_ep bench --prefill --rows 16 64 --out "$O/prefill" 2>"$O/prefill.err" | tail -40
    grep -E "glm_ep \{|sweep" "$O/prefill.err" | cut -c1-400 | tail -12 ;;
*)
    echo "usage: bash tools/device_queue.sh a|b|c|one|ablate" >&2; exit 2 ;;
esac
stage done

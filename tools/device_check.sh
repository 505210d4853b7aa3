#!/usr/bin/env bash
# The CUDA backend checked end to end on a GPU machine, in one go (repository root):
#   bash tools/device_check.sh [OUT_DIR] [--no-bench]
# 1. the CUDA kernel/path tests and the 2-rank test (tools/cuda_check.sh);
# 2. glm-ep forward --backend cuda against --backend cpu at 1, 5, 300 and 2000 rows, on one rank and on
#    two ranks sharing the GPU (MPI all-reduce), on a synthetic checkpoint;
# 3. glm-ep run --backend cuda (PASS/FAIL against float64);
# 4. glm-ep bench (decode, verify) and glm-ep bench --prefill -> OUT_DIR/perf (BENCH_<CARD>.md, PREFILL_<CARD>.md
#    and their json and png, named after the card: copy them into docs/perf to record them).
set -uo pipefail
OUT_DIR="${1:-./device_out}"; shift || true
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=python3
status=0
note() { echo "== $*"; }
bash tools/cuda_check.sh "$OUT_DIR" >"$OUT_DIR/cuda_check.log" 2>&1 || status=$?
grep -E "^== |passed|failed|error" "$OUT_DIR/cuda_check.log" | tail -20
W=$(mktemp -d)
$PY -m glm_ep synth --preset tiny --out "$W/tiny" >/dev/null || status=1
for rows in 1 5 300 2000; do
    $PY -m glm_ep make-input --out "$W/in$rows.safetensors" --rows $rows --model "$W/tiny" --seed $rows
    $PY -m glm_ep forward --model "$W/tiny" --input "$W/in$rows.safetensors" --output "$W/cpu$rows.safetensors" \
        --backend cpu 2>>"$OUT_DIR/forward.log" || status=1
    $PY -m glm_ep forward --model "$W/tiny" --input "$W/in$rows.safetensors" --output "$W/cuda$rows.safetensors" \
        --backend cuda 2>>"$OUT_DIR/forward.log" || status=1
    note "forward rows=$rows, 1 rank: cuda vs cpu"
    $PY tools/compare_forward.py "$W/cuda$rows.safetensors" "$W/cpu$rows.safetensors" | tail -1 || status=1
    mpirun --allow-run-as-root -n 2 $PY -m glm_ep forward --model "$W/tiny" --input "$W/in$rows.safetensors" \
        --output "$W/cuda2_$rows.safetensors" --topology configs/h200-1x2.toml 2>>"$OUT_DIR/forward.log" || status=1
    note "forward rows=$rows, 2 ranks on one GPU (tp=ep=2, MPI all-reduce): cuda vs 1-rank cpu"
    $PY tools/compare_forward.py "$W/cuda2_$rows.safetensors" "$W/cpu$rows.safetensors" | tail -1 || status=1
done
note "run --backend cuda (1 rank)"
$PY -m glm_ep run --backend cuda --cache-dir "$W" --model "$W/tiny" 2>"$OUT_DIR/run.log" | tail -9 || status=1
if [ "${1:-}" != "--no-bench" ]; then
    note "bench"
    $PY -m glm_ep bench --out "$OUT_DIR/perf" 2>"$OUT_DIR/bench.log" || status=1
    tail -5 "$OUT_DIR/bench.log"
    note "bench --prefill"
    $PY -m glm_ep bench --prefill --out "$OUT_DIR/perf" 2>"$OUT_DIR/prefill.log" || status=1
    tail -5 "$OUT_DIR/prefill.log"
fi
note "exit $status"
if [ -n "${OUT:-}" ]; then  # a batch job's results folder: the logs in one archive, the tables beside it
    tar czf "$OUT/logs.tgz" -C "$OUT_DIR" . && cp "$OUT_DIR"/perf/* "$OUT/" 2>/dev/null
fi
exit $status

#!/usr/bin/env bash
# The prefill work in one call on a GPU machine (repository root):
#   bash tools/prefill_check.sh [OUT_DIR] [bench flags...]
# 1. the grouped-GEMM kernel tests and the CUDA path tests (prefill widths included);
# 2. glm-ep bench --prefill (HF transformers' glm5_next modules as the peers) -> OUT_DIR.
# Where the machine's transformers lacks glm5_next, a transformers wheel in .whl/ is put first on
# the path (pure Python; --no-deps: the machine's own tokenizers/huggingface_hub serve).
set -uo pipefail
OUT_DIR="${1:-./prefill_out}"; shift || true
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
if ! "$PY" -c "import transformers.models.glm5_next" 2>/dev/null && ls .whl/transformers-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/hf-site .whl/transformers-*.whl
    export PYTHONPATH="/tmp/hf-site:$PYTHONPATH"
fi
"$PY" -c "import transformers; print('transformers', transformers.__version__)"
status=0
"$PY" -m pytest -q -rs -m cuda -p no:cacheprovider tests/cuda/test_cuda_*.py 2>&1 \
    | tee "$OUT_DIR/tests.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$PY" -m glm_ep bench --prefill --out "$OUT_DIR" "$@" 2>"$OUT_DIR/bench.log" || { status=1; tail -30 "$OUT_DIR/bench.log"; }
echo "== exit $status"
exit $status

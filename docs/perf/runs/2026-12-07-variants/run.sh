#!/usr/bin/env bash
# stages: P1 (removal's GPU tests + prefill re-record), P2 (variant table 512..2048 twice + paths tests)
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
TOPO=h100-1; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && TOPO=h200-1
pip install --no-deps -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
case "$1" in
P1)
  timeout 200 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_dense.py tests/cuda/test_cuda_router.py tests/cuda/test_cuda_stream.py > $OUT/tests_removal.log 2>&1; echo "tests rc $?" >> $OUT/tests_removal.log
  tail -3 $OUT/tests_removal.log
  timeout 330 python -m glm_ep bench --prefill --stages --topology $TOPO --out /tmp/prefill > $OUT/prefill.log 2>&1; echo "bench rc $?" >> $OUT/prefill.log
  cp /tmp/prefill/PREFILL_* /tmp/prefill/prefill_* $OUT/ 2>/dev/null
  tail -3 $OUT/prefill.log ;;
P2)
  for p in 1 2; do
    timeout 200 python -m glm_ep bench --prefill --stages --topology $TOPO --rows 512 768 1024 1536 2048 --no-peer --out /tmp/v$p > $OUT/variants_$p.log 2>&1
    cp /tmp/v$p/PREFILL_*.md $OUT/variants_$p.md 2>/dev/null
  done
  timeout 150 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_paths.py > $OUT/tests_paths.log 2>&1; echo "rc $?" >> $OUT/tests_paths.log
  tail -3 $OUT/tests_paths.log ;;
esac
if [ "$1" = P3 ]; then
  W="128 256 320 384 448 512 1280 1536"
  timeout 230 python -m glm_ep bench --prefill --stages --topology $TOPO --rows $W --no-peer --out /tmp/b > $OUT/before.log 2>&1
  cp /tmp/b/PREFILL_*.md $OUT/before.md
  git apply .devrun/variant.patch || patch -p1 < .devrun/variant.patch
  timeout 230 python -m glm_ep bench --prefill --stages --topology $TOPO --rows $W --no-peer --out /tmp/a > $OUT/after.log 2>&1
  cp /tmp/a/PREFILL_*.md $OUT/after.md
  timeout 100 python -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_paths.py tests/cuda/test_kernels_build.py -k "paths or variant" > $OUT/tests.log 2>&1; echo "rc $?" >> $OUT/tests.log
  tail -2 $OUT/tests.log
fi
if [ "$1" = P4 ]; then
  timeout 420 python -m glm_ep bench --prefill --stages --topology $TOPO --rows 16 64 128 256 512 1024 4096 --out /tmp/prefill > $OUT/prefill.log 2>&1; echo "bench rc $?" >> $OUT/prefill.log
  cp /tmp/prefill/PREFILL_* /tmp/prefill/prefill_* $OUT/ 2>/dev/null
  tail -2 $OUT/prefill.log
fi
if [ "$1" = P5 ]; then
  timeout 400 python -m glm_ep bench --topology $TOPO --out /tmp/decode > $OUT/decode.log 2>&1; echo "bench rc $?" >> $OUT/decode.log
  cp /tmp/decode/BENCH_* /tmp/decode/bench_* $OUT/ 2>/dev/null
  tail -2 $OUT/decode.log
fi
if [ "$1" = P6 ]; then  # the final defaults (commit 81d888d) against the ones before, same process order as P3
  W="128 256 384 448 512"
  git apply -R .devrun/final.patch || patch -R -p1 < .devrun/final.patch
  timeout 110 python -m glm_ep bench --prefill --stages --topology $TOPO --rows $W --no-peer --out /tmp/b > $OUT/before.log 2>&1
  cp /tmp/b/PREFILL_*.md $OUT/before.md
  git apply .devrun/final.patch || patch -p1 < .devrun/final.patch
  timeout 110 python -m glm_ep bench --prefill --stages --topology $TOPO --rows $W --no-peer --out /tmp/a > $OUT/after.log 2>&1
  cp /tmp/a/PREFILL_*.md $OUT/after.md
fi

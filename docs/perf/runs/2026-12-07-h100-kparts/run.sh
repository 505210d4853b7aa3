#!/usr/bin/env bash
# How the files here were made, on one H100 (device call of 2026-12-07), from the repository root of tree 7d8df6a with
# kparts.patch applied (the decode ring's items over K in parts, lever ring_k_parts; not kept). k1: the tree's own
# levers (configs/h100-1.toml); k2 / k4: the same with ring_k_parts = 2 / 4; k2c: k2 with RING_CLAIMS_MIN_ITEMS = 2
# (cli_min.py), so the 2 items a warp of a launch in 2 parts are claimed. Each bench is --no-peer; the four ran in
# turn, twice. On the device $OUT was /root/out (the logs' Command lines); each log was renamed run1_<name>.log here.
# The k4 logs and the pytest output did not come back from the device: their figures in README.md are from the
# call's printed output (the stage tables' rows and pytest's summary).
set -e
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=docs/perf/runs/2026-12-07-h100-kparts
OUT=${OUT:-$R}
git apply $R/kparts.patch
pip install --no-deps -e . >/dev/null
for n in 2 4; do
  { sed 's/^name = .*/name = "h100-1-k'$n'"/' configs/h100-1.toml; echo "ring_k_parts = $n"; } > $OUT/k$n.toml
done
python -m pytest -q tests/cuda/test_cuda_ring.py -k "k_parts or kparts or (down_combine_ring and default) or (decode_ring and default)"
for i in 1 2; do
  python -m glm_ep bench --topology h100-1 --no-peer --out $OUT/k1_$i > $OUT/run1_k1_$i.log 2>&1
  python -m glm_ep bench --topology $OUT/k2.toml --no-peer --out $OUT/k2_$i > $OUT/run1_k2_$i.log 2>&1
  python $R/cli_min.py 2 bench --topology $OUT/k2.toml --no-peer --out $OUT/k2c_$i > $OUT/run1_k2c_$i.log 2>&1
  python -m glm_ep bench --topology $OUT/k4.toml --no-peer --out $OUT/k4_$i > $OUT/k4_$i.log 2>&1
done
git apply -R $R/kparts.patch

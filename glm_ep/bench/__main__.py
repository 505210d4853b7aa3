"""``python -m glm_ep.bench [DIR]``: re-plot every ``bench_<card>.json`` of a results folder (default docs/perf)."""

import sys
from pathlib import Path

from glm_ep.bench.decode import plot_results

for results in sorted(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/perf").glob("bench_*.json")):
    print(plot_results(results))

"""``python -m glm_ep.bench [DIR]``: re-plot an existing results folder (default docs/perf)."""

import sys
from pathlib import Path

from glm_ep.bench.decode import plot_results

print(plot_results(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/perf")))

"""Lab helper (not shipped): the wgmma variants with STAGES slots from .devrun/kernels_s{STAGES}.
python .devrun/stages.py S pytest ARGS... | python .devrun/stages.py S probe PROBE3_ARGS..."""
import sys, runpy
from pathlib import Path
S, what, rest = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
from glm_ep.backend.cuda import kernel_loader as L, grouped as G
fix = lambda v: (*v[:4], S, v[5]) if v[5] == "wgmma" else v
L.GEMM_VARIANTS = G.GEMM_VARIANTS = tuple(fix(v) for v in L.GEMM_VARIANTS)
G.GEMM_WGMMA, G.GEMM_WGMMA_64 = fix(G.GEMM_WGMMA), fix(G.GEMM_WGMMA_64)
L.KERNEL_DIR = Path(__file__).resolve().parent / f"kernels_s{S}"
if what == "pytest":
    import pytest
    sys.exit(pytest.main(rest))
sys.argv = [str(Path(__file__).parent / "probe3.py"), *rest]
runpy.run_path(sys.argv[0], run_name="__main__")

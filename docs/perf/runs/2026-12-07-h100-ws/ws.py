"""Lab helper (not shipped): the warp-specialized 64-row wgmma tile (.devrun/$KDIR, default kernels_ws: GemmWgWs
with PW producer warps, $PW default 1) under pytest or probe3.
python .devrun/ws.py pytest ARGS... | python .devrun/ws.py probe PROBE3_ARGS... | python .devrun/ws.py glm_ep ARGS..."""
import os, sys, runpy
from pathlib import Path
PW = int(os.environ.get("PW", "1"))
what, rest = sys.argv[1], sys.argv[2:]
from glm_ep.backend.cuda import kernel_loader as L, grouped as G
L.KERNEL_DIR = Path(__file__).resolve().parent / os.environ.get("KDIR", "kernels_ws")
_threads = G.GemmGeometry.threads.fget
G.GemmGeometry.threads = property(lambda g: _threads(g) + (32 * PW if g.mma == "wgmma" and g.bm == 64 else 0))
if what == "pytest":
    import pytest
    sys.exit(pytest.main(rest))
if what == "glm_ep":
    from glm_ep.app.cli import main
    sys.exit(main(rest))
sys.argv = [str(Path(__file__).parent / "probe3.py"), f"--kdir={L.KERNEL_DIR.name}", *rest]
runpy.run_path(sys.argv[0], run_name="__main__")

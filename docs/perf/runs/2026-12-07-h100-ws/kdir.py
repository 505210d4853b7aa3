"""Lab helper (not shipped): run `python -m glm_ep ARGS` or `pytest ARGS` with the kernels of .devrun/DIR.
python .devrun/kdir.py DIR glm_ep ARGS... | python .devrun/kdir.py DIR pytest ARGS..."""
import sys
from pathlib import Path
from glm_ep.backend.cuda import kernel_loader as L
L.KERNEL_DIR = Path(__file__).resolve().parent / sys.argv[1]
what, rest = sys.argv[2], sys.argv[3:]
if what == "pytest":
    import pytest
    sys.exit(pytest.main(rest))
from glm_ep.app.cli import main
sys.exit(main(rest))

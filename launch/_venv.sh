# Sourced by launch/run, launch/test and launch/bench: make ./.venv if absent, then activate it.
# Installs the package (editable) with its test extra: numpy, ml_dtypes, safetensors, mpi4py,
# tqdm, pytest, pytest-mpi, pytest-timeout and an MPI from PyPI (mpich), so a fresh machine
# needs nothing but python3 >= 3.11.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.glm_ep-installed" ]; then
    echo "launch: creating $VENV" >&2
    "$PY" -m venv "$VENV" || { echo "launch: '$PY -m venv' failed; install python3-venv" >&2; exit 1; }
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2 || exit 1
    "$VENV/bin/python" -m pip install -q -e "$ROOT[test]" >&2 || { echo "launch: pip install failed" >&2; exit 1; }
    touch "$VENV/.glm_ep-installed"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PYTHONUNBUFFERED=1

# Sourced by launch/run and launch/test: make ./.venv if absent, then activate it.
# Installs the package (editable) with its mpi and test extras: numpy, ml_dtypes, safetensors,
# mpi4py, tqdm, an MPI with its mpiexec from PyPI (mpich), pytest, pytest-mpi, pytest-timeout, pyflakes,
# plus a CPU torch and transformers for the HF parity tests, so a fresh machine needs nothing but
# python3 >= 3.11.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.glm_ep-installed" ]; then
    echo "launch: creating $VENV" >&2
    "$PY" -m venv "$VENV" || { echo "launch: '$PY -m venv' failed; install python3-venv" >&2; exit 1; }
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2 || exit 1
    # HF transformers' glm5_next modules are the parity reference of tests/test_hf_parity.py; a CPU
    # torch keeps that small. Without one the parity tests skip, and everything else still runs.
    if "$VENV/bin/python" -m pip install -q "torch==${GLM_EP_TORCH:-2.13.0}" >&2 \
        && "$VENV/bin/python" -m pip install -q -e "$ROOT[mpi,test,hf]" >&2; then :
    else
        echo "launch: no CPU torch ${GLM_EP_TORCH:-2.13.0}: the HF parity tests will be skipped" >&2
        "$VENV/bin/python" -m pip install -q -e "$ROOT[mpi,test]" >&2 || { echo "launch: pip install failed" >&2; exit 1; }
    fi
    touch "$VENV/.glm_ep-installed"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PYTHONUNBUFFERED=1

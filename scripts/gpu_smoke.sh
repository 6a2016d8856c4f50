#!/usr/bin/env bash
# The shortest useful GPU check (about 3 minutes): build, build the torch
# adapter, `cxlalloc info`, then the core and global-mode GPU tests until the
# time box ends.  For a session with little device time left; the full check
# is scripts/gpu_check.sh.  Outputs go to $OUT (default ./out/gpu_smoke).
set -u
OUT="${OUT:-$PWD/out/gpu_smoke}"; mkdir -p "$OUT"
BUDGET="${GPU_SMOKE_BUDGET_S:-175}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
left() { echo $(( BUDGET - SECONDS )); }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free --format=csv
  python3 -c 'import sys,torch,transformers;print(sys.version);print("torch",torch.__version__,"cuda",torch.version.cuda);print("transformers",transformers.__version__)'
  git rev-parse HEAD 2>/dev/null || true; } > "$OUT/env.txt" 2>&1
# pip -e also installs the start-up .pth (the CXLALLOC hook); fall back to
# an in-place build if pip cannot write to site-packages.
CXLALLOC_BUILD_JOBS=$(nproc) timeout 90 python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
  > "$OUT/build.log" 2>&1 || { echo "pip -e failed rc=$?; building in place" >> "$OUT/build.log";
  CXLALLOC_BUILD_JOBS=$(nproc) timeout 70 python3 setup.py -q build_ext --inplace >> "$OUT/build.log" 2>&1 \
  || echo "BUILD FAILED rc=$?" >> "$OUT/build.log"; }
timeout 60 python3 -c 'from cxlalloc.pytorch import adapter_build as b; m = b.load(); print("adapter:", m.__file__)' \
  > "$OUT/adapter.log" 2>&1 || echo "ADAPTER FAILED rc=$?" >> "$OUT/adapter.log"
timeout 15 python3 -m cxlalloc info --json > "$OUT/info.json" 2> "$OUT/info.err"
timeout "$(left)" python3 -m pytest -v -ra -p no:cacheprovider --timeout 60 -m gpu \
  tests/engine/test_core_gpu.py tests/pytorch/test_torch_gpu.py > "$OUT/pytest.log" 2>&1
echo "rc=$? elapsed=${SECONDS}s" >> "$OUT/pytest.log"
tail -5 "$OUT/pytest.log"

#!/usr/bin/env bash
# scripts/gpu_check.sh: every GPU check of cxlalloc in ONE command.
#
#   bash scripts/gpu_check.sh             run everything (about 8-9 minutes on an H200)
#   bash scripts/gpu_check.sh --dry-run   list every step with its time box and command; exit 0
#
# Steps (each with its own time box; a failure is recorded and the script goes
# on; the whole run is held under GPU_CHECK_BUDGET_S seconds, default 520, by
# shrinking later boxes, with 30 s always kept for the report and packing):
#   env, wheels, build, adapter (cxlalloc's torch adapter, JIT), info,
#   ceilings (the bandwidth probe), allocation, pytest-gpu, hf-per-gpu
#   (wrap()'s per-GPU code path on this one GPU: accelerate's dispatch onto
#   cuda:0, per-GPU options as lists of one; generate() and continuous
#   batching), hf-multi-gpu (a model dispatched over two GPUs, generate() and
#   continuous batching with one paged-cache extent per GPU; runs only where
#   torch.cuda.device_count() > 1; tiny models, at most 64 MiB of VRAM budget
#   per GPU), kvserver (a
#   kv-server with a client process on the GPU: pool chunks registered, a hit
#   loaded into VRAM, identical tokens; under a minute), reuse (TTFT of a
#   prefix hit vs a full prefill up to 32K tokens on an 8B-shaped model, load
#   GB/s vs the measured H2D rate), lmcache (LMCache with the cxlalloc://
#   plugin: KV from VRAM through LMCache into the kv-server's pool and back,
#   byte-identical; runs only where lmcache is installed: its ~660 MB cannot be
#   carried, and the machine has no network for pip, nor for vLLM), vllm (the
#   two-process vLLM + LMCache + cxlalloc:// test of CI, tests/engines, with
#   LMCache's own GPU connector: scripts/gpu_vllm_step.sh installs vLLM where a
#   package index is reachable, else says it cannot and skips), vllm-offload (the same
#   for vLLM's own KV offloading with cxlalloc's secondary tier, vLLM's own
#   GPU<->CPU copy; tests/engines/test_vllm_offload_tier.py), cb (continuous batching: a
#   request stream under a device budget, plain vs wrapped vs wrapped + store;
#   quick grid), serve (cxlalloc serve vs transformers serve on the GPU, the
#   chat trace of bench --only serve, --quick: a short load run; skipped where
#   fastapi/uvicorn/openai are missing), decode, plan (the planner's decode and
#   prefix-load bounds against this run's decode/reuse records, from its
#   measured ceilings: results/plan_check.json with each row's error; a few
#   seconds, no GPU work), rightsizing,
#   report, pack
# The two short benchmarks run before the tests (they have never run on a
# GPU; a minute buys their first numbers); decode takes what the tests leave,
# and right-sizing runs only if time remains (it is recorded as skipped
# otherwise).
#
# Output ($OUT when set, else ./out/gpu_check), within the device tool's limits
# (at most 8 files, at most 2 folders deep):
#   $OUT/log.txt          everything the steps printed, with a status line per step
#   $OUT/summary.json     step statuses and durations, record statuses, key numbers
#   $OUT/results.tar.gz   results/*.json (bench records, info.json), results/plots/*.png,
#                         results/README_section.md, logs/*.log, results/pytest.xml,
#                         decode/right-sizing worker logs
# With $OUT set, intermediate files live in ${TMPDIR:-/tmp}/cxlalloc_gpu_check.
#
# Environment: OUT (output folder), PYTHON (default python3), GPU_CHECK_BUDGET_S
# (default 520), GPU_CHECK_SKIP="build adapter ..." (steps to skip, e.g. on a
# second run in the same machine), CXLALLOC_GIT_COMMIT (recorded when the tree
# has no .git).
#
# Safety: device_limit emulates a small GPU; managed memory is never requested
# beyond half of the card's free memory (cxlalloc_apps/bench/guard.py, checked in
# every benchmark before each managed allocation); nothing changes the card's
# settings.  Safe to run twice (it starts from a clean work folder).
#
# ----------------------------------------------------------------------------
# How to run it on the device machine (the `run` tool; see benchmarks/README.md):
#
#   run(command="CXLALLOC_GIT_COMMIT=<output of git rev-parse HEAD here> bash scripts/gpu_check.sh",
#       timeout_s=570)
#
#   carry: nothing is needed: the machine's image has torch, transformers,
#   pybind11, setuptools, matplotlib, rich and pytest-timeout.  Only if a wheel
#   is missing there: put it in .whl/ (listed in .git/info/exclude or
#   .gitignore), download it here with
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl NAME==VERSION       (or any pure-Python wheel)
#   and add  carry=[".whl"]  to the call: the "wheels" step installs every .whl/*.whl
#   into /tmp/site (pip --no-index --no-deps --target) and puts it on PYTHONPATH.
#
# Then, here: unpack and publish (benchmarks/README.md, "How to run on the device"):
#   python -m cxlalloc_apps.bench.report --import <files_at>/results.tar.gz \
#       --results benchmarks/results --plots benchmarks/results/plots --readme benchmarks/README.md
# ----------------------------------------------------------------------------
set -u

usage() { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; }
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run|-n) DRY=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg' (use --dry-run or --help)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.." || exit 2
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-520}"
RESERVE=30
if [ -n "${OUT:-}" ]; then
  OUTDIR="$OUT"
  WORK="${TMPDIR:-/tmp}/cxlalloc_gpu_check"
else
  OUTDIR="$ROOT/out/gpu_check"
  WORK="$OUTDIR/work"
fi
RES="$WORK/results"
LOGS="$WORK/logs"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg
# The torch adapter is built once into cxlalloc's cache (~/.cache/cxlalloc, or $CXLALLOC_CACHE_DIR) and
# reused by every later process, the GPU tests' and the benchmark workers' included, and by a second run.
unset CXLALLOC  # the benchmarks enable cxlalloc themselves, per variant
BENCH="$PY -m cxlalloc_apps.bench --quick --out $RES --no-progress"  # = cxlalloc bench, also when built in place (no entry points)

# name|time box (s)|command (run with bash -c in the repository root)
STEPS=(
  "env|30|nvidia-smi -q > $LOGS/nvidia-smi-q.txt 2>&1; nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free --format=csv; uname -a; nproc; free -g; ls /sys/devices/system/node/ | grep node; $PY -c 'import sys, torch, transformers; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available()); print(\"transformers\", transformers.__version__)'; $PY -m pip list 2>/dev/null | grep -i -E '^(torch|transformers|pybind11|setuptools|matplotlib|rich|tqdm|pytest|pytest-timeout|numpy) '"
  "wheels|90|if ls .whl/*.whl >/dev/null 2>&1; then $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; else echo 'no .whl/ wheels carried: nothing to install'; fi"
  "build|240|CXLALLOC_BUILD_JOBS=\$(nproc) $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . || { echo 'pip editable install failed; building in place instead'; CXLALLOC_BUILD_JOBS=\$(nproc) $PY setup.py -q build_ext --inplace; }; $PY -c 'import cxlalloc, cxlalloc._C as c; print(\"cxlalloc\", cxlalloc.__version__, c.__file__)'"
  "adapter|150|if $PY -c 'import cxlalloc.pytorch.adapter_build' 2>/dev/null; then $PY -c 'from cxlalloc.pytorch import adapter_build as b; m = b.load(); print(\"torch adapter ready:\", m.__file__)'; else echo 'cxlalloc.pytorch.adapter_build is missing from this tree: no adapter to build'; fi"
  "info|60|$PY -m cxlalloc info --json > $RES/info.json; rc=\$?; $PY -m cxlalloc info; exit \$rc"
  "ceilings|40|$BENCH --only ceilings --time-budget \$STEP_BUDGET"
  "allocation|35|$BENCH --only allocation --time-budget \$STEP_BUDGET"
  "pytest-gpu|170|$PY -m pytest -m gpu -q -ra --timeout=60 -p no:cacheprovider --junitxml=$RES/pytest.xml --ignore=tests/kvstore --ignore=tests/hf/test_hf_multigpu_gpu.py tests; rc=\$?; if [ \$rc -eq 5 ]; then echo 'no GPU-marked tests collected'; exit 0; fi; exit \$rc"
  "hf-per-gpu|60|$PY -m pytest -m gpu -q -ra --timeout=35 -p no:cacheprovider --junitxml=$RES/pytest-hf-per-gpu.xml tests/hf/test_hf_multigpu_gpu.py -k one_gpu"
  "hf-multi-gpu|60|n=\$($PY -c 'import torch; print(torch.cuda.device_count())'); if [ \"\$n\" -gt 1 ] 2>/dev/null; then $PY -m pytest -m gpu -q -ra --timeout=35 -p no:cacheprovider --junitxml=$RES/pytest-hf-multi-gpu.xml tests/hf/test_hf_multigpu_gpu.py -k several_gpus; else echo \"torch.cuda.device_count() = \$n: the multi-GPU step runs only with 2 or more GPUs\"; fi"
  "kvserver|60|$PY -c 'import msgpack' || { echo 'msgpack is missing on this machine: carry its wheel in .whl/ (see the header)'; exit 1; }; $PY -m pytest -m gpu -q -ra --timeout=50 -p no:cacheprovider --junitxml=$RES/pytest-kvserver.xml tests/kvstore/test_kv_gpu.py"
  "reuse|90|$BENCH --only reuse --time-budget \$STEP_BUDGET"
  "lmcache|45|$PY -c 'import lmcache, msgpack' 2>/dev/null || { echo 'lmcache (or msgpack) is not installed on this machine: the plugin step did not run (pip install .[lmcache] from the clone where a network is reachable; the vllm step installs vLLM)'; exit 0; }; $PY -m pytest -m gpu -q -ra -s --timeout=40 -p no:cacheprovider --junitxml=$RES/pytest-lmcache.xml tests/kvstore/engines/test_lmcache_gpu.py"
  "vllm|150|bash scripts/gpu_vllm_step.sh $WORK/engines"
  "vllm-offload|150|bash scripts/gpu_vllm_step.sh $WORK/engines tests/engines/test_vllm_offload_tier.py"
  "cb|60|$BENCH --only cb --time-budget \$STEP_BUDGET"
  "serve|90|$PY -c 'import fastapi, uvicorn, openai' 2>/dev/null || { echo 'fastapi/uvicorn/openai are not installed on this machine: the serve step did not run (pip install .[serve])'; exit 0; }; $BENCH --only serve --time-budget \$STEP_BUDGET"
  "decode|130|$BENCH --only decode --time-budget \$STEP_BUDGET"
  "plan|20|$PY -m cxlalloc.plan.check $RES --out $RES/plan_check.json"
  "rightsizing|90|$BENCH --only rightsizing --time-budget \$STEP_BUDGET"
  "report|40|$PY -m cxlalloc_apps.bench.report --results $RES --plots $RES/plots --readme $RES/README_section.md"
  "pack|20|(internal) write $OUTDIR/summary.json, pack $WORK into $OUTDIR/results.tar.gz, keep $OUTDIR/log.txt"
)

if [ "$DRY" = 1 ]; then
  echo "gpu_check.sh --dry-run: steps it would run (total budget ${BUDGET} s; output in $OUTDIR):"
  i=0
  for s in "${STEPS[@]}"; do
    i=$((i + 1))
    IFS='|' read -r name box cmd <<<"$s"
    printf '%2d. %-12s time box %4s s: %s\n' "$i" "$name" "$box" "$cmd"
  done
  exit 0
fi

rm -rf "$WORK"
mkdir -p "$OUTDIR" "$RES" "$LOGS"
rm -f "$OUTDIR/log.txt" "$OUTDIR/summary.json" "$OUTDIR/results.tar.gz"
LOG="$OUTDIR/log.txt"
STATUS="$WORK/steps.tsv"
: >"$STATUS"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
say() { echo "[gpu_check +$(elapsed)s] $*" | tee -a "$LOG"; }

say "cxlalloc gpu_check: root $ROOT, python $PY, budget ${BUDGET} s, output $OUTDIR, work $WORK"
say "commit: ${CXLALLOC_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"

run_step() {  # name box cmd
  local name="$1" box="$2" cmd="$3" left t rc st t1
  case " ${GPU_CHECK_SKIP:-} " in
    *" $name "*)
      say "step $name: SKIPPED (GPU_CHECK_SKIP)"
      printf '%s\tskipped\t0\t-\t-\n' "$name" >>"$STATUS"
      return ;;
  esac
  local remaining=$(( BUDGET - $(elapsed) ))
  if [ "$name" = report ] || [ "$name" = pack ]; then left=$remaining; else left=$(( remaining - RESERVE )); fi
  t=$box
  [ "$left" -lt "$t" ] && t=$left
  if [ "$t" -lt 10 ]; then
    say "step $name: SKIPPED (only ${left} s of the budget left)"
    printf '%s\tskipped\t0\t-\t%s\n' "$name" "$t" >>"$STATUS"
    return
  fi
  export STEP_BUDGET=$(( t > 25 ? t - 15 : 10 ))  # the benchmarks stop starting work after this
  say "step $name: start (time box ${t} s)"
  t1=$(date +%s)
  timeout --kill-after=15 "$t" bash -c "$cmd" >"$LOGS/$name.log" 2>&1
  rc=$?
  cat "$LOGS/$name.log" >>"$LOG"
  case $rc in
    0) st=ok ;;
    124|137) st=timeout ;;
    *) st=failed ;;
  esac
  say "step $name: $st (exit $rc) in $(( $(date +%s) - t1 )) s"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$st" "$(( $(date +%s) - t1 ))" "$rc" "$t" >>"$STATUS"
  if [ "$name" = wheels ] && [ "$st" = ok ] && [ -d /tmp/site ]; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if [ "$name" = build ]; then
    # Whichever way it was built, import it from this tree.
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  fi
}

for s in "${STEPS[@]}"; do
  IFS='|' read -r name box cmd <<<"$s"
  [ "$name" = pack ] && break
  run_step "$name" "$box" "$cmd"
done

# ---- pack: summary.json + results.tar.gz (never fails the script)
say "step pack: summary and tarball"
cp "$LOG" "$LOGS/log.txt" 2>/dev/null
find "$WORK" -name 'worker_*.log' -exec cp {} "$LOGS/" \; 2>/dev/null
timeout 30 "$PY" - "$STATUS" "$RES" "$OUTDIR/summary.json" "$(elapsed)" "$BUDGET" <<'PYEOF' 2>>"$LOG" || echo '{"error": "summary writer failed"}' >"$OUTDIR/summary.json"
import json, os, sys
status_path, res, out, elapsed, budget = sys.argv[1:6]
steps = []
for line in open(status_path):
    name, st, secs, rc, box = (line.rstrip("\n").split("\t") + ["", "", "", "", ""])[:5]
    steps.append({"step": name, "status": st, "seconds": int(secs or 0), "exit": rc, "time_box_s": box})
records = {}
for name in ("ceilings", "allocation", "reuse", "cb", "decode", "rightsizing"):
    p = os.path.join(res, name + ".json")
    try:
        rec = json.load(open(p))
    except Exception as e:
        records[name] = {"status": "missing", "why": str(e)[:200]}
        continue
    records[name] = {"status": rec.get("status"), "results": len(rec.get("results", [])),
                     "skipped": rec.get("skipped", [])[:3], "errors": [x.get("error", "")[:300] for x in rec.get("errors", [])[:3]],
                     "summary": {k: v for k, v in (rec.get("summary") or {}).items() if k != "points"}}
    if name == "decode":
        pts = (rec.get("summary") or {}).get("points") or []
        records[name]["points"] = [{k: e.get(k) for k in ("model", "context", "batch", "spill", "cxlalloc_vs_ceiling",
                                                           "cxlalloc_vs_offloaded", "cxlalloc_vs_policy_free",
                                                           "cxlalloc_vs_native")} for e in pts]
    hw = rec.get("hardware", {})
    records.setdefault("_machine", {"gpu": hw.get("gpu"), "cpu": hw.get("cpu"), "software": rec.get("software")})
try:
    pc = json.load(open(os.path.join(res, "plan_check.json")))
    records["plan_check"] = {k: pc.get(k) for k in ("hbm_read_gbps", "link_read_gbps", "decode_max_abs_error",
                                                    "reuse_max_abs_error")}
    records["plan_check"]["rows"] = len(pc.get("decode", [])) + len(pc.get("reuse", []))
except Exception as e:
    records["plan_check"] = {"status": "missing", "why": str(e)[:200]}
json.dump({"elapsed_s": int(elapsed), "budget_s": int(budget), "steps": steps, "records": records}, open(out, "w"), indent=1, default=str)
PYEOF
tar -czf "$OUTDIR/results.tar.gz" -C "$WORK" results logs 2>>"$LOG" || say "pack: tar failed"
printf 'pack\tok\t0\t0\t-\n' >>"$STATUS"

say "done in $(elapsed) s; step summary:"
if command -v column >/dev/null 2>&1; then
  column -t -s $'\t' "$STATUS" | sed 's/^/    /' | tee -a "$LOG"
else
  sed 's/^/    /' "$STATUS" | tee -a "$LOG"
fi
ls -la "$OUTDIR" | tee -a "$LOG"
exit 0

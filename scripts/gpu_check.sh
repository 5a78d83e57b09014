#!/usr/bin/env bash
# The GPU check, on a machine with one CUDA GPU and no network, in under 5 minutes (benchmarks/gpu_check/):
# exactness of the CUDA decode step vs Hugging Face generate on the same GPU (tiny Qwen2-VL, Qwen2.5-VL, LLaVA;
# float32 and bfloat16; text and image), CUDA IPC read bandwidth vs a device-to-device copy, decode tok/s at 1,
# 16 and 64 streams vs generate (medium demo model) with the host syncs per step counted by the CUDA profiler,
# and a real `epd serve --device cuda` (every role, CUDA IPC connectors): exact tokens and TTFT at c=1.
# Writes ONE JSON: $OUT/gpu_check.json if OUT is set (the device tool's folder), else
# benchmarks/results/gpu_check.json; `python -m benchmarks.gpu_check docs --json THAT` makes the docs block.
#
# Usage: scripts/gpu_check.sh             on the GPU machine, after `scripts/gpu_wheels.sh` here (carry .whl)
#        scripts/gpu_check.sh --dry-run   anywhere: the same Python on CPU at small sizes (no figures)
# It uses the machine's own torch (2.11 there) and installs nothing from the network: the carried wheels go
# to a private folder on PYTHONPATH; epd runs from this tree.  Each section has its own time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DRY=""
DEVICE=cuda
[ "${1:-}" = "--dry-run" ] && { DRY=--dry-run; DEVICE=cpu; }
SITE=${EPD_GPU_SITE:-/tmp/epd-gpu-site}
export PYTHONPATH=$PWD
if [ -z "$DRY" ] && [ -d .whl ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "gpu_check: installing the carried wheels failed"; exit 2; }
  export PYTHONPATH=$PWD:$SITE
elif [ -z "$DRY" ]; then
  echo "gpu_check: no .whl folder: the machine's own packages only (run scripts/gpu_wheels.sh and carry .whl)"
fi
export EPD_CACHE_DIR=${EPD_CACHE_DIR:-$PWD/.cache/epd} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 \
  TOKENIZERS_PARALLELISM=false
RESULTS=${OUT:-$PWD/benchmarks/results}
[ -n "$DRY" ] && RESULTS=${GPU_CHECK_RESULTS:-$PWD/.cache/gpu_check}
PARTS=$PWD/.cache/gpu_check/parts
rm -rf "$PARTS" && mkdir -p "$PARTS" "$RESULTS"
start=$(date +%s)

if [ -z "$DRY" ]; then
  "$PYTHON" -c "import torch, sys; ok = torch.cuda.is_available(); \
print('cuda:', ok, torch.cuda.get_device_name(0) if ok else '', 'torch', torch.__version__); sys.exit(0 if ok else 3)" \
    || { echo "gpu_check: no CUDA device here"; exit 3; }
  # the checkpoints first (random weights from configs, built once into EPD_CACHE_DIR)
  timeout -k 5 40 "$PYTHON" -c "from services.models.tiny import tiny_model_path; from services.models.demo import \
demo_model_path; [tiny_model_path(f) for f in ('qwen2_vl', 'qwen2_5_vl', 'llava')]; demo_model_path('medium')"
fi

section() {   # NAME LIMIT_S: one process, its own time limit, its own log
  timeout -k 5 "$2" "$PYTHON" -m benchmarks.gpu_check "$1" --device $DEVICE --out "$PARTS" $DRY \
    > "$PARTS/$1.log" 2>&1
  echo "gpu_check: $1 exited $? after $(( $(date +%s) - start )) s"
}
section env 10
section ipc 25
section exactness 85
section decode 65
[ -z "$DRY" ] || [ -n "${GPU_CHECK_CLUSTER:-}" ] && section cluster 75
if [ -z "$DRY" ] && [ -n "${OUT:-}" ]; then   # the device tool brings back only what is under $OUT
  tar -C "$PARTS" -czf "$OUT/gpu_check_logs.tgz" . 2>/dev/null || true
fi
"$PYTHON" -m benchmarks.gpu_check report --out "$PARTS" $DRY --json "$RESULTS/gpu_check.json"
echo "gpu_check: done in $(( $(date +%s) - start )) s"

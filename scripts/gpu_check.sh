#!/usr/bin/env bash
# GPU check, on a machine with a CUDA device, in under 5 minutes:
#   1. the CUDA IPC connector test (a CUDA tensor handed to another process by IPC handle);
#   2. exactness on CUDA: one cluster per family (--device cuda), greedy tokens == HF generate on CUDA;
#   3. a bandwidth figure: CUDA IPC connector vs device-to-device copy (scripts/cuda_ipc_bandwidth.py);
#   4. the paged decode engine on CUDA: its exactness tests, then tok/s of the medium model at 1 and 16
#      streams vs HF generate on the same GPU (scripts/gpu_decode_bench.py).
# Not yet run on a GPU (no GPU has been lent to this project's sessions so far).
# Usage: scripts/gpu_check.sh            (PYTHON=... to pick the interpreter; results also in $OUT if set)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH=$PWD EPD_CACHE_DIR=${EPD_CACHE_DIR:-$PWD/.cache/epd} EPD_TEST_DEVICE=cuda
OUT_DIR=${OUT:-$PWD/.cache/gpu_check}
mkdir -p "$OUT_DIR"
start=$(date +%s)

"$PYTHON" -c "import torch, sys; ok = torch.cuda.is_available(); \
print('cuda:', ok, torch.cuda.get_device_name(0) if ok else '', 'torch', torch.__version__); sys.exit(0 if ok else 3)" \
  || { echo "gpu_check: no CUDA device here"; exit 3; }

# Build the tiny checkpoints first, so the test timings below are serving only.
"$PYTHON" -c "from services.models.tiny import FAMILIES, tiny_model_path; \
[tiny_model_path(f) for f in ['qwen2_vl', *FAMILIES]]"

timeout 200 "$PYTHON" -m pytest -x -q -p no:cacheprovider \
  tests/services/connectors/test_cuda.py tests/e2e/test_model_families.py 2>&1 | tee "$OUT_DIR/pytest.txt"

timeout 60 "$PYTHON" scripts/cuda_ipc_bandwidth.py --sizes-mb 16 64 256 --repeats 20 | tee "$OUT_DIR/bandwidth.md"
timeout 240 "$PYTHON" scripts/gpu_decode_bench.py --device cuda --tokens 64 | tee "$OUT_DIR/decode.md"
echo "gpu_check: done in $(( $(date +%s) - start )) s"

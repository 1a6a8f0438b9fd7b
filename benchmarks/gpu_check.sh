#!/usr/bin/env bash
# One script for a CUDA machine (< 8 minutes): the GPU-marked tests, then ResNet-50 on
# synthetic 224 px data (bf16-mixed, channels_last) in images/s without and with device
# prefetch, as `name value unit` lines. Usage: bash benchmarks/gpu_check.sh
# It installs into a throw-away venv when .venv is missing (the device machine starts bare).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv && .venv/bin/pip install -q torch==2.14.1 torchvision==0.29.1 && .venv/bin/pip install -q -e ".[dev]"
fi
PY=.venv/bin/python
$PY - <<'PYEOF'
import torch
print(f"# gpu_check | {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA'} | torch {torch.__version__}")
PYEOF
echo "== GPU tests"
timeout 240 $PY -m pytest -q -m gpu -p no:cacheprovider tests || echo "gpu_tests_failed 1 flag"
echo "== ResNet-50 synthetic, bf16-mixed, channels_last"
for prefetch in false true; do
  timeout 150 $PY train.py recipe=resnet50_synthetic trainer=gpu trainer.enable_progress_bar=false \
    data.num_workers=4 data.pin_memory=true data.device_prefetch=$prefetch data.num_samples=6400 \
    data.batch_size=128 +trainer.limit_val_batches=0 checkpoint=false hydra.run.dir=/tmp/gpu_check_$prefetch \
    > /tmp/gpu_check_$prefetch.log 2>&1 || { echo "resnet50_prefetch_${prefetch}_failed 1 flag"; tail -20 /tmp/gpu_check_$prefetch.log; }
  $PY -c "import json; m=json.load(open('/tmp/gpu_check_$prefetch/metrics.json')); print(f\"resnet50_bf16_device_prefetch_${prefetch}_images_per_s {m['samples_per_s']:.1f} images/s\")" 2>/dev/null
done

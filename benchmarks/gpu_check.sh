#!/usr/bin/env bash
# The GPU check, one script for a CUDA machine (under 8 minutes on one GPU):
#   1. every `gpu`-marked test (tests/gpu: each strategy against the CPU, mixed precision, Lamb/Lars
#      foreach, the device prefetcher, no host syncs), on CUDA each test in its own process, $GPU_TEST_JOBS
#      (6) at a time;
#   2. ResNet-50 (bf16-mixed, channels_last) training images/s for ddp, ring and ps at world 1, and
#      at world 2 on a machine with two GPUs or more (benchmarks/gpu_resnet50.py);
# as `name value unit` lines; on CUDA the whole output is also written to
# benchmarks/results/gpu_check.txt. Usage: bash benchmarks/gpu_check.sh
#
# Python: $PYTHON when set; else .venv/bin/python when it exists; else the machine's python3 when it has torch with CUDA
# (a GPU image); else a new .venv with the pinned torch and the package's dev extras (needs the
# registry). Modules the check imports that are missing are installed into /tmp/gpu_check_site: from
# the wheels in .whl/ when there are any (a machine without network: carry them there), else from
# the registry. Nothing here needs Hydra.
#
# Without CUDA (a CPU machine, CI) it runs the suite, which is skipped, prints `cuda_available 0 flag`
# and stops with exit 0: no GPU figure is made up.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# a rank that dies of a signal (SIGSEGV, SIGABRT) prints every thread's Python stack, spawned ranks too
export PYTHONFAULTHANDLER=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

main() {
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
elif python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  PY=python3
else
  python3 -m venv .venv && .venv/bin/pip install -q torch==2.14.1 torchvision==0.29.1 \
    && .venv/bin/pip install -q -e ".[dev]" || { echo "gpu_check_install_failed 1 flag"; exit 1; }
  PY=.venv/bin/python
fi

# module -> pip name, for what tests/gpu and the benchmark import
missing=$($PY - <<'PYEOF'
import importlib.util
need = {"torch": "torch", "torchvision": "torchvision", "lightning": "lightning", "torchmetrics": "torchmetrics",
        "pytest": "pytest", "sklearn": "scikit-learn", "matplotlib": "matplotlib", "rich": "rich",
        "typing_extensions": "typing-extensions"}
print(" ".join(pip for mod, pip in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
  echo "# installing into /tmp/gpu_check_site: $missing"
  if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site .whl/*.whl
  else
    $PY -m pip install -q --target /tmp/gpu_check_site $missing
  fi || { echo "gpu_check_install_failed 1 flag"; exit 1; }
  export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
fi

$PY - <<'PYEOF'
import datetime, os, platform, torch, lightning
gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "NO CUDA"
print(f"# gpu_check | {gpu} | {platform.machine()}, {os.cpu_count()} cores | torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), lightning {lightning.__version__}, python {platform.python_version()} "
      f"| {datetime.datetime.now().isoformat(timespec='seconds')} | load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
PYEOF
cuda=$($PY -c "import torch; print(int(torch.cuda.is_available()))")
echo "cuda_available $cuda flag"
[ "$cuda" = 1 ] && touch "$log.cuda"

if [ "$cuda" = 1 ]; then
  # Each test in a fresh process, $GPU_TEST_JOBS at a time: under torch 2.11 a process that has destroyed its
  # NCCL default group and made another crashes (SIGSEGV) in the device mesh's split_group, and a group
  # left alive would carry one fit's backend into the next; a test's own fits still share its process
  echo "== GPU tests (tests/gpu), one process per test"
  gpu_tests=$(mktemp -d /tmp/gpu_tests.XXXXXX)
  timeout -k 10 120 $PY -m pytest --collect-only -q -p no:cacheprovider tests/gpu | grep '::' >"$gpu_tests/ids"
  # timeout -k: Lightning's signal handler catches SIGTERM, so a hung fit outlives it; SIGKILL 10 s later ends it
  run_one() {  # $1: a test's node id; prints "<exit code> <its log> <node id>"
    local out="$GPU_TESTS/$(printf '%s' "$1" | tr -c 'A-Za-z0-9_.-' '_').log"
    timeout -k 10 120 $PY -m pytest -v -p no:cacheprovider -rfEs "$1" >"$out" 2>&1
    echo "$? $out $1"
  }
  export -f run_one; export PY GPU_TESTS="$gpu_tests"
  xargs -d '\n' -P "${GPU_TEST_JOBS:-6}" -I{} bash -c 'run_one "$1"' _ {} <"$gpu_tests/ids" | sort -k3 >"$gpu_tests/codes"
  # -v lines (PASSED, FAILED, SKIPPED with its reason) by file name, then the last 150 lines of each failure's log
  for f in "$gpu_tests"/*.log; do grep -hE '(PASSED|FAILED|SKIPPED|ERROR)( |$)|^SKIPPED \[' "$f"; done
  echo "gpu_tests_run $(wc -l <"$gpu_tests/ids") count"
  rc=0
  while read -r code out id; do
    if [ "$code" != 0 ]; then
      rc=1
      echo "== $id: exit $code"
      tail -n 150 "$out"
    fi
  done <"$gpu_tests/codes"
  rm -rf "$gpu_tests"
else
  echo "== GPU tests (tests/gpu)"
  # -v: one line per test, so the output shows what ran (or was skipped: on CPU, all of it)
  timeout -k 10 240 $PY -m pytest -v -p no:cacheprovider -rfEs tests/gpu
  rc=$?
fi
echo "gpu_tests_failed $((rc != 0)) flag"

if [ "$cuda" != 1 ]; then
  echo "# no CUDA here: the GPU tests were skipped, and the ResNet-50 images/s need a GPU; nothing more to run"
  echo "gpu_check_seconds $(( $(date +%s) - start )) s"
  exit 0
fi

echo "== ResNet-50, bf16-mixed, channels_last: images/s (ddp, ring, ps)"
timeout -k 10 200 $PY benchmarks/gpu_resnet50.py --rounds 2 || echo "resnet50_failed 1 flag"
echo "gpu_check_seconds $(( $(date +%s) - start )) s"
}

log=$(mktemp /tmp/gpu_check.XXXXXX)
main 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [ -e "$log.cuda" ]; then  # a GPU run: keep its raw output beside the other benchmarks' results
  cp "$log" benchmarks/results/gpu_check.txt && echo "# raw output: benchmarks/results/gpu_check.txt"
  rm -f "$log.cuda"
fi
exit "$status"

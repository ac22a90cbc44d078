#!/usr/bin/env bash
# Every `gpu`-marked check on a machine with one CUDA GPU, nothing downloaded: one verdict line per check.
#   tests/gpu/run.sh            (or: make gpu-check)
#   tests/gpu/run.sh --rehearse (or: make gpu-check-rehearsal): the same script on a machine without a GPU; the
#                               checks that take their device (WEIR_GPU_CHECK_DEVICE=cpu) run there, the others skip
# Python packages the machine lacks can be carried as wheels in .whl/ (installed to a scratch folder first).
# Checks whose software is absent (SGLang, megatron-core) are reported as skipped, with the reason.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--rehearse" ]; then
  export WEIR_GPU_CHECK_DEVICE=cpu
  echo "[gpu-check] rehearsal: the device checks on the CPU"
fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/weir-site .whl/*.whl \
    && export PYTHONPATH=/tmp/weir-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
checks=(
  "tests/gpu/test_gpu_paths.py"
  "tests/gpu/test_cuda.py"
  "tests/trainer/test_megatron.py"
  "tests/engines/test_sglang_backend.py"
  "tests/gpu/test_sglang_gpu.py"
  "tests/trainer/test_reference.py"
)
status=0
for check in "${checks[@]}"; do
  log=$(mktemp)
  start=$(date +%s)
  timeout 300 $PY -m pytest -q -p no:cacheprovider -m gpu -rs "$check" >"$log" 2>&1
  code=$?
  summary=$(grep -E "passed|failed|skipped|error|no tests ran" "$log" | tail -1)
  echo "[gpu-check] $check: exit $code in $(( $(date +%s) - start )) s — ${summary:-no summary}"
  if [ $code -ne 0 ] && [ $code -ne 5 ]; then status=1; tail -40 "$log"; fi
  grep -E "^SKIPPED" "$log" | sed 's/^/[gpu-check]   /'
  [ -n "${OUT:-}" ] && cp "$log" "$OUT/$(basename "$check" .py).log"
done
exit $status

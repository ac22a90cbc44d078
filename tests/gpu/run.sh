#!/usr/bin/env bash
# Every `gpu`-marked check on a machine with one CUDA GPU, nothing downloaded: one verdict line per check.
#   tests/gpu/run.sh            (or: make gpu-check)
# Python packages the machine lacks can be carried as wheels in .whl/ (installed to a scratch folder first).
# Checks whose software is absent (SGLang, megatron-core) are reported as skipped, with the reason.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/weir-site .whl/*.whl \
    && export PYTHONPATH=/tmp/weir-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
checks=(
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

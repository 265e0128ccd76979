#!/usr/bin/env bash
# On a machine with a CUDA GPU: the GPU tests, then `sluice bench latency` and `sluice bench offline`
# on CUDA, in well under 8 minutes (the model is prepared once; results land in bench-results/gpu/).
# Usage: scripts/gpu-check.sh   (from the repository root; PYTHON overrides the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT_DIR:-bench-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset SLUICE_ENFORCE_EAGER SLUICE_DTYPE
started=$(date +%s)
"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu-check: torch sees no CUDA GPU (torch %s)" % torch.__version__)
print("gpu-check: %s, torch %s" % (torch.cuda.get_device_name(0), torch.__version__))
PYEOF
"$PY" -m sluice_cli.cli model prepare >/dev/null
timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/gpu -rs 2>&1 | tee "$OUT/tests.txt"
timeout 150 "$PY" -m sluice_cli.cli bench latency --device cuda --dtype float32 --input-len 512 --output-len 128 \
    --num-iters 3 --json "$OUT/latency.json" 2>&1 | tee "$OUT/latency.txt"
timeout 150 "$PY" -m sluice_cli.cli bench offline --device cuda --dtype float32 --hf-batch-sizes 8 \
    --json "$OUT/offline.json" 2>&1 | tee "$OUT/offline.txt"
echo "gpu-check: done in $(( $(date +%s) - started ))s; results in $OUT/"

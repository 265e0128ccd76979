#!/usr/bin/env bash
# On a machine with a CUDA GPU: the GPU tests, then `sluice bench latency` and `sluice bench offline`
# on CUDA (eager, CUDA graphs, compiled; float32 and bfloat16), each step under its own timeout; a failed step is reported and
# the next one still runs, so one run shows everything that breaks. Results land in $OUT_DIR
# (default bench-results/gpu/): tests.txt, one JSON per bench, and the whole log in check.txt.
# Usage: scripts/gpu-check.sh   (from the repository root; PYTHON overrides the interpreter)
#   GPU_CHECK_RANDOM_LIKE=DIR: a machine that cannot fetch the default model builds its architecture
#   with seeded random weights from DIR's config and tokenizer (scripts/random_weights_model.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT_DIR:-bench-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset SLUICE_ENFORCE_EAGER SLUICE_DTYPE
started=$(date +%s)
failed=()
exec > >(tee -a "$OUT/check.txt") 2>&1

step() {  # step NAME SECONDS COMMAND...: run it, note a failure, carry on
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@"
    rc=$?
    echo "=== $name: rc=$rc in $(( $(date +%s) - t0 ))s"
    [ "$rc" -eq 0 ] || failed+=("$name(rc=$rc)")
}

"$PY" - <<'PYEOF' || exit 1
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu-check: torch sees no CUDA GPU (torch %s)" % torch.__version__)
print("gpu-check: %s, torch %s, CUDA %s, Python %s" % (
    torch.cuda.get_device_name(0), torch.__version__, torch.version.cuda, sys.version.split()[0]))
PYEOF

if [ -n "${GPU_CHECK_RANDOM_LIKE:-}" ]; then
    model_dir=$("$PY" -c "from sluice.paths import default_model_dir; print(default_model_dir())")
    step model 60 "$PY" scripts/random_weights_model.py --like "$GPU_CHECK_RANDOM_LIKE" --out "$model_dir"
else
    step model 300 "$PY" -m sluice_cli.cli model prepare
fi

step tests 200 bash -c '"$0" -m pytest -q -p no:cacheprovider tests/gpu -rs --durations=10 2>&1 | tee "$1"
    exit "${PIPESTATUS[0]}"' "$PY" "$OUT/tests.txt"
bench=("$PY" -m sluice_cli.cli bench)
latency=(latency --device cuda --input-len 512 --output-len 128 --num-iters 3)
# one stream: eager beside transformers, then CUDA graphs, in float32; CUDA graphs in bfloat16
# beside transformers; the offline workload (W1) with CUDA graphs beside transformers' batches of
# 8; int4 with CUDA graphs; last, the inductor-compiled step (its cold compile takes a minute or more)
step latency-float32-eager 60 "${bench[@]}" "${latency[@]}" --dtype float32 --enforce-eager \
    --json "$OUT/latency-float32-eager.json"
step latency-float32-graphs 60 "${bench[@]}" "${latency[@]}" --dtype float32 --no-enforce-eager --no-hf \
    --json "$OUT/latency-float32-graphs.json"
step latency-bfloat16-graphs 70 "${bench[@]}" "${latency[@]}" --dtype bfloat16 --no-enforce-eager \
    --json "$OUT/latency-bfloat16-graphs.json"
step offline-float32-graphs 150 "${bench[@]}" offline --device cuda --dtype float32 --no-enforce-eager \
    --hf-batch-sizes 8 --no-plot --json "$OUT/offline-float32-graphs.json"
step latency-int4-graphs 60 "${bench[@]}" "${latency[@]}" --dtype bfloat16 --quantization int4 \
    --no-enforce-eager --no-hf --json "$OUT/latency-int4-graphs.json"
step latency-float32-compiled 150 "${bench[@]}" "${latency[@]}" --dtype float32 --no-enforce-eager \
    --no-cuda-graphs --no-hf --json "$OUT/latency-float32-compiled.json"

echo "gpu-check: done in $(( $(date +%s) - started ))s; results in $OUT/; failed: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]

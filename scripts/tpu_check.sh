#!/usr/bin/env bash
# TPU check (v5e / v6e host): the Mosaic TPU kernel natively against the reference, the kernel benchmark
# (ours vs JAX's shipped TPU kernel vs the reference), then end-to-end decode throughput of the engine with
# the kernel (attention_backend auto -> mosaic_tpu on a TPU) against the reference attention.
# No installs, no network. Usage (from anywhere): scripts/tpu_check.sh [OUT_DIR]
# OUT_DIR defaults to $OUT, else ./tpu_check_out. Writes there:
#   env.txt                         jax / libtpu versions and the devices
#   pytest.txt, pytest.xml          tests/test_paged_attention_mosaic_tpu.py, run natively (interpret mode only off a TPU)
#   bench.log, bench/results.{json,md}   jaxpaged/bench/tpu_kernel.py (rewritten after every measurement)
#   e2e_<backend>.json, e2e.log     jaxpaged/bench/throughput.py, jaxpaged only, bf16, per attention backend
#   summary.md                      what ran, its exit status, and the tables
# Each part is guarded: a failing part is recorded and the next one still runs.
# Environment: PYTHON (default python3), TEST_TIMEOUT (s, default 600), BENCH_BUDGET (s, default 300),
# E2E_MODEL (default random:smollm2-135m: random weights, the default model's shapes, offline),
# E2E_TIMEOUT (s per backend, default 900), E2E_PROMPTS (default 128).
set -u
OUT_DIR="${1:-${OUT:-tpu_check_out}}"
mkdir -p "$OUT_DIR" && OUT_DIR="$(cd "$OUT_DIR" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u
  "$PY" --version
  "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())"
  "$PY" -m pip show libtpu 2>/dev/null | head -2
} >"$OUT_DIR/env.txt" 2>&1
cat "$OUT_DIR/env.txt"

test_status="pytest not installed: skipped (the benchmark still checks every shape against the reference)"
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout "${TEST_TIMEOUT:-600}" "$PY" -m pytest tests/test_paged_attention_mosaic_tpu.py -q -p no:cacheprovider \
    --junitxml="$OUT_DIR/pytest.xml" >"$OUT_DIR/pytest.txt" 2>&1
  test_status="exit $?: $(tail -n 1 "$OUT_DIR/pytest.txt")"
fi
echo "tests: $test_status"

timeout $(( ${BENCH_BUDGET:-300} + 300 )) "$PY" -m jaxpaged.bench.tpu_kernel --out "$OUT_DIR/bench" \
  --time-budget "${BENCH_BUDGET:-300}" >"$OUT_DIR/bench.log" 2>&1
bench_status="exit $?"
echo "kernel bench: $bench_status"

e2e_status=""
for backend in auto reference; do
  timeout "${E2E_TIMEOUT:-900}" "$PY" -m jaxpaged.bench.throughput --backend jaxpaged \
    --model "${E2E_MODEL:-random:smollm2-135m}" --dtype bfloat16 --attention-backend "$backend" \
    --num-prompts "${E2E_PROMPTS:-128}" --json "$OUT_DIR/e2e_$backend.json" >>"$OUT_DIR/e2e.log" 2>&1
  e2e_status="$e2e_status $backend: exit $?;"
done
echo "end to end:$e2e_status"

{
  echo "# TPU check"
  echo
  echo '```'; cat "$OUT_DIR/env.txt"; echo '```'
  echo
  echo "- kernel tests: $test_status"
  echo "- kernel bench: $bench_status"
  echo "- end to end:$e2e_status"
  echo
  [ -f "$OUT_DIR/bench/results.md" ] && cat "$OUT_DIR/bench/results.md"
  for backend in auto reference; do
    f="$OUT_DIR/e2e_$backend.json"
    [ -f "$f" ] && "$PY" - "$f" "$backend" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"\n## end to end, attention_backend={sys.argv[2]}\n\n```\n{json.dumps(d.get('results', d), indent=1)[:3000]}\n```")
EOF
  done
} >"$OUT_DIR/summary.md"
echo "summary: $OUT_DIR/summary.md"

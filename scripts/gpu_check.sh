#!/usr/bin/env bash
# GPU check for the Pallas kernels: native kernel tests, then the kernel benchmark; on >= 2 GPUs also
# tensor parallelism: TP=2 greedy tokens against TP=1 (scripts/check_tp.py) and TP=2 vs TP=1 throughput.
# No installs, no network. Usage (from anywhere): scripts/gpu_check.sh [OUT_DIR]
# OUT_DIR defaults to $OUT, else ./gpu_check_out. Writes there:
#   env.txt, pytest.txt, pytest.xml   the GPU test run (pytest -m gpu tests/test_kernels.py)
#   bench.log, results.json, results.md   scripts/bench_kernels.py (rewritten after every measurement)
#   kv_float8/, kv_int8/              the decode kernel over quantized pools (--kv-dtype), bytes/s vs copy
#   tp_check.json, tp_check.log       TP=2 correctness (>= 2 GPUs; skipped on one)
#   tp_throughput.json, tp_throughput.log   TP=1 vs TP=2 throughput, random llama-8h preset, bfloat16
#   host_sync.json, host_async.json, host.log   default model, 64 running, bf16: decode step rate and GPU
#                                     idle share (step wall - device-only replay, / step wall), async off vs on
#   host_null.json                    host-only ceiling: the null device at 8 / 64 / 256 running
#   summary.md                        test outcome + benchmark tables
# Each part is guarded: a failing or missing part is recorded and the next one still runs.
# pytest runs with --noconftest: the kernel tests need nothing from tests/conftest.py (which imports the
# engine and its model-test dependencies, perhaps absent on the GPU machine).
# Environment: PYTHON (default python3), TEST_TIMEOUT (s, default 240), BENCH_BUDGET (s, default 300),
# KV_BUDGET (s per quantized KV dtype, default 60),
# TP_MODEL (default random:llama-8h: random weights, needs torch + transformers), TP_TIMEOUT (s, default 900),
# HOST_MODEL (default: the embedded default model; random:smollm2-135m works offline), HOST_TIMEOUT (s, default 600).
set -u
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR" && OUT_DIR="$(cd "$OUT_DIR" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the benchmark sizes its own pool

{
  date -u
  "$PY" --version
  "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv 2>/dev/null
} >"$OUT_DIR/env.txt" 2>&1
cat "$OUT_DIR/env.txt"

test_status="not run"
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest -m gpu tests/test_kernels.py -q -p no:cacheprovider --noconftest \
    --junitxml="$OUT_DIR/pytest.xml" >"$OUT_DIR/pytest.txt" 2>&1
  rc=$?
  test_status="exit $rc: $(tail -n 1 "$OUT_DIR/pytest.txt")"
else
  test_status="pytest not installed: skipped (the benchmark still checks every shape against the reference)"
fi
echo "tests: $test_status"

timeout $(( ${BENCH_BUDGET:-300} + 240 )) "$PY" scripts/bench_kernels.py --out "$OUT_DIR" \
  --time-budget "${BENCH_BUDGET:-300}" >"$OUT_DIR/bench.log" 2>&1
bench_rc=$?
echo "bench: exit $bench_rc"
kv_status=""
for kv in float8_e4m3fn int8; do
  timeout $(( ${KV_BUDGET:-60} + 120 )) "$PY" scripts/bench_kernels.py --kv-dtype "$kv" --out "$OUT_DIR/kv_${kv%%_*}" \
    --time-budget "${KV_BUDGET:-60}" >"$OUT_DIR/kv_${kv%%_*}.log" 2>&1
  kv_status="$kv_status $kv: exit $?;"
done
echo "quantized KV decode:$kv_status"

num_gpus=$("$PY" -c "import jax; print(sum(d.platform == 'gpu' for d in jax.devices()))" 2>/dev/null || echo 0)
if [ "${num_gpus:-0}" -ge 2 ]; then
  (cd scripts && timeout "${TP_TIMEOUT:-900}" "$PY" check_tp.py --tensor-parallel-size 2 --model "${TP_MODEL:-random:llama-8h}" \
    --json "$OUT_DIR/tp_check.json" >"$OUT_DIR/tp_check.log" 2>&1)
  tp_status="TP=2 tokens vs TP=1: exit $? ($(tail -n 1 "$OUT_DIR/tp_check.log" | cut -c1-300))"
  (cd scripts && timeout "${TP_TIMEOUT:-900}" "$PY" bench_throughput.py --model "${TP_MODEL:-random:llama-8h}" --backend jaxpaged \
    --dtype bfloat16 --num-prompts 256 --max-num-seqs 64 --tensor-parallel-size 1 --tensor-parallel-size 2 \
    --json "$OUT_DIR/tp_throughput.json" >"$OUT_DIR/tp_throughput.log" 2>&1)
  tp_status="$tp_status; throughput: exit $?"
else
  tp_status="skipped: $num_gpus GPU(s), tensor parallelism needs 2"
fi
echo "tensor parallelism: $tp_status"

host_status=""
for mode in off on; do
  name=$([ "$mode" = on ] && echo async || echo sync)
  (cd scripts && timeout "${HOST_TIMEOUT:-600}" "$PY" bench_host.py --running 64 --steps 64 --replays 16 --dtype bfloat16 \
    ${HOST_MODEL:+--model "$HOST_MODEL"} --async-scheduling "$mode" --json "$OUT_DIR/host_$name.json" >>"$OUT_DIR/host.log" 2>&1)
  host_status="$host_status $name: exit $?;"
done
(cd scripts && timeout "${HOST_TIMEOUT:-600}" "$PY" bench_host.py --null-device --running 8 64 256 \
  ${HOST_MODEL:+--model "$HOST_MODEL"} --json "$OUT_DIR/host_null.json" >>"$OUT_DIR/host.log" 2>&1)
host_status="$host_status null device: exit $?"
host_table=$("$PY" - "$OUT_DIR" <<'PYEOF' 2>&1
import json, os, sys
d = sys.argv[1]
print("| mode | steps/s | step ms | device ms | unhidden host ms | GPU idle share |")
print("| --- | --- | --- | --- | --- | --- |")
for name in ("sync", "async"):
    p = os.path.join(d, f"host_{name}.json")
    if os.path.exists(p):
        r = json.load(open(p))["results"][0]
        print(f"| {name} | {1 / r['step_wall_s']:.0f} | {1e3 * r['step_wall_s']:.2f} | {1e3 * r['device_s']:.2f} | "
              f"{r['unhidden_host_ms_per_step']:.3f} | {max(r['host_overhead_pct'], 0):.1f}% |")
PYEOF
)
echo "host path (64 running):$host_status"

{
  echo "# GPU check"
  echo
  echo '```'
  cat "$OUT_DIR/env.txt"
  echo '```'
  echo
  echo "Tests (pytest -m gpu tests/test_kernels.py): $test_status"
  echo
  echo "Benchmark: exit $bench_rc"
  echo
  if [ -f "$OUT_DIR/results.md" ]; then cat "$OUT_DIR/results.md"; else tail -n 40 "$OUT_DIR/bench.log"; fi
  echo
  echo "Decode kernel over quantized KV pools (bf16 pool above):$kv_status"
  for d in kv_float8 kv_int8; do [ -f "$OUT_DIR/$d/results.md" ] && { echo "### $d"; cat "$OUT_DIR/$d/results.md"; }; done
  echo
  echo "Tensor parallelism: $tp_status"
  if [ -f "$OUT_DIR/tp_throughput.log" ]; then echo '```'; tail -n 6 "$OUT_DIR/tp_throughput.log"; echo '```'; fi
  echo
  echo "Host path, default model, 64 running, sync vs async scheduling:$host_status"
  echo
  echo "$host_table"
} >"$OUT_DIR/summary.md"
cat "$OUT_DIR/summary.md"

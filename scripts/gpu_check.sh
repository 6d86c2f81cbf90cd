#!/usr/bin/env bash
# GPU check, one script, under 10 minutes on an H100 / H200: both attention backends (Pallas Triton and
# Mosaic GPU) measured on the device, then the engine end to end with each.
# No installs, no network. Usage (from anywhere): scripts/gpu_check.sh [OUT_DIR]   (DRY_RUN=1: print the
# plan, run nothing; any machine). OUT_DIR defaults to $OUT, else ./gpu_check_out. Writes there:
#   env.txt                            jax, devices, nvidia-smi
#   kernels_{triton,mosaic}/           jaxpaged/bench/kernels.py --backend B, bf16 pool: decode grid (batch x
#                                      context) and one mixed step, bytes/s against a device copy measured in
#                                      the same run, max error against the reference for every shape
#   kernels_{triton,mosaic}_fp8/       the decode grid over a float8_e4m3fn pool (scales included in bytes)
#   e2e_{triton,mosaic_gpu}_{bf16,fp8}.json   jaxpaged/bench/host.py: the engine, decode at 1 / 64 / 256
#                                      running, bfloat16 weights, KV bf16 or fp8: step time, device time,
#                                      roofline share
#   summary.md                         every table above, and each part's exit status
# With EXTRA=1 (beyond the 10 minutes): tensor parallelism on >= 2 GPUs (TP=2 tokens vs TP=1, throughput)
# and the host path at 64 running, sync vs async scheduling (tp_*.json, host_*.json).
# Each part is guarded: a failing part is recorded and the next one still runs.
# Time: 2 x (50 + 20) s of kernel benchmarks plus their compiles, 4 engine runs of at most 90 s each: ~10 min.
# Environment: PYTHON (default python3), KERNEL_BUDGET (s per bf16 benchmark, default 50), FP8_BUDGET (s per
# fp8 benchmark, default 20), E2E_TIMEOUT (s per engine run, default 90), E2E_MODEL (default
# random:smollm2-135m: the default model's shapes, random weights, offline), TP_MODEL, HOST_MODEL, TP_TIMEOUT,
# HOST_TIMEOUT (EXTRA).
set -u
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DRY="${DRY_RUN:-0}"
if [ "$DRY" != 1 ]; then mkdir -p "$OUT_DIR" && OUT_DIR="$(cd "$OUT_DIR" && pwd)"; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the benchmarks size their own pools
STATUS=""

# part NAME TIMEOUT LOG CMD...: run CMD under TIMEOUT, log to LOG
part() {
  local name="$1" limit="$2" log="$3"; shift 3
  if [ "$DRY" = 1 ]; then echo "[dry run] $name: timeout $limit $* > $log"; STATUS="$STATUS
- $name: dry run"; return 0; fi
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  echo "$name: exit $rc"
  STATUS="$STATUS
- $name: exit $rc"
}

if [ "$DRY" != 1 ]; then
  {
    date -u
    "$PY" --version
    "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv 2>/dev/null
  } >"$OUT_DIR/env.txt" 2>&1
  cat "$OUT_DIR/env.txt"
fi

KB="${KERNEL_BUDGET:-50}"
FB="${FP8_BUDGET:-20}"
for backend in triton mosaic; do
  part "kernels $backend bf16" $((KB + 90)) "$OUT_DIR/kernels_$backend.log" \
    "$PY" -m jaxpaged.bench.kernels --backend "$backend" --out "$OUT_DIR/kernels_$backend" --time-budget "$KB"
  part "kernels $backend fp8" $((FB + 60)) "$OUT_DIR/kernels_${backend}_fp8.log" \
    "$PY" -m jaxpaged.bench.kernels --backend "$backend" --kv-dtype float8_e4m3fn \
    --out "$OUT_DIR/kernels_${backend}_fp8" --time-budget "$FB"
done

for backend in triton mosaic_gpu; do
  for kv in bf16 fp8; do
    kvd=$([ "$kv" = fp8 ] && echo float8_e4m3fn || echo auto)
    part "engine $backend KV $kv" "${E2E_TIMEOUT:-90}" "$OUT_DIR/e2e_${backend}_$kv.log" \
      "$PY" -m jaxpaged.bench.host --model "${E2E_MODEL:-random:smollm2-135m}" --running 1 64 256 --steps 16 \
      --replays 4 --dtype bfloat16 --kv-cache-dtype "$kvd" --attention-backend "$backend" \
      --json "$OUT_DIR/e2e_${backend}_$kv.json"
  done
done

if [ "${EXTRA:-0}" = 1 ]; then
  num_gpus=$("$PY" -c "import jax; print(sum(d.platform == 'gpu' for d in jax.devices()))" 2>/dev/null || echo 0)
  if [ "${num_gpus:-0}" -ge 2 ]; then
    part "TP=2 tokens vs TP=1" "${TP_TIMEOUT:-900}" "$OUT_DIR/tp_check.log" "$PY" -m jaxpaged.bench.tp_check \
      --tensor-parallel-size 2 --model "${TP_MODEL:-random:llama-8h}" --json "$OUT_DIR/tp_check.json"
    part "TP throughput" "${TP_TIMEOUT:-900}" "$OUT_DIR/tp_throughput.log" "$PY" -m jaxpaged.bench.throughput \
      --model "${TP_MODEL:-random:llama-8h}" --backend jaxpaged --dtype bfloat16 --num-prompts 256 \
      --max-num-seqs 64 --tensor-parallel-size 1 --tensor-parallel-size 2 --json "$OUT_DIR/tp_throughput.json"
  fi
  for mode in off on; do
    part "host path, async scheduling $mode" "${HOST_TIMEOUT:-600}" "$OUT_DIR/host_$mode.log" \
      "$PY" -m jaxpaged.bench.host --running 64 --steps 64 --replays 16 --dtype bfloat16 \
      ${HOST_MODEL:+--model "$HOST_MODEL"} --async-scheduling "$mode" --json "$OUT_DIR/host_$mode.json"
  done
fi

if [ "$DRY" = 1 ]; then echo "[dry run] summary.md from the parts above"; exit 0; fi
e2e_table=$("$PY" - "$OUT_DIR" <<'PYEOF' 2>&1
import json, os, sys
d = sys.argv[1]
print("| backend | KV | running | step ms | device ms | tok/s |")
print("| --- | --- | --- | --- | --- | --- |")
for b in ("triton", "mosaic_gpu"):
    for kv in ("bf16", "fp8"):
        p = os.path.join(d, f"e2e_{b}_{kv}.json")
        if not os.path.exists(p):
            print(f"| {b} | {kv} | (no result) | | | |")
            continue
        for r in json.load(open(p))["results"]:
            print(f"| {b} | {kv} | {r['running']} | {1e3 * r['step_wall_s']:.2f} | {1e3 * r['device_s']:.2f} | "
                  f"{r['running'] / r['step_wall_s']:.0f} |")
PYEOF
)
{
  echo "# GPU check"
  echo
  echo '```'
  cat "$OUT_DIR/env.txt"
  echo '```'
  echo
  echo "Parts:$STATUS"
  for d in kernels_triton kernels_mosaic kernels_triton_fp8 kernels_mosaic_fp8; do
    echo
    echo "## $d"
    if [ -f "$OUT_DIR/$d/results.md" ]; then cat "$OUT_DIR/$d/results.md"; else tail -n 20 "$OUT_DIR/$d.log"; fi
  done
  echo
  echo "## Engine end to end (decode-only steps)"
  echo
  echo "$e2e_table"
} >"$OUT_DIR/summary.md"
cat "$OUT_DIR/summary.md"

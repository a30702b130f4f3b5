#!/usr/bin/env bash
# The fp8 paged cache's decode attention against the bf16 cache's (issue 47),
# the Llama-3.1-8B shape, random weights, 1,550-token contexts:
#   1. `inferscale check` (the fp8 cache's op checks among them), and
#      BEFORE's if given;
#   2. decode steps at M = 1/32/100/128: bf16 cache, then fp8 with BEFORE
#      (an earlier build, if given), then fp8 with BIN, beside the floor;
#   3. ncu's details (speed of light, warp stalls, memory, occupancy) of one
#      decode-step attention launch of each cache at M = 32 (NCU_BATCH), CUDA graphs
#      off, with the warp stall reasons summed from the raw metrics.
# About five minutes on an H100. BATCHES (default 1,32,100,128) and REPS
# (default 2) set the decode runs, FP8_ONLY=1 leaves out the bf16 one,
# BEFORE_BF16=1 adds BEFORE's bf16 run beside BIN's; NCU=0
# skips step 3, NCU=only runs it alone; NCU_DTYPES (default "auto fp8") names
# the caches it profiles; STOP_ON_FAIL=1 stops after a failed check;
# BEFORE_CHECK=0 skips BEFORE's check (a landed build, already checked).
#
#   [BATCHES=32,128 REPS=1 NCU=0] gpu_fp8_attention.sh BIN OUT [BEFORE]
set -uo pipefail
bin=$1 out=$2 before=${3:-}
mkdir -p "$out"
here=$(dirname "$0")
source "$here/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
ctx=1550 batch_tokens=1024 layers=32  # the 8B shape's
e=(--backend cuda --shape llama3.1-8b --random-weights --kv-cache-mb 40000 --max-batch-tokens $batch_tokens --gemm-n 512
  --prompt-tokens 16 --decode-prompt-tokens $ctx)
if [ "${NCU:-1}" != only ]; then
timeout 300 "$bin" check --json "$out/check.json" >"$out/check.txt" 2>&1
check_rc=$?
echo "check: exit $check_rc"
grep -E "FAILED" "$out/check.txt" | head -20
grep -E "fp8 cache.*attention" "$out/check.txt" | head -14
tail -n 1 "$out/check.txt"
# STOP_ON_FAIL=1: a failed check ends the run (a kernel under test).
[ "$check_rc" != 0 ] && [ "${STOP_ON_FAIL:-0}" = 1 ] && exit 1
if [ -n "$before" ] && [ "${BEFORE_CHECK:-1}" != 0 ]; then
  timeout 300 "$before" check >"$out/check-before.txt" 2>&1
  echo "check, BEFORE: exit $?"
  grep -E "FAILED|gaps" "$out/check-before.txt" | head -20
  tail -n 1 "$out/check-before.txt"
fi
python3 "$here"/peer/copy_bandwidth.py "$out/copy-bandwidth.json"
# (cache, binary, build label): bf16 runs unless FP8_ONLY=1 (their rows
# already measured on this machine), BEFORE's only with BEFORE_BF16=1 (a
# change to both caches' kernels); then fp8, BEFORE's first if given.
runs=()
if [ "${FP8_ONLY:-0}" != 1 ]; then
  [ -n "$before" ] && [ "${BEFORE_BF16:-0}" = 1 ] && runs+=("auto $before before")
  runs+=("auto $bin")
fi
[ -n "$before" ] && runs+=("fp8 $before before")
runs+=("fp8 $bin")
for r in "${runs[@]}"; do
  set -- $r
  name=engine-8b-$1${3:+-$3}
  timeout 150 "$2" bench engine "${e[@]}" --decode-batch "${BATCHES:-1,32,100,128}" --decode-tokens 32 --reps "${REPS:-2}" \
    --kv-cache-dtype $1 --json "$out/$name.json" >"$out/$name.txt" 2>&1
  echo "== $name"; grep -E "^decode|error" "$out/$name.txt"
done
python3 "$here/peer/decode_floor.py" "$out" | tee "$out/decode-floor.md"
[ "${NCU:-1}" = 0 ] && exit 0
fi

ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "gpu_fp8_attention.sh: no ncu on this machine" >&2; exit 1; }
# Attention launches before the timed decode steps: the 16-token prefill
# benchmark, then twice (warm-up, timed) M prompts of ctx − 1 tokens in
# ceil(M × (ctx − 1) / batch_tokens) steps × 32 layers, with 4 warm-up decode
# steps between: ≈ 3,330 at M = 32. Skipping layers × (2 × steps + 8) + 200
# lands in the timed decode steps (grid M × 8 × splits). NCU_BATCH (default 32)
# is M.
m=${NCU_BATCH:-32}
skip=$((layers * (2 * ((m * (ctx - 1) + batch_tokens - 1) / batch_tokens) + 8) + 200))
for dtype in ${NCU_DTYPES:-auto fp8}; do
  timeout 200 "$ncu" --clock-control none -k regex:paged_attention --launch-skip $skip --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section SchedulerStats --section InstructionStats \
    -o "$out/ncu-attention-$dtype" -f "$bin" bench engine "${e[@]}" --decode-batch "$m" --decode-tokens 64 --reps 1 \
    --cuda-graphs off --kv-cache-dtype $dtype >"$out/ncu-attention-$dtype.log" 2>&1
  echo "== ncu, $dtype cache: exit $?"
  "$ncu" -i "$out/ncu-attention-$dtype.ncu-rep" --page details >"$out/ncu-attention-$dtype.txt" 2>&1
  "$ncu" -i "$out/ncu-attention-$dtype.ncu-rep" --page raw --csv >"$out/ncu-attention-$dtype-raw.csv" 2>&1
  grep -E "paged_attention|Duration|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issued Ipc|Executed Instructions  |L2 Hit|L1/TEX Hit" "$out/ncu-attention-$dtype.txt"
  python3 - "$out/ncu-attention-$dtype-raw.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"')))
for r in rows[1:]:
    key = "smsp__average_warps_issue_stalled_"
    stalls = {k[len(key):].split("_per_issue")[0]: float(v.replace(",", "")) for k, v in r.items()
              if k.startswith(key) and v and v[0].isdigit()}
    top = sorted(stalls.items(), key=lambda t: -t[1])[:7]
    print("  stalls (warps per issue):", ", ".join(f"{k} {v:.2f}" for k, v in top))
PY
done

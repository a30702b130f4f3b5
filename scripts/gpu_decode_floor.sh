#!/usr/bin/env bash
# Decode steps beside their floor on one GPU (the speed issue's "decode step
# time at M = 1, 32, 100, 128" and "Qwen batch-1 decode"), random weights:
#
#   1. the device's copy bandwidth (torch, a 4 GiB device-to-device copy:
#      bytes read + written per second), the floor's denominator;
#   2. `bench engine` decode steps of the Llama-3.1-8B shape at batch
#      1/32/100/128 with 128-token and 1,550-token contexts (the second is
#      what a kv request at k = 50 of 25-token facts holds);
#   3. `bench engine` decode at batch 1 of the Qwen2.5-1.5B shape;
#   4. `bench ttft` on the 8B shape, kv/prompt/blend at k = 5/50/200, one run.
#
# A step's floor = (weights read once + every sequence's KV) / copy bandwidth;
# scripts/peer/decode_floor.py prints the table from the JSON.
#
#   [SKIP_TTFT=1] gpu_decode_floor.sh BIN OUT
set -uo pipefail
bin=$1 out=$2
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"

python3 "$(dirname "$0")"/peer/copy_bandwidth.py "$out/copy-bandwidth.json"

eight=(--backend cuda --shape llama3.1-8b --random-weights --kv-cache-mb 40000 --max-batch-tokens 8192)
for ctx in 128 1550; do
  "$bin" bench engine "${eight[@]}" --prompt-tokens 1000 --decode-batch 1,32,100,128 --decode-prompt-tokens "$ctx" \
    --decode-tokens 32 --reps 3 --gemm-n 512 --json "$out/engine-8b-ctx$ctx.json" 2>&1 | grep -v "^inferscale: CUDA" |
    tee "$out/engine-8b-ctx$ctx.txt"
done
"$bin" bench engine --backend cuda --shape qwen2.5-1.5b --random-weights --kv-cache-mb 8000 --max-batch-tokens 8192 \
  --prompt-tokens 1000 --decode-batch 1,32,100 --decode-prompt-tokens 1550 --decode-tokens 64 --reps 3 --gemm-n 512 \
  --json "$out/engine-qwen1.5b.json" 2>&1 | grep -v "^inferscale: CUDA" | tee "$out/engine-qwen1.5b.txt"
[ -n "${SKIP_TTFT:-}" ] || "$bin" bench ttft "${eight[@]::5}" --kv-cache-mb 16384 --max-batch-tokens 8192 --modes kv,prompt,blend --k 5,50,200 \
  --reps 20 --json "$out/ttft-8b.json" 2>&1 | grep -v "^inferscale: CUDA" | tail -n 20 | tee "$out/ttft-8b.txt"
python3 "$(dirname "$0")/peer/decode_floor.py" "$out" | tee "$out/decode-floor.md"

#!/usr/bin/env bash
# The fp8 paged cache on the device (`--kv-cache-dtype fp8`, kernels/kv_fp8.cu),
# random weights, in one call (about eight minutes on an H200):
#   1. `inferscale check` and decode steps of the Llama-3.1-8B shape at
#      M = 1/32/100/128 over 1,550-token contexts, bf16 cache then fp8,
#      beside their floor: scripts/gpu_fp8_attention.sh without its ncu step;
#   2. batch-1 TTFT, kv and prompt mode at k = 5/50/200, bf16 then fp8;
#   3. `bench serve` at 100 clients, kv mode, 50 facts of 126 tokens (the
#      peer table's ≈ 6,600-token contexts, more than 40,000 MiB of bf16
#      cache holds for 100 sequences), bf16 then fp8 in the same MiB.
#
# Read the benchmarks only if the check passed. The first run (an H100,
# 2026-12-06: docs/performance.md, "An fp8 paged cache on CUDA") had the
# device for less than this script needs and ran its pieces by hand.
#
# PARTS (default "attention ttft serve") runs a subset, e.g. the rest
# of a run whose first call ran out of time.
#
#   [PARTS="ttft serve"] gpu_fp8_cache.sh BIN OUT
set -uo pipefail
bin=$1 out=$2
parts=" ${PARTS:-attention ttft serve} "
mkdir -p "$out"
here=$(dirname "$0")
source "$here/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
eight=(--backend cuda --shape llama3.1-8b --random-weights)
if [[ $parts == *" attention "* ]]; then
  NCU=0 bash "$here/gpu_fp8_attention.sh" "$bin" "$out"
fi

if [[ $parts == *" ttft "* ]]; then
for dtype in auto fp8; do
  timeout 150 "$bin" bench ttft "${eight[@]}" --kv-cache-mb 16384 --max-batch-tokens 8192 --modes kv,prompt \
    --k 5,50,200 --reps 6 --kv-cache-dtype $dtype --json "$out/ttft-8b-$dtype.json" 2>&1 |
    grep -v "^inferscale: CUDA\|^inferscale bench ttft: k=" | tail -n 12 | tee "$out/ttft-8b-$dtype.txt"
done
fi

if [[ $parts == *" serve "* ]]; then
for dtype in auto fp8; do
  timeout 150 "$bin" bench serve "${eight[@]}" --embedder random --window 0 --kv-cache-mb 40000 \
    --kv-cache-dtype $dtype --max-batch-tokens 2048 --max-running 128 --max-queue 512 --users 100 --modes kv \
    --k 50 --fact-tokens 126 --max-tokens 32 --memory-users 5 --facts-per-user 50 --warmup-s 3 --duration-s 10 \
    --json "$out/serve-$dtype.json" >"$out/serve-$dtype.txt" 2>&1
  grep -v "^inferscale: CUDA" "$out/serve-$dtype.txt" | tail -n 6
done
fi

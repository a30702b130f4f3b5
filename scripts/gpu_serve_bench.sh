#!/usr/bin/env bash
# Serving throughput on one GPU (docs/performance.md): `bench serve` on the
# Llama-3.1-8B shape with random weights, kv and prompt mode, k = 50,
# 32 output tokens, closed-loop clients 1/10/50/100.
# Usage: [WARMUP_S=8 DURATION_S=20] gpu_serve_bench.sh BIN OUTDIR [extra bench flags…]
set -uo pipefail
bin=$1 out=$2
shift 2
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
"$bin" bench serve --backend cuda --shape llama3.1-8b --random-weights --embedder random --window 0 \
  --kv-cache-mb 40000 --max-batch-tokens 2048 --max-running 128 --max-queue 512 \
  --users 1,10,50,100 --modes kv,prompt --k 50 --max-tokens 32 --memory-users 10 --facts-per-user 50 \
  --warmup-s "${WARMUP_S:-8}" --duration-s "${DURATION_S:-20}" --json "$out/serve-llama3.1-8b.json" "$@" 2>&1 | tee "$out/serve.txt"

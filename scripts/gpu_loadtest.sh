#!/usr/bin/env bash
# The load-test harness against the full HTTP path on one GPU
# (docs/loadtest.md, docs/performance.md): `inferscale serve` (router +
# worker) on the Llama-3.1-8B shape with random weights, then
# `inferscale loadtest` with synthetic users, kv and prompt mode, k = 50,
# 32 output tokens, closed-loop users 1/10/50/100 over 10 shared memories of
# 50 facts (the 8B shape's pre-RoPE KV is ~0.26 MB per token on disk).
# MEMORIES=100 gives every user a memory of their own (5,000 facts: with
# SERVE_FLAGS="--kv-format fp8 …" ≈ 41 GB of segments); SERVE_FLAGS are
# added to the server's (budgets, format).
# Usage: [DURATION_S=20] [MEMORIES=10] [SERVE_FLAGS=…] gpu_loadtest.sh BIN OUTDIR [extra loadtest flags…]
set -uo pipefail
bin=$1 out=$2
shift 2
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
mem=$(mktemp -d)
"$bin" serve --listen 127.0.0.1:8080 --worker-http-listen 127.0.0.1:9090 --memory "$mem" \
  --backend cuda --shape llama3.1-8b --random-weights --embedder random --window 0 \
  --kv-cache-mb 40000 --max-batch-tokens 2048 --max-running 128 --max-queue 512 --deadline-s 600 \
  ${SERVE_FLAGS:-} >"$out/serve.log" 2>&1 &
srv=$!
for _ in $(seq 1 300); do
  curl -sf http://127.0.0.1:8080/readyz >/dev/null && break
  sleep 1
done
"$bin" loadtest --url http://127.0.0.1:8080 --users 1,10,50,100 --k 50 --modes kv,prompt \
  --requests 100000 --duration-s "${DURATION_S:-20}" --max-tokens 32 --ignore-eos --synthetic-facts 50 --memories "${MEMORIES:-10}" \
  --machine "$(cat "$out/gpu.txt")" --json "$out/loadtest-h200-llama3.1-8b.json" --plots "$out" "$@" \
  2>&1 | tee "$out/loadtest.txt"
curl -s http://127.0.0.1:9090/metrics >"$out/worker-metrics.txt"
curl -s http://127.0.0.1:8080/metrics >"$out/router-metrics.txt"
du -sh "$mem" | tee "$out/store-size.txt"
kill "$srv"
wait "$srv"
rm -rf "$mem"

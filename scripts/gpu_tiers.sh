#!/usr/bin/env bash
# The tiered KV store under load (docs/performance.md, "Many users per
# GPU"): `inferscale serve` on the Llama-3.1-8B shape (random weights) with
# device and host budgets far below the store, a population of distinct
# synthetic users ingested once, then the server restarted with the page
# cache dropped (every fact's KV on disk only; the store's open time is in
# serve.log), and `inferscale loadtest` with 100 closed-loop clients whose
# requests pick users by a Zipf law: kv, then prompt mode on the same
# request stream, then kv over the 10 most popular users only (all cached:
# the resident figure under the same load).
#
#   gpu_tiers.sh ingest BIN OUT    serve, ingest the population, stop
#   gpu_tiers.sh run BIN OUT       restart cold, measure, stop
#   gpu_tiers.sh warm BIN OUT      serve, ingest, measure kv and prompt
#                                  without a restart (what ingest left in
#                                  the tiers stays), stop
#
# Environment (defaults): USERS=400 FACTS=8 K=8 FORMAT=fp8 DEVICE_MB=2048
# HOST_MB=8192 ZIPF=1.0 DURATION_S=60 STORE_DIR=/tmp/inferscale-tiers
# COLD_KV=auto (the server's default; or prefill, read or wait; COLD_KV_WAIT_MS: the
# server's default unless set)
# PROMOTE_AFTER=0 (--kv-promote-after: host-tier hits before a fact is read
# again onto the device; 0 = never) READERS (--kv-readers; unset: the server's
# default) MODES=kv,prompt WARM=false (--kv-warm-restart: true, a restart reads
# back what the tiers held when the server last stopped; false, every start cold)
# DELAY_S=0 (run only: seconds between the server's readiness and the stream,
# as for a node brought up before the router sends it users)
# HOT=1 (0: no 10-hottest-users point).
# PROFILE=1 (run only): the server under INFERSCALE_CUDA_PROFILE=1, its per-op
# device time over the whole run in profile.txt when it stops. Profiling
# turns decode graphs off and slows serving: a profile, not a timing.
# WORKER_PROFILE=1 (default; 0 to leave out): the engine thread's time every
# 10 s (INFERSCALE_WORKER_PROFILE: commands — of them retrieval and KV lookup —,
# layout, forward, sampling; a few
# clock reads a step) in worker-profile.txt, and the worker's metrics give
# the tokens each step computed (inferscale_worker_batch_tokens).
# MODEL=PATH: a real model (a GGUF, e.g. the Qwen2.5-Coder-1.5B that
# scripts/gpu_qwen.sh assembles in /tmp/qwen) instead of the Llama-3.1-8B
# shape with random weights; at its 14 KB of fp8 KV a token, scale USERS up
# or the budgets down to keep the store far larger than they are.
#
# The prefix cache is off: a synthetic user has FACTS questions and popular
# users ask them over and over, so prompt mode would find whole prompts
# cached, which real users' questions do not give it.
set -uo pipefail
step=$1 bin=$2 out=$3
users=${USERS:-400} facts=${FACTS:-8} k=${K:-8} format=${FORMAT:-fp8}
mem=${STORE_DIR:-/tmp/inferscale-tiers}
source "$(dirname "$0")/gpu_env.sh"
if [ -n "${MODEL:-}" ]; then model_args=(--model "$MODEL"); else model_args=(--shape llama3.1-8b --random-weights); fi
mkdir -p "$out"

serve() {
  INFERSCALE_CUDA_PROFILE=${PROFILE:-0} INFERSCALE_WORKER_PROFILE=${WORKER_PROFILE:-1} \
    "$bin" serve --listen 127.0.0.1:8080 --worker-http-listen 127.0.0.1:9090 --memory "$mem" \
    --backend cuda "${model_args[@]}" --embedder random --window 0 \
    --kv-format "$format" --kv-device-mb "${DEVICE_MB:-2048}" --kv-host-mb "${HOST_MB:-8192}" \
    --cold-kv "${COLD_KV:-auto}" ${COLD_KV_WAIT_MS:+--cold-kv-wait-ms "$COLD_KV_WAIT_MS"} --prefix-cache off \
    --kv-promote-after "${PROMOTE_AFTER:-0}" ${READERS:+--kv-readers "$READERS"} --kv-warm-restart "${WARM:-false}" \
    --kv-cache-mb 40000 --max-batch-tokens 2048 --max-running 128 --max-queue 512 --deadline-s 600 \
    >>"$out/serve.log" 2>&1 &
  srv=$!
  for _ in $(seq 1 300); do
    curl -sf http://127.0.0.1:8080/readyz >/dev/null && return
    sleep 1
  done
  echo "the server did not become ready" >&2
  exit 1
}

stop() {
  curl -s http://127.0.0.1:9090/metrics >"$out/worker-metrics-$1.txt"
  kill "$srv"
  wait "$srv"
}

# The machine, for the load test's JSON (`--machine`): every step writes it,
# so that a `run` into another OUT than the ingest's names its card too.
machine() {
  [ -s "$out/gpu.txt" ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$out/gpu.txt"
  cat "$out/gpu.txt"
}

loadtest() {
  "$bin" loadtest --url http://127.0.0.1:8080 --synthetic-facts "$facts" --k "$k" --max-tokens 32 \
    --ignore-eos --user-prefix tiers --machine "$(machine)" "$@"
}

# A fresh store, served, with the population ingested by one request.
fresh_and_ingested() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
  rm -rf "$mem"
  serve
  loadtest --population "$users" --users 1 --modes kv --requests 1 --warmup 0 --json "$out/ingest.json" \
    2>&1 | tee "$out/ingest.txt"
}

# kv, then prompt mode on the same Zipf request stream.
zipf_point() {
  loadtest --population "$users" --zipf "${ZIPF:-1.0}" --users 100 --modes "${MODES:-kv,prompt}" --requests 100000 \
    --duration-s "${DURATION_S:-60}" --json "$out/tiers.json" 2>&1 | tee "$out/tiers.txt"
}

case $step in
ingest)
  fresh_and_ingested
  stop ingest
  du -sh "$mem" | tee "$out/store-size.txt"
  df -h "$(dirname "$mem")" | tail -1 | tee -a "$out/store-size.txt"
  ;;
run)
  sync
  echo 3 >/proc/sys/vm/drop_caches
  serve
  grep "opened memory" "$out/serve.log" | tail -1 | tee "$out/open.txt"
  sleep "${DELAY_S:-0}"
  zipf_point
  if [ "${HOT:-1}" = 1 ]; then
    loadtest --population 10 --users 100 --modes kv --requests 100000 --duration-s "${DURATION_S:-60}" \
      --json "$out/tiers-hot.json" 2>&1 | tee "$out/tiers-hot.txt"
  fi
  stop run
  grep "inferscale worker profile" "$out/serve.log" >"$out/worker-profile.txt"
  if [ "${PROFILE:-0}" = 1 ]; then
    grep -A 40 "inferscale cuda profile" "$out/serve.log" | grep -v " INFO \| WARN " | tee "$out/profile.txt"
  fi
  ;;
warm)
  fresh_and_ingested
  du -sh "$mem" | tee "$out/store-size.txt"
  zipf_point
  stop warm
  ;;
*)
  echo "usage: gpu_tiers.sh ingest|run|warm BIN OUT" >&2
  exit 2
  ;;
esac

#!/usr/bin/env bash
# The peer benchmark of the speed issue, in one command on one GPU node:
# the same `inferscale loadtest` stream (synthetic users sharing MEMORIES
# memories of 50 facts, k = 50, 32 output tokens, closed-loop clients
# 1/10/50/100, kv then prompt mode at each point) through the router's
# OpenAI API against
#   native  `inferscale serve`: our engine, kv and prompt mode
#   vllm    `inferscale router` + `inferscale worker --engine vllm`: vLLM
#           0.26 with our connector in kv mode, and vLLM's own prompt mode
#           (its OpenAI server, automatic prefix caching on) with the facts
#           the router retrieved pasted into the prompt — the Mem0-style
#           baseline
# on the Llama-3.1-8B shape with random (ours) and dummy (vLLM) weights —
# speed only — then one table of both (scripts/peer/peer_table.py).
#
#   gpu_peer_bench.sh BIN OUT
#
# Environment (defaults): PEERS="native vllm", USERS=1,10,50,100,
# DURATION_S=20, MEMORIES=5, K=50, KV_CACHE_MB=40000 (the paged KV cache
# of both engines, MiB: ours `--kv-cache-mb`, vLLM's
# `--kv-cache-memory-bytes`, which overrides its memory-utilization
# sizing — the same KV bytes, so the same sequences fit); native:
# PREFIX_CACHE=user (as in vLLM mode, whose prompt-mode requests carry a
# salt of their user: like for like); vllm: VLLM_MAX_LEN=8192;
# MODEL_FLAGS (the model flags of both, default the 8B shape on CUDA). The vLLM part needs vLLM and its
# dependencies under /tmp/site (scripts/gpu_vllm_prepare.sh, steps 1–3).
set -uo pipefail
bin=$1 out=$2
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || uname -n; } | tee "$out/gpu.txt"
model=${MODEL_FLAGS:---backend cuda --shape llama3.1-8b --random-weights --embedder random}
users=${USERS:-1,10,50,100} duration=${DURATION_S:-20} memories=${MEMORIES:-5} k=${K:-50}
kv_mb=${KV_CACHE_MB:-40000}
echo "paged KV cache of each engine: $kv_mb MiB ($((kv_mb << 20)) bytes)" | tee "$out/kv-bytes.txt"

wait_ready() { # URL LIMIT_S PID
  for _ in $(seq 1 "$2"); do
    curl -sf "$1" >/dev/null && return 0
    kill -0 "$3" 2>/dev/null || { echo "exited before it was ready" >&2; return 1; }
    sleep 1
  done
  echo "not ready after $2 s" >&2
  return 1
}

loadtest() { # LABEL
  "$bin" loadtest --url http://127.0.0.1:8080 --users "$users" --k "$k" --modes kv,prompt \
    --requests 100000 --duration-s "$duration" --max-tokens 32 --ignore-eos --synthetic-facts 50 \
    --memories "$memories" --window 0 --machine "$(cat "$out/gpu.txt"), $1" \
    --json "$out/peer-$1.json" 2>&1 | tee "$out/loadtest-$1.txt"
}

for peer in ${PEERS:-native vllm}; do
  mem=$(mktemp -d)
  case $peer in
  native)
    "$bin" serve --listen 127.0.0.1:8080 --worker-http-listen 127.0.0.1:9090 --memory "$mem" \
      $model --window 0 --kv-cache-mb "$kv_mb" --max-batch-tokens 2048 --max-running 128 --max-queue 512 \
      --deadline-s 600 --prefix-cache "${PREFIX_CACHE:-user}" >"$out/serve-native.log" 2>&1 &
    pids=$!
    wait_ready http://127.0.0.1:8080/readyz 300 "$pids" && loadtest native
    curl -s http://127.0.0.1:9090/metrics >"$out/worker-metrics-native.txt"
    ;;
  vllm)
    # vLLM's environment, and start_worker: vLLM takes minutes to start,
    # longer than the router waits for a healthy worker, so the router
    # starts once the worker serves gRPC.
    BIN=$bin
    source "$(dirname "$0")/gpu_vllm_common.sh"
    start_worker "$out/worker-vllm.log" 600 --listen 127.0.0.1:50051 --memory "$mem" $model --window 0 \
      --kv-cache-mb 2048 --vllm-arg=--kv-cache-memory-bytes="$((kv_mb << 20))" \
      --vllm-arg=--gpu-memory-utilization=0.9 --vllm-arg=--max-model-len="${VLLM_MAX_LEN:-8192}"
    "$bin" router --worker 127.0.0.1:50051 --listen 127.0.0.1:8080 --deadline-s 600 >"$out/router-vllm.log" 2>&1 &
    pids="$! $WORKER"
    wait_ready http://127.0.0.1:8080/readyz 120 "$!" && loadtest vllm
    ;;
  *)
    echo "unknown peer $peer (native, vllm)" >&2
    exit 2
    ;;
  esac
  kill $pids
  for p in $pids; do
    for _ in $(seq 40); do kill -0 "$p" 2>/dev/null || break; sleep 1; done
  done
  pgrep -f "vllm.entrypoints" >/dev/null && echo "vLLM left running" >&2
  rm -rf "$mem"
done

reports=()
for peer in ${PEERS:-native vllm}; do
  [ -f "$out/peer-$peer.json" ] && reports+=("$peer=$out/peer-$peer.json")
done
python3 "$(dirname "$0")/peer/peer_table.py" --json "$out/peer-table.json" "${reports[@]}" | tee "$out/peer-table.md"

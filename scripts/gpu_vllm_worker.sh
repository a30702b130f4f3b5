#!/usr/bin/env bash
# `inferscale worker --engine vllm` end to end on one GPU node: vLLM 0.26
# serving dummy weights of the Llama-3.1-8B shape with our connector, its
# worker gRPC API behind `inferscale router`, driven over the router's HTTP
# API (memories, chats) and by `inferscale loadtest` (kv vs prompt mode at
# k = 5…50, side by side). Writes logs and JSON under $OUT.
#
# Expects vLLM and its missing dependencies installed under /tmp/site (steps
# 1–3 of scripts/gpu_vllm_prepare.sh's header, without running its script)
# and target/release/inferscale carried.
set -uo pipefail
. scripts/gpu_vllm_common.sh
MEM=/tmp/vmem
rm -rf "$MEM"

start_worker "$OUT/worker.log" 420 --listen 127.0.0.1:50051 --memory "$MEM" --backend cuda \
  --shape llama3.1-8b --random-weights --embedder random --window 0 --kv-cache-mb 2048 \
  --vllm-arg=--gpu-memory-utilization=0.55 --vllm-arg=--max-model-len=8192
$BIN router --worker 127.0.0.1:50051 --listen 127.0.0.1:8080 --deadline-s 300 > "$OUT/router.log" 2>&1 &
ROUTER=$!
sleep 3

api() { curl -s -w '\n%{http_code}\n' "$@"; }
{
  echo "== ingest"; api localhost:8080/v1/memories -d '{"user": "ana", "window": 0, "turns": [
    {"id": "D1:1", "speaker": "Ana", "text": "I adopted a grey cat named Miso."},
    {"id": "D1:2", "speaker": "Ana", "text": "My sister Lena lives in Porto."},
    {"id": "D1:3", "speaker": "Ana", "text": "I run every Sunday morning."}]}'
  echo "== list"; api localhost:8080/v1/memories/ana
  for mode in kv prompt none; do
    echo "== chat $mode"
    api localhost:8080/v1/chat/completions -d "{\"model\": \"llama3.1-8b\", \"user\": \"ana\", \"max_tokens\": 8,
      \"messages\": [{\"role\": \"user\", \"content\": \"Where does my sister live?\"}],
      \"memory\": {\"mode\": \"$mode\", \"k\": 2}}"
  done
  echo "== chat streamed kv"
  api -N localhost:8080/v1/chat/completions -d '{"model": "llama3.1-8b", "user": "ana", "max_tokens": 4, "stream": true,
    "stream_options": {"include_usage": true},
    "messages": [{"role": "user", "content": "Where does my sister live?"}], "memory": {"mode": "kv", "k": 3}}'
  echo "== bad: k too large"
  api localhost:8080/v1/chat/completions -d '{"model": "llama3.1-8b", "user": "ana",
    "messages": [{"role": "user", "content": "hi"}], "memory": {"mode": "kv", "k": 5000}}'
  echo "== forget one"; api -X DELETE localhost:8080/v1/memories/ana/D1:3
  echo "== list"; api localhost:8080/v1/memories/ana
} > "$OUT/api.txt" 2>&1
cat "$OUT/api.txt" | cut -c1-400

timeout 420 $BIN loadtest --url http://127.0.0.1:8080 --users 1,8 --k 5,10,20,50 --modes kv,prompt \
  --requests 24 --duration-s 15 --max-tokens 16 --ignore-eos --synthetic-facts 60 --memories 4 --window 0 \
  --machine "1x NVIDIA H200, vLLM 0.26 engine (inferscale worker --engine vllm)" \
  --json "$OUT/loadtest-vllm.json" > "$OUT/loadtest.txt" 2>&1
echo "loadtest rc=$?"
tail -25 "$OUT/loadtest.txt"
sleep 3  # the router polls its workers' stats once a second
curl -s localhost:8080/metrics > "$OUT/router-metrics.txt"
grep -E "^inferscale_worker_(running|facts|users)" "$OUT/router-metrics.txt" | head
grep -E "inferscale: (loaded|request)|refused|Traceback|Error" "$OUT/worker.log" | head -20
grep -cE "recomputed" "$OUT/worker.log"

stop_worker $ROUTER $WORKER
tail -5 "$OUT/worker.log"

#!/usr/bin/env bash
# SmolLM2-135M-Instruct (its real weights) in vLLM 0.26 through
# `inferscale worker --engine vllm`: the packaged GGUF feeds our core, its
# `inferscale export-hf` copy (bfloat16 safetensors) feeds vLLM, so both
# sides hold the same weights. Answers through the router in kv and prompt
# mode, greedy: for a user with no memory the only injected KV is the
# header, exactly what vLLM's own prefill computes (E2), so the answers
# must agree; with memory, both answers must use it. Writes under $OUT.
#
# Expects vLLM under /tmp/site (see gpu_vllm_worker.sh), the GGUF's parts in
# /tmp/gguf (split here by `split -b 50000000`, one part per transfer), and
# target/release/inferscale carried.
set -uo pipefail
. scripts/gpu_vllm_common.sh
MEM=/tmp/smem
rm -rf "$MEM"
cat /tmp/gguf/* > /tmp/smollm2.gguf
$BIN export-hf --model /tmp/smollm2.gguf --out /tmp/smollm2-hf || exit 1

start_worker "$OUT/smol-worker.log" 400 --listen 127.0.0.1:50052 --memory "$MEM" --backend cuda \
  --model /tmp/smollm2.gguf --vllm-model /tmp/smollm2-hf --vllm-port 8001 --embedder random --window 0 \
  --kv-cache-mb 512 --vllm-arg=--gpu-memory-utilization=0.3 --vllm-arg=--max-model-len=4096
$BIN router --worker 127.0.0.1:50052 --listen 127.0.0.1:8081 > "$OUT/smol-router.log" 2>&1 &
ROUTER=$!
sleep 3
curl -s localhost:8081/v1/memories -d '{"user": "ana", "window": 0, "turns": [
  {"id": "D1:1", "speaker": "Ana", "time": "1 May 2023", "text": "I adopted a grey cat called Pixel last spring."},
  {"id": "D1:2", "speaker": "Ana", "time": "1 May 2023", "text": "My sister Lena lives in Porto and teaches piano."},
  {"id": "D1:3", "speaker": "Ana", "time": "2 May 2023", "text": "I am training for the Lisbon half marathon in October."},
  {"id": "D1:4", "speaker": "Ana", "time": "2 May 2023", "text": "Coffee makes me jittery, so I drink green tea."}]}' \
  > "$OUT/smol-ingest.json"
cat "$OUT/smol-ingest.json"; echo
python3 - "$OUT/smol-answers.json" <<'EOF'
import json, sys, urllib.request
def chat(user, q, mode, k=4):
    body = {"model": "smollm2", "user": user, "max_tokens": 32, "temperature": 0,
            "messages": [{"role": "user", "content": q}], "memory": {"mode": mode, "k": k}}
    req = urllib.request.Request("http://127.0.0.1:8081/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        r = json.load(urllib.request.urlopen(req, timeout=120))
    except urllib.error.HTTPError as e:
        return {"error": e.read().decode()}
    return {"text": r["choices"][0]["message"]["content"], "usage": r.get("usage")}
out = []
for user, q in [("bob", "What is the capital of France?"), ("bob", "Write one sentence about the sea."),
                ("ana", "Where does my sister live?"), ("ana", "What is my cat called?"),
                ("ana", "What do I drink instead of coffee?")]:
    row = {"user": user, "question": q, "kv": chat(user, q, "kv"), "prompt": chat(user, q, "prompt")}
    row["same_text"] = row["kv"].get("text") == row["prompt"].get("text")
    out.append(row)
    print(json.dumps(row))
json.dump(out, open(sys.argv[1], "w"), indent=1)
EOF
grep -E "inferscale: |refused|recomput" "$OUT/smol-worker.log" | head -20
stop_worker $ROUTER $WORKER

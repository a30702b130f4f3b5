#!/usr/bin/env bash
# The two-GPU run (docs/cluster.md, docs/performance.md): etcd, a router and
# one worker per GPU on one host, Llama-3.1-8B shape with random weights.
#
#   1. Scaling: `inferscale loadtest` (kv, k = 50, 32 output tokens,
#      closed-loop users 100 and 200) with worker w0 alone, then again once
#      w1 has joined and the leader has moved its share of users to it.
#   2. A move over NCCL under load: a user with a shard of ≥ 1 GB (40 facts
#      of ~110 bytes — one token a byte with the shapes' byte-level
#      tokenizer — at ~262 KB of f32 pre-RoPE KV per token) is asked a
#      question greedily; 50 users load the cluster while its home worker is
#      drained (`inferscale cluster drain`), so its shard and the others
#      there move to the other GPU; the user is asked again. The answers
#      must be equal and the load must see no error.
#   3. `inferscale bench nccl --peer 1`: NCCL send/recv and a peer copy
#      between the two GPUs, the yardstick for the move's rate.
#
# With one GPU this is a dry run of the same steps: both workers share
# GPU 0, each with its own NCCL_HOSTID (NCCL refuses two ranks on one
# device of one host, so they are linked as two hosts over its socket
# transport; INFERSCALE_GPU_ID gives them distinct device ids so that the
# leader picks NCCL), and step 3 is skipped. The numbers then mean nothing.
# SKIP_SCALING=1 leaves out step 1's load tests.
#
# Usage: [DURATION_S=20] [LOAD_S=120] [KV_MB=40000] [SKIP_SCALING=1] gpu_two_workers.sh BIN ETCD_BIN OUTDIR
set -uo pipefail
bin=$(realpath "$1") etcd=$(realpath "$2") out=$3
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
gpus=$(nvidia-smi -L | wc -l)
tmp=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT
say() { echo "== $*" | tee -a "$out/steps.txt"; }

"$etcd" --data-dir "$tmp/etcd" --listen-client-urls http://127.0.0.1:2379 \
  --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 >"$out/etcd.log" 2>&1 &
pids+=($!)
export INFERSCALE_ETCD=127.0.0.1:2379 INFERSCALE_HOST_ID=two-worker-host
url=http://127.0.0.1:8080

start_worker() {
  local i=$1 dev=0 extra=()
  if [ "$gpus" -gt 1 ]; then dev=$i
  else extra=(env NCCL_HOSTID="w$i" NCCL_SOCKET_IFNAME=lo INFERSCALE_GPU_ID="dry-run-gpu-$i"); fi
  "${extra[@]}" "$bin" worker --name "w$i" --listen "127.0.0.1:5007$i" --http-listen "127.0.0.1:909$i" \
    --memory "$tmp/w$i" --backend cuda --device "$dev" --shape llama3.1-8b --random-weights --embedder random \
    --window 0 --kv-cache-mb "${KV_MB:-40000}" --max-batch-tokens 2048 --max-running 256 --max-queue 1024 \
    >"$out/w$i.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 300); do grep -q "gRPC on" "$out/w$i.log" && return 0; sleep 1; done
  say "w$i did not start"; exit 1
}

# Waits until every worker is active and no placement record is left.
settled() {
  for _ in $(seq 1 600); do
    "$bin" cluster status --json >"$tmp/status.json" 2>/dev/null && python3 - "$tmp/status.json" "$1" <<'EOF' && return 0
import json, sys
s = json.load(open(sys.argv[1]))
active = [w for w in s["workers"] if w["state"] == "active"]
sys.exit(0 if len(active) == int(sys.argv[2]) and not s["placement_records"] else 1)
EOF
    sleep 1
  done
  say "the cluster did not settle"; exit 1
}

ask() {  # user, file: a greedy answer and the worker that gave it
  curl -s -D "$2.headers" "$url/v1/chat/completions" -H 'content-type: application/json' -d "{
    \"model\": \"llama3.1-8b\", \"user\": \"$1\", \"temperature\": 0, \"max_tokens\": 16,
    \"messages\": [{\"role\": \"user\", \"content\": \"What is the seventh fact?\"}],
    \"memory\": {\"mode\": \"kv\", \"k\": 40}}" >"$2"
  python3 -c 'import json,sys; print(repr(json.load(open(sys.argv[1]))["choices"][0]["message"]["content"]))' "$2"
}

loadtest() {  # name, users, seconds per point
  "$bin" loadtest --url "$url" --users "$2" --k 50 --modes kv --max-tokens 32 --ignore-eos \
    --synthetic-facts 50 --memories 10 --requests 1000000 --duration-s "$3" \
    --machine "$(cat "$out/gpu.txt")" --json "$out/$1.json" 2>&1 | tee "$out/$1.txt"
}

say "1. scaling: one worker"
start_worker 0
"$bin" router --listen 127.0.0.1:8080 --replicas 0 --deadline-s 600 >"$out/router.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 120); do curl -sf "$url/readyz" >/dev/null && break; sleep 1; done
settled 1
[ -n "${SKIP_SCALING:-}" ] || loadtest one-worker 100,200 "${DURATION_S:-20}"

say "1. scaling: w1 joins"
t=$(date +%s)
start_worker 1
settled 2
say "w1 active, its users moved in $(( $(date +%s) - t )) s"
"$bin" cluster status | tee -a "$out/steps.txt"
[ -n "${SKIP_SCALING:-}" ] || loadtest two-workers 100,200 "${DURATION_S:-20}"

say "2. a ≥ 1 GB shard moves over NCCL under load"
python3 - "$tmp/big.json" <<'EOF'
import json, sys
facts = [{"id": f"F{i}", "speaker": "U", "time": "",
          "text": f"Fact {i}: the {i}th entry of the long ledger records item " + "x" * 70 + f" number {i}."}
         for i in range(40)]
json.dump({"user": "big", "window": 0, "turns": facts}, open(sys.argv[1], "w"))
EOF
curl -s "$url/v1/memories" -H 'content-type: application/json' -d @"$tmp/big.json" | tee -a "$out/steps.txt"; echo
before=$(ask big "$out/big-before.json")
home=$(grep -i '^x-inferscale-worker:' "$out/big-before.json.headers" | tr -d '\r' | awk '{print $2}')
say "big at $home answers $before"
loadtest during-move 50 "${LOAD_S:-120}" >/dev/null &
load=$!
sleep 15
t=$(date +%s)
"$bin" cluster drain "$home" --wait-s 400 2>&1 | tee -a "$out/steps.txt"
say "drained $home in $(( $(date +%s) - t )) s"
wait "$load"
after=$(ask big "$out/big-after.json")
moved_to=$(grep -i '^x-inferscale-worker:' "$out/big-after.json.headers" | tr -d '\r' | awk '{print $2}')
say "big at $moved_to answers $after"
grep "moved \"big\"" "$out/router.log" | tee -a "$out/steps.txt"
python3 - "$out/during-move.json" <<'EOF' | tee -a "$out/steps.txt"
import json, sys
r = json.load(open(sys.argv[1]))
for p in r["points"]:
    print(f"load during the move: {p['users']} users, {p['requests']} requests, {p['errors']} errors")
EOF
if [ "$before" = "$after" ] && [ "$home" != "$moved_to" ]; then say "PASS: same answer before and after the move"
else say "FAIL: the answers or homes differ"; fi

if [ "$gpus" -gt 1 ]; then
  say "3. the GPU-to-GPU yardstick"
  kill "${pids[@]}" 2>/dev/null; wait
  pids=()
  "$bin" bench nccl --device 0 --peer 1 --mib 1024 --json "$out/nccl-pair.json" | tee -a "$out/steps.txt"
fi

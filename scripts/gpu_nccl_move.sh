#!/usr/bin/env bash
# A shard move over an NCCL link between two `inferscale worker` processes
# (docs/cluster.md, docs/performance.md), next to the same move over gRPC.
# Llama-3.1-8B shape, random weights: FACTS facts of ~126 tokens carry
# ~33 MB of pre-RoPE KV each (f32 on the wire), so the default 40 is ~1.3 GB.
#
# With two GPUs each worker gets one, and NCCL takes its intra-node path
# (NVLink / P2P). With one GPU both workers share it: NCCL refuses two
# ranks on one device of one host, so each worker is given its own
# NCCL_HOSTID and NCCL links them as two hosts over its socket transport —
# the same code path end to end, at loopback socket speed. The workers share
# INFERSCALE_HOST_ID either way, which is what makes the router's planner
# choose NCCL; here the bench asks for it directly.
# Usage: [FACTS=40] [REPEAT=3] gpu_nccl_move.sh BIN OUTDIR
set -uo pipefail
bin=$1 out=$2
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
gpus=$(nvidia-smi -L | wc -l)
export INFERSCALE_HOST_ID=bench-host
pids=()
for i in 0 1; do
  dev=$(( gpus > 1 ? i : 0 ))
  extra=()
  [ "$gpus" -gt 1 ] || extra=(env NCCL_HOSTID="bench-worker-$i" NCCL_SOCKET_IFNAME=lo)
  mem=$(mktemp -d)
  "${extra[@]}" "$bin" worker --listen "127.0.0.1:5006$i" --memory "$mem" \
    --backend cuda --device "$dev" --shape llama3.1-8b --random-weights --embedder random --window 0 \
    --kv-cache-mb 8000 >"$out/worker-$i.log" 2>&1 &
  pids+=($!)
done
for i in 0 1; do
  for _ in $(seq 1 300); do
    grep -q "gRPC on" "$out/worker-$i.log" && break
    sleep 1
  done
done
# The model flags only label the report: the workers above are what run.
common=(--peers 127.0.0.1:50060,127.0.0.1:50061 --facts "${FACTS:-40}" --repeat "${REPEAT:-3}"
  --backend cuda --shape llama3.1-8b --random-weights)
NCCL_DEBUG=${NCCL_DEBUG:-WARN} "$bin" bench migrate "${common[@]}" --nccl --json "$out/migrate-nccl.json" \
  2>&1 | tee "$out/migrate-nccl.txt"
"$bin" bench migrate "${common[@]}" --json "$out/migrate-grpc.json" 2>&1 | tee "$out/migrate-grpc.txt"
kill "${pids[@]}"
wait

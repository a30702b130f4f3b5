#!/usr/bin/env bash
# `inferscale bench store` on one GPU node (docs/performance.md, "The tiered
# KV store"): the Llama-3.1-8B shape with random weights, every segment
# format, first through the page cache, then (root) with it dropped before
# the memory is reopened, so that misses read the disk.
# Usage: gpu_store.sh BIN OUTDIR [USERS FACTS]   (default 4 users × 100 facts)
set -uo pipefail
bin=$1 out=$2 users=${3:-4} facts=${4:-100}
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
dir=${STORE_DIR:-/tmp/inferscale-store}
df -h "$(dirname "$dir")" | tail -1 | tee "$out/disk.txt"
for drop in "" --drop-caches; do
  rm -rf "$dir"
  "$bin" bench store --backend cuda --shape llama3.1-8b --random-weights --users "$users" --facts "$facts" --k 20 \
    --kv-cache-mb 16384 --max-batch-tokens 8192 --dir "$dir" $drop --json "$out/store${drop:+-cold}.json" 2>&1 |
    grep -v "^inferscale: CUDA device"
done
rm -rf "$dir"

#!/usr/bin/env bash
# Profiling runs on a GPU node (device time per op, see crates/cuda/src/profile.rs):
# kv and prompt mode at k=50 on the Llama-3.1-8B shape. Usage: gpu_profile.sh BIN OUTDIR
set -uo pipefail
bin=$1 out=$2
source "$(dirname "$0")/gpu_env.sh"
common=(--backend cuda --shape llama3.1-8b --random-weights --kv-cache-mb 16384 --max-batch-tokens 8192)
for mode in kv prompt; do
  INFERSCALE_CUDA_PROFILE=1 "$bin" bench ttft "${common[@]}" --modes "$mode" --k 50 --reps 50 \
    >"$out/profile-$mode.txt" 2>&1
  grep -A40 "bench ttft: k=50" "$out/profile-$mode.txt" | grep -v "^inferscale bench ttft: k"
done

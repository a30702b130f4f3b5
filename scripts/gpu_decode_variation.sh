#!/usr/bin/env bash
# Why a decode step of 8–32 rows takes 9–20 ms in one build, by what the
# process ran before it (docs/performance.md, "Decode steps of few rows",
# the open question): the same 8B-shape decode after 16- and 1,000-token
# prefill benchmarks, at --max-batch-tokens 1024 and 8192, each run with
# the GEMM tuner's log (what each row bucket chose, and how fast every
# candidate timed), then 8 rows alone with per-op device time (op by op, so
# the profile sees each kernel); finally the per-kernel profile (ncu) of a
# Qwen step of 8 rows.
#
# About nine minutes on an H100 (eight 8B processes, then ncu): one device
# call at its ten-minute limit, or two.
#
#   gpu_decode_variation.sh BIN OUT
set -uo pipefail
bin=$1 out=$2
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
e=(--backend cuda --shape llama3.1-8b --random-weights --kv-cache-mb 40000 --gemm-n 512
  --decode-prompt-tokens 1550 --decode-tokens 32 --reps 3)
for prefill in 16 1000; do
  for mbt in 1024 8192; do
    name=8b-p$prefill-mbt$mbt
    INFERSCALE_CUDA_GEMM_LOG=1 "$bin" bench engine "${e[@]}" --decode-batch 1,8,32 --prompt-tokens $prefill \
      --max-batch-tokens $mbt --json "$out/$name.json" >"$out/$name.txt" 2>&1
    # The profile covers the whole process: one batch size, op by op.
    INFERSCALE_CUDA_PROFILE=1 "$bin" bench engine "${e[@]}" --decode-batch 8 --prompt-tokens $prefill \
      --max-batch-tokens $mbt --cuda-graphs off --json "$out/$name-profile.json" >"$out/$name-profile.txt" 2>&1
    echo "== $name"; grep -E "^decode" "$out/$name.txt" "$out/$name-profile.txt"
  done
done
BATCH=8 bash "$(dirname "$0")/gpu_decode_kernels.sh" "$bin" "$out" | head -20

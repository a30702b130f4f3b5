#!/usr/bin/env bash
# The CUDA numbers of docs/performance.md on one GPU node, in one go:
# `inferscale check`, `bench inject` (the injection kernel next to device and
# host copies), then `bench ttft` on every random-weight shape (modes
# prompt, kv and kv-host: the stored KV in the host tier) next to the HF
# transformers peer (scripts/peer/hf_ttft.py) for the same layout.
# Usage: gpu_bench.sh BIN OUTDIR [SHAPES…]   (default: all four shapes)
# Env: SKIP_HF=1 leaves the peer out (its numbers move little between builds).
set -uo pipefail
bin=$1 out=$2
shift 2
shapes=("${@:-llama3.1-8b mistral-7b qwen2.5-7b smollm2-135m}")
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
"$bin" check --json "$out/check.json" >"$out/check.txt" 2>&1 || { tail -20 "$out/check.txt"; exit 1; }
tail -1 "$out/check.txt"
"$bin" bench inject --facts 5,10,20,50,100,200 --json "$out/inject.json" 2>&1 | grep -v "^inferscale: CUDA device"
for shape in ${shapes[*]}; do
  "$bin" bench ttft --backend cuda --shape "$shape" --random-weights --k 5,10,20,50,100,200 \
    --modes prompt,kv,kv-host --kv-cache-mb 16384 --max-batch-tokens 8192 --json "$out/ttft-$shape.json" 2>&1 |
    grep -v "^inferscale bench ttft: k="
  [ "${SKIP_HF:-0}" = 1 ] && continue
  PYTHONUNBUFFERED=1 python3 "$(dirname "$0")/peer/hf_ttft.py" --shape "$shape" --json "$out/hf-$shape.json" 2>&1 |
    grep -v "^hf prompt\|deprecated"
done

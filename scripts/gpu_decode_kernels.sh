#!/usr/bin/env bash
# Where a batch-1 decode step's device time goes, kernel by kernel: ncu
# (device time and DRAM bytes of each kernel, measured one at a time with
# caches flushed — longer than in a running step, but comparable between
# kernels) over ~520 kernels (two steps) of `bench engine` decode of the
# Qwen2.5-1.5B shape at a 1,550-token context, op by op, BATCH sequences
# (default 1); then scripts/peer/ncu_kernels.py's table.
#
#   [BATCH=8] gpu_decode_kernels.sh BIN OUT [NAME]
set -uo pipefail
batch=${BATCH:-1}
bin=$1 out=$2 name=${3:-qwen-m$batch}
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "gpu_decode_kernels.sh: no ncu on this machine" >&2; exit 1; }
# Skipping 40,000 launches passes start-up, GEMM tuning, the prefills and
# the untimed warm-up pass (a step of this shape is ~260 kernels; 512 steps
# follow).
"$ncu" --clock-control none --launch-skip 40000 --launch-count 520 --csv --page raw \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size \
  "$bin" bench engine --backend cuda --shape qwen2.5-1.5b --random-weights --kv-cache-mb 8000 --max-batch-tokens 8192 \
  --gemm-n 512 --prompt-tokens 16 --decode-batch "$batch" --decode-prompt-tokens 1550 --decode-tokens 512 --reps 1 \
  --cuda-graphs off >"$out/ncu-$name.csv" 2>"$out/ncu-$name.err"
python3 "$(dirname "$0")/peer/ncu_kernels.py" "$out/ncu-$name.csv" | tee "$out/ncu-$name.txt"

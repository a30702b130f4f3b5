#!/usr/bin/env bash
# The fp8 layout's device checks without the 1.1 GB Qwen model (its LoCoMo
# run is scripts/gpu_qwen.sh fp8-eval): `inferscale check` on random shapes
# (the fp8 injection kernel — key offsets included — bit for bit against the
# host's decode, in both tiers) and with SmolLM2-135M (E1–E4, greedy against
# the CPU, and the stored-format gate through the CUDA fp8 upload), then
# `bench store` for bf16 and fp8 segments (what fp8 reads cost).
#
#   gpu_fp8_check.sh stash DIR…   copy carried pieces out of the checkout (one call each)
#   gpu_fp8_check.sh run BIN OUT  assemble the GGUF and run the checks
#
# The pieces: the packaged SmolLM2 GGUF split in two (`split -b 50000000`,
# `inferscale fetch smollm2` names it), one per transfer; BIN carried last.
set -uo pipefail
stage=/tmp/fp8-stage
case "${1:-}" in
stash)
  shift
  mkdir -p "$stage"
  for d in "$@"; do cp -r "$d"/. "$stage"/; done
  ls -la "$stage"
  ;;
run)
  bin=$2 out=$3
  source "$(dirname "$0")/gpu_env.sh"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
  cat "$stage"/smollm2.part-* > /tmp/smollm2.gguf
  [ "$(sha256sum /tmp/smollm2.gguf | cut -d' ' -f1)" = "$(cat "$stage/smollm2.sha256")" ] || { echo "checksum mismatch" >&2; exit 1; }
  "$bin" check --model /tmp/smollm2.gguf --golden tests/golden/smollm2.json --json "$out/check-smollm2.json" \
    > "$out/check-smollm2.txt" 2>&1
  echo "check: exit $?"
  grep -i "fp8\|FAILED\|stored KV\|all prompts" "$out/check-smollm2.txt"
  tail -n 2 "$out/check-smollm2.txt"
  rm -rf /tmp/store-bench
  "$bin" bench store --backend cuda --shape llama3.1-8b --random-weights --users 2 --facts 40 --k 20 \
    --formats bf16,fp8 --kv-cache-mb 16384 --max-batch-tokens 8192 --dir /tmp/store-bench \
    --json "$out/store-fp8.json" 2>&1 | grep -v "^inferscale: CUDA device" | tail -n 12 | tee "$out/store-fp8.txt"
  ;;
*)
  sed -n '2,14p' "$0"
  exit 2
  ;;
esac

#!/usr/bin/env bash
# Qwen2.5-Coder-1.5B-Instruct on a GPU node with no network: stash the pieces
# scripts/gpu_qwen_prepare.sh made (one device call each, back to back),
# assemble and verify them, then measure. Results go to OUT.
#
#   gpu_qwen.sh stash DIR…        copy carried pieces out of the checkout
#   gpu_qwen.sh assemble          GGUF, MiniLM and binary into /tmp/qwen, checksums verified
#   gpu_qwen.sh check OUT         inferscale check with the model and its golden (E1–E4 on the device too)
#   gpu_qwen.sh eval OUT          LoCoMo dev split, kv/prompt/none × k 5,20,50 × windows 0,20, started
#                                 in its own session (it outlives the call); `gpu_qwen.sh collect OUT`
#                                 waits for it and copies its report
#   gpu_qwen.sh instruction OUT TEXT   kv and prompt at k = 20, w = 20 with another answer instruction
#   gpu_qwen.sh leak OUT VARIANT… kv and prompt at k = 20, w = 20 for each VARIANT (extra eval flags,
#                                 e.g. "--memory-turn user"; "" = defaults), an ingest each; reports
#                                 with every answer and the share copying the facts' labels
#   gpu_qwen.sh bench OUT         bench ttft and bench serve (1 and 100 clients, k = 50)
#   gpu_qwen.sh blend-eval        LoCoMo dev split for kv+blend: kv, blend at r 0.05/0.1/0.15/0.3 and
#                                 prompt × k 20,50 × windows 0,20, started like `eval` (`collect` waits)
#   gpu_qwen.sh blend-focus       kv, blend at r 0.15/0.3 with focus 0/0.5/1 (the share of recomputed
#                                 tokens that are the best facts' last tokens) and prompt, k 20,50 ×
#                                 windows 0,20, started like `eval` (`collect` waits)
#   gpu_qwen.sh blend-bench OUT   inferscale check (random shapes, blend path included), then bench ttft
#                                 prompt/kv/blend at each r: the Llama-3.1-8B shape and Qwen
#   gpu_qwen.sh select-bench OUT  inferscale check (random shapes: the device's attention mass against the
#                                 host's), then bench ttft kv/prompt/blend r 0.15 ranked by deviation and by
#                                 the question, the Llama-3.1-8B shape and Qwen
#   gpu_qwen.sh audit-bench OUT   bench serve, Qwen, kv k = 50 at 100 clients, --audit-shares 0,0.01 in turn, 4 rounds
#   gpu_qwen.sh blend-select      LoCoMo dev split for the blend selections: kv, prompt and blend at
#                                 r 0.15/0.3 ranked by deviation, question and fact starts, k 20,50, window 20
#                                 ($SELECT_WINDOWS overrides), started like `eval` (`collect` waits)
#   gpu_qwen.sh fp8-eval          the fp8-fidelity measurement: bf16 vs fp8 segments, kv and prompt, k 20,50,
#                                 window 20, by this build and — when its binary was stashed as
#                                 inferscale-before — by the build before it, one after the other, started
#                                 like `eval`; `gpu_qwen.sh fp8-collect OUT` waits and copies both reports
set -euo pipefail
cd "$(dirname "$0")/.."
stage=/tmp/qwen-stage
work=/tmp/qwen
bin=$work/inferscale
eval_common=(--backend cuda --model "$work/qwen.gguf" --embedder "$work/minilm" --data "$work/locomo-dev.json"
  --kv-cache-mb 40000 --max-batch-tokens 8192)

sum_ok() { [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$(cat "$2")" ] || { echo "checksum mismatch: $1" >&2; exit 1; }; }

case "${1:-}" in
stash)
  shift
  mkdir -p "$stage"
  for d in "$@"; do cp -r "$d"/. "$stage"/; done
  ls "$stage" | wc -l
  ;;
assemble)
  mkdir -p "$work/minilm"
  cat "$stage"/part??.bin > "$work/qwen.gguf"
  sum_ok "$work/qwen.gguf" "$stage/gguf.sha256"
  tar -C "$work/minilm" -xf "$stage/minilm-small.tar"
  cat "$stage"/minilm.part-? > "$work/minilm/model.safetensors"
  sum_ok "$work/minilm/model.safetensors" "$stage/minilm.sha256"
  cp "$stage/inferscale" "$stage/locomo-dev.json" "$work/"
  if [ -f "$stage/inferscale-before" ]; then cp "$stage/inferscale-before" "$work/" && chmod +x "$work/inferscale-before"; fi
  chmod +x "$bin"
  rm -rf "$stage"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "assembled: $(ls -la "$work")"
  ;;
check)
  source scripts/gpu_env.sh
  "$bin" check --model "$work/qwen.gguf" --golden tests/golden/qwen2.5-coder-1.5b.json --json "$2/check-qwen.json" \
    2>&1 | tee "$2/check-qwen.txt"
  ;;
eval)
  source scripts/gpu_env.sh
  mkdir -p "$work/eval"
  setsid nohup "$bin" eval locomo "${eval_common[@]}" --modes kv,prompt,none --k 5,20,50 --window 0,20 \
    --batch 32 --ttft-questions 10 --out "$work/eval" > "$work/eval.log" 2>&1 < /dev/null &
  echo "eval started (pid $!)"
  ;;
collect)
  while pgrep -f "inferscale eval locomo" > /dev/null; do sleep 5; done
  tr '\r' '\n' < "$work/eval.log" | grep -v "question [0-9]*/" | tail -n 40
  cp "$work/eval/locomo.json" "$work/eval/locomo.md" "$work/eval/locomo.png" "$2/" 2>/dev/null || true
  tr '\r' '\n' < "$work/eval.log" | grep -v "question [0-9]*/" > "$2/eval.log"
  ;;
leak)
  # Each VARIANT is extra `eval locomo` flags (one string, shell-quoted),
  # with an ingest of its own: the memory turn and system prompt change
  # the KV. "" is the defaults.
  source scripts/gpu_env.sh
  out=$2; shift 2
  i=0
  for variant in "$@"; do
    mkdir -p "$work/leak-$i"
    echo "== variant $i: ${variant:-defaults}"
    eval "\"\$bin\" eval locomo \"\${eval_common[@]}\" --modes kv,prompt --k 20 --window 20 --batch 32 \
      --ttft-questions 0 --out \"\$work/leak-\$i\" $variant" 2>&1 | tr '\r' '\n' | grep -v "question [0-9]*/\|ingest conv" | tail -n 6
    cp "$work/leak-$i/locomo.json" "$out/leak-$i.json"
    i=$((i + 1))
  done
  ;;
instruction)
  source scripts/gpu_env.sh
  out=$work/instr-$(echo "$3" | sha256sum | cut -c1-8)
  mkdir -p "$out"
  ln -sfn "$work/eval/memory-w20" "$out/memory-w20"
  "$bin" eval locomo "${eval_common[@]}" --modes kv,prompt --k 20 --window 20 --batch 32 --ttft-questions 0 \
    --instruction "$3" --out "$out" 2>&1 | tr '\r' '\n' | grep -v "question [0-9]*/" | tail -n 8
  cp "$out/locomo.md" "$2/instruction-$(basename "$out").md"
  ;;
blend-eval)
  source scripts/gpu_env.sh
  mkdir -p "$work/eval"
  setsid nohup "$bin" eval locomo "${eval_common[@]}" --modes kv,blend,prompt --blend-ratio 0.05,0.1,0.15,0.3 \
    --k 20,50 --window 0,20 --batch 32 --ttft-questions 10 --out "$work/eval" > "$work/eval.log" 2>&1 < /dev/null &
  echo "eval started (pid $!)"
  ;;
blend-focus)
  source scripts/gpu_env.sh
  mkdir -p "$work/eval"
  setsid nohup "$bin" eval locomo "${eval_common[@]}" --modes kv,blend,prompt --blend-ratio 0.15,0.3 \
    --blend-focus 0,0.5,1 --k 20,50 --window 0,20 --batch 32 --ttft-questions 0 --out "$work/eval" \
    > "$work/eval.log" 2>&1 < /dev/null &
  echo "eval started (pid $!)"
  ;;
fp8-eval)
  source scripts/gpu_env.sh
  runs=()
  [ -x "$work/inferscale-before" ] && runs+=(before)
  runs+=(after)
  {
    for r in "${runs[@]}"; do
      b=$bin grid=(--modes kv,prompt --k 20,50 --kv-format bf16,fp8)
      # The build before only needs its fp8 kv rows: its bf16 and prompt paths are this build's.
      [ "$r" = before ] && b=$work/inferscale-before grid=(--modes kv --k 20,50 --kv-format fp8)
      printf '%q ' "$b" eval locomo "${eval_common[@]}" "${grid[@]}" --window 20 \
        --batch 32 --ttft-questions 0 --out "$work/fp8-$r"
      printf '> %q 2>&1 < /dev/null\n' "$work/fp8-$r.log"
    done
  } > "$work/fp8.sh"
  setsid nohup bash "$work/fp8.sh" > /dev/null 2>&1 < /dev/null &
  echo "fp8 eval started: ${runs[*]}"
  ;;
fp8-collect)
  while pgrep -f "$work/fp8.sh" > /dev/null; do sleep 5; done
  for r in before after; do
    [ -f "$work/fp8-$r/locomo.md" ] || continue
    cp "$work/fp8-$r/locomo.json" "$2/fp8-$r.json"
    cp "$work/fp8-$r/locomo.md" "$2/fp8-$r.md"
    tr '\r' '\n' < "$work/fp8-$r.log" | grep -v "question [0-9]*/\|ingest, window" | tail -n 30
    cat "$2/fp8-$r.md"
  done
  ;;
select-bench)
  source scripts/gpu_env.sh
  "$bin" check --json "$2/check.json" > "$2/check.txt" 2>&1 || { tail -20 "$2/check.txt"; exit 1; }
  grep -i "blend\|attention_mass" "$2/check.txt"; tail -1 "$2/check.txt"
  ttft=(--modes prompt,kv,blend --blend-ratio 0.15,0.3 --kv-cache-mb 16384 --max-batch-tokens 8192 --reps 10)
  for sel in deviation question; do
    "$bin" bench ttft --backend cuda --shape llama3.1-8b --random-weights --k 5,50,200 "${ttft[@]}" --blend-select $sel \
      --json "$2/ttft-$sel-llama3.1-8b.json" 2>&1 | grep -v "^inferscale bench ttft: \(k=\|round\)" | tee "$2/ttft-$sel-8b.txt"
    "$bin" bench ttft --backend cuda --model "$work/qwen.gguf" --k 5,20,50 "${ttft[@]}" --blend-select $sel \
      --json "$2/ttft-$sel-qwen.json" 2>&1 | grep -v "^inferscale bench ttft: \(k=\|round\)" | tee "$2/ttft-$sel-qwen.txt"
  done
  ;;
audit-bench)
  source scripts/gpu_env.sh
  # Both shares on one warm worker, in turn, four rounds: the audit's cost
  # beside the spread between rounds of the same share.
  "$bin" bench serve --backend cuda --model "$work/qwen.gguf" --embedder "$work/minilm" --window 0 \
    --kv-cache-mb 40000 --max-batch-tokens 2048 --max-running 128 --max-queue 512 --audit-shares 0,0.01 \
    --rounds 4 --users 100 --modes kv --k 50 --max-tokens 32 --memory-users 10 --facts-per-user 50 \
    --warmup-s 3 --duration-s 15 --json "$2/serve-audit.json" 2>&1 | tail -n 16 | tee "$2/serve-audit.txt"
  ;;
blend-select)
  source scripts/gpu_env.sh
  mkdir -p "$work/eval"
  setsid nohup "$bin" eval locomo "${eval_common[@]}" --modes kv,blend,prompt --blend-ratio 0.15,0.3 \
    --blend-select deviation,question,fact_starts --k 20,50 --window "${SELECT_WINDOWS:-20}" --batch 32 \
    --ttft-questions 5 --out "$work/eval" > "$work/eval.log" 2>&1 < /dev/null &
  echo "eval started (pid $!)"
  ;;
blend-bench)
  source scripts/gpu_env.sh
  "$bin" check --json "$2/check.json" > "$2/check.txt" 2>&1 || { tail -20 "$2/check.txt"; exit 1; }
  grep -i "blend" "$2/check.txt"; tail -1 "$2/check.txt"
  ttft=(--modes prompt,kv,blend --blend-ratio 0.05,0.1,0.15,0.3 --kv-cache-mb 16384 --max-batch-tokens 8192)
  "$bin" bench ttft --backend cuda --shape llama3.1-8b --random-weights --k 5,20,50,100,200 "${ttft[@]}" \
    --json "$2/ttft-blend-llama3.1-8b.json" 2>&1 | grep -v "^inferscale bench ttft: \(k=\|round\)" | tee "$2/ttft-blend-8b.txt"
  "$bin" bench ttft --backend cuda --model "$work/qwen.gguf" --k 5,20,50,100 "${ttft[@]}" \
    --json "$2/ttft-blend-qwen.json" 2>&1 | grep -v "^inferscale bench ttft: \(k=\|round\)" | tee "$2/ttft-blend-qwen.txt"
  ;;
bench)
  source scripts/gpu_env.sh
  "$bin" bench ttft --backend cuda --model "$work/qwen.gguf" --k 5,10,20,50,100 --json "$2/ttft-qwen.json" \
    2>&1 | grep -v "^inferscale bench ttft: k=" | tee "$2/ttft-qwen.txt"
  "$bin" bench serve --backend cuda --model "$work/qwen.gguf" --embedder "$work/minilm" --window 0 \
    --kv-cache-mb 40000 --max-batch-tokens 2048 --max-running 128 --max-queue 512 \
    --users 1,100 --modes kv,prompt --k 50 --max-tokens 32 --memory-users 10 --facts-per-user 50 \
    --warmup-s 6 --duration-s 20 --json "$2/serve-qwen.json" 2>&1 | tail -n 20 | tee "$2/serve-qwen.txt"
  ;;
*)
  sed -n '2,14p' "$0"
  exit 2
  ;;
esac

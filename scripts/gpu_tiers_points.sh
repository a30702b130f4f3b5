#!/usr/bin/env bash
# Several points of scripts/gpu_tiers.sh in one device call, within a time
# limit, their results in one archive (a device call returns a few files
# only): an ingest, then restarts measured one after the other over the
# same store (which stays on a warm node between calls, so later calls may
# add points without `ingest`).
#
#   [LIMIT=570] [READERS=8] gpu_tiers_points.sh BIN OUT STEP…
#
# STEP is `ingest` (WARM=false: it saves no list of resident facts), or
# NAME:COLD:MODE[:SECONDS[:WARM[:DELAY]]] — a `run` into OUT/NAME with
# COLD_KV=COLD, MODES=MODE, DURATION_S=SECONDS (60), WARM (--kv-warm-restart,
# false) and DELAY_S=DELAY (seconds between the server's readiness and the
# stream, 0), HOT=0. A step that would not fit in what is left of LIMIT is
# skipped and named. OUT gets points.tgz (everything but the server logs)
# and the lines of the server logs that say what the warm-up did.
set -uo pipefail
bin=$1 out=$2; shift 2
limit=${LIMIT:-570}
start=$SECONDS
left() { echo $((limit - (SECONDS - start))); }
work=/tmp/tiers-points
mkdir -p "$out" "$work"
here=$(dirname "$0")
for s in "$@"; do
  if [ "$s" = ingest ]; then
    [ "$(left)" -ge 230 ] || { echo "skipped: ingest ($(left) s left)"; continue; }
    t0=$SECONDS
    WARM=false bash "$here/gpu_tiers.sh" ingest "$bin" "$work/ingest" >"$work/ingest.log" 2>&1
    echo "== ingest: exit $? in $((SECONDS - t0)) s"
    continue
  fi
  IFS=: read -r name cold mode dur warm delay <<<"$s"
  dur=${dur:-60} warm=${warm:-false} delay=${delay:-0}
  [ "$(left)" -ge $((dur + delay + 40)) ] || { echo "skipped: $name ($(left) s left)"; continue; }
  t0=$SECONDS
  WARM=$warm DELAY_S=$delay READERS=${READERS:-8} COLD_KV=$cold MODES=$mode DURATION_S=$dur HOT=0 \
    timeout $(($(left) - 5)) bash "$here/gpu_tiers.sh" run "$bin" "$work/$name" >"$work/$name.log" 2>&1
  echo "== $name ($cold $mode ${dur} s, warm $warm, delay $delay s): exit $? in $((SECONDS - t0)) s"
  grep -E "^\| (kv|prompt) " "$work/$name/tiers.txt" | head -6
  grep -E "saved the|read back" "$work/$name/serve.log" | tail -2
done
for d in "$work"/*/; do
  grep -E "saved the|read back|opened memory" "$d/serve.log" 2>/dev/null | sed "s|^|$(basename "$d"): |"
done >"$out/serve-lines.txt"
tar czf "$out/points.tgz" --exclude=serve.log -C "$work" .
ls -la "$out"

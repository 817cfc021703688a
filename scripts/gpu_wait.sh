#!/usr/bin/env bash
# A device `run` that waits while background work (started under setsid) runs on the lent GPU, and
# returns its logs: every 20 s RES is packed into $OUT/res.tgz without checkpoints, datasets or
# model files (a call cut short still returns the last pack); stops early when RES/FLAG exists.
#   bash scripts/gpu_wait.sh SECONDS [RES] [FLAG]
set -uo pipefail
SECS=${1:?usage: gpu_wait.sh SECONDS [RES] [FLAG]}; RES=${2:-/root/res}; FLAG=${3:-SESSIONDONE}
pack() {
  tar -C "$(dirname "$RES")" -czf "$OUT/res.tgz.tmp" --exclude='ckpt-*' --exclude='data' --exclude='out-*' \
    --exclude='*.safetensors' --exclude='*.parquet' --exclude='tiny-*' --exclude='val-*' "$(basename "$RES")" 2>/dev/null
  mv "$OUT/res.tgz.tmp" "$OUT/res.tgz"
}
end=$(( $(date +%s) + SECS ))
while [ "$(date +%s)" -lt "$end" ]; do
  pack; [ -e "$RES/$FLAG" ] && break; sleep 20
done
pack
cat "$RES"/session.log 2>/dev/null | tail -n 5
for f in "$RES"/trl/*.log "$RES"/verl/*.log "$RES"/*/trl/*.log "$RES"/*/verl/*.log "$RES"/*/verl/async-*.log "$RES"/check.log; do
  [ -f "$f" ] && { echo "== $f"; tail -n 3 "$f" | cut -c1-300; }
done
for f in "$RES"/goal/*.log "$RES"/*/goal/*.log "$RES"/*/*.log "$RES"/speed/*.log "$RES"/j01/*.log "$RES"/dg/*.log "$RES"/aq/*.log "$RES"/*.log; do  # rows (gpu_rows.sh) and logs: last lines
  [ -f "$f" ] && { echo "== $f"; grep -v '^\s*$' "$f" | tail -n 2 | cut -c1-240; }
done
for f in "$RES"/arms-*/*-s[0-9].jsonl "$RES"/*/arms-*/*-s[0-9].jsonl; do  # issue 44's arms: steps logged, held-out results, final check
  [ -f "$f" ] && echo "$(basename "$(dirname "$f")")/$(basename "$f"): $(grep -c '"critic/score/mean"' "$f") steps," \
    "$(cat "${f%.jsonl}.heldout.jsonl" 2>/dev/null | wc -l) held-out, $(grep -o '"equal": [a-z]*' "$f" | tail -n 1)"
done
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader

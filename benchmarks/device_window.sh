#!/usr/bin/env bash
# One device call (one H100 or H200, < 10 min; window.py itself aims at < 4): issue 31's
# sliding-window Musts.
#   bash benchmarks/device_window.sh            (from the repo root; $OUT: where results go)
# window.py checks the windowed op against a float64 band-masked reference, then times forward and
# backward of causal (registry's family, and general forced), window 4096, SDPA with the band mask
# and SDPA causal at 16k and 32k tokens (MHA 16 heads, GQA 32/8). Writes $OUT/window.{json,md,log};
# prints the check lines and any errors, then the table and the Must lines last.
source "$(dirname "$0")/device_setup.sh"
start=$(date +%s)
timeout 500 python3 benchmarks/window.py --json "$OUT/window.json" --out "$OUT/window.md" > "$OUT/window.log" 2>&1
echo "window.py rc=$? in $(( $(date +%s) - start )) s"
if [ -s "$OUT/window.md" ]; then
  grep -E "^check|Error|Traceback|skipped" "$OUT/window.log" | cut -c1-300 | head -12
  cat "$OUT/window.md"
else  # it stopped before the table: the log's end says why
  tail -40 "$OUT/window.log" | cut -c1-300
fi

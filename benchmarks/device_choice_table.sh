#!/usr/bin/env bash
# One device call (one H100 or H200, < 10 min): the never-slower kernel table (issue 28).
#   bash benchmarks/device_choice_table.sh       (from the repo root; $OUT: where results go)
# benchmarks/attention.py --choice: per row the op's chosen family and the site's decision (from the
# shipped choice table, or $FUSE_PLUGIN_CHOICE_TABLE) against every family forced, SDPA's backends
# and (small rows) Inductor: $OUT/choice.{md,json,log}. Prints errors, then the table.
# TUNE=a,b: measure those classes into the shipped table (copied to $OUT) before the table.
source "$(dirname "$0")/device_setup.sh"
if [ -n "${TUNE:-}" ]; then  # classes (comma-separated) measured into the table first
  timeout ${TUNE_LIMIT:-150} python3 -m fuse_plugin.tune --choices --classes "$TUNE" \
    --out fuse_plugin/kernels/attention_choices_sm90.json > "$OUT/tune.log" 2>&1
  echo "tune $TUNE rc=$?"; tail -3 "$OUT/tune.log" | cut -c1-200
  cp fuse_plugin/kernels/attention_choices_sm90.json "$OUT/"
fi
start=$(date +%s)
# ROWS=START:STOP: a slice of the table's rows (the whole table took three calls at stop 28).
# PREPASS=N: N processes compile the rows' kernels in parallel first (attention.py --prepass, spread
# over the machine's GPUs; PREPASS_LIMIT s, default 300), so that the timed pass (one process, one
# GPU) may fit the whole table in one call; not yet run on a GPU.
( cd benchmarks && timeout ${CHOICE_LIMIT:-540} python3 attention.py --choice ${ROWS:+--rows "$ROWS"} \
    ${PREPASS:+--prepass "$PREPASS" --prepass-limit "${PREPASS_LIMIT:-300}"} \
    --out "$OUT/choice${ROWS:+_${ROWS/:/-}}.md" --json "$OUT/choice${ROWS:+_${ROWS/:/-}}.json" > "$OUT/choice.log" 2>&1 )
echo "attention.py --choice rc=$? in $(( $(date +%s) - start )) s"
grep -E "failed|Error|Traceback" "$OUT/choice.log" | cut -c1-200 | head -8
grep "^|" "$OUT/choice.log" | tail -34

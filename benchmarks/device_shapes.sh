#!/usr/bin/env bash
# One device call (one H100 or H200, < 10 min): rows of benchmarks/shapes.py (issue 28 Deliver 5).
#   ROWS=llama-infer-fp32-8x512,llama-train-amp-8x512 bash benchmarks/device_shapes.sh
# A parallel `--rounds 0` pre-pass (one process per row and mode) fills the compile caches, then one
# process times every row (interleaved rounds, as shapes.py does). LAYERS (default 4), ROUNDS
# (default 5), PRE_LIMIT / TIMED_LIMIT (s), VARIANTS (shapes.py's --variants, default its own),
# MODES (default "default,reduce-overhead"). Writes $OUT/shapes.{md,log} (the table after every row);
# prints the table last.
source "$(dirname "$0")/device_setup.sh"
ROWS=${ROWS:?ROWS=row,row,...}
L=${LAYERS:-4}
MODES=${MODES:-default,reduce-overhead}
V=()
[ -n "${VARIANTS:-}" ] && V=(--variants "$VARIANTS")
start=$(date +%s)
for row in ${ROWS//,/ }; do
  for mode in ${MODES//,/ }; do
    ( cd benchmarks && timeout ${PRE_LIMIT:-300} python3 shapes.py --layers $L --rows $row --modes $mode \
        "${V[@]}" --rounds 0 --no-overhead > "$OUT/pre_${row}_$mode.log" 2>&1 ) &
  done
done
wait
echo "pre-pass $(( $(date +%s) - start )) s"
start=$(date +%s)
( cd benchmarks && timeout ${TIMED_LIMIT:-300} python3 shapes.py --layers $L --rows "$ROWS" --rounds ${ROUNDS:-5} \
    --modes "$MODES" "${V[@]}" \
    --no-overhead --out "$OUT/shapes.md" > "$OUT/shapes.log" 2>&1 )
echo "shapes.py rc=$? in $(( $(date +%s) - start )) s"
grep -hE "Traceback|Error" "$OUT"/pre_*.log "$OUT/shapes.log" | cut -c1-200 | head -5
rm -f "$OUT"/pre_*.log
cat "$OUT/shapes.md" 2>/dev/null || tail -30 "$OUT/shapes.log"

#!/usr/bin/env bash
# One device call (< 10 min): rows of benchmarks/shapes.py (issue 28's shapes table).
#   bash benchmarks/device_shapes.sh                 (every row; ROWS=row,row,... for some)
# shapes.py --parallel: a pre-pass compiles every (row, mode, variant) alone (PREPASS at a time,
# default 16, for at most PREPASS_LIMIT s, default 240), then a process per row and mode builds
# from the caches (PARALLEL at once, default 12) and the rows time one at a time (interleaved
# rounds inside each row, as shapes.py does). On a machine of several GPUs the processes are
# spread over them; each row still times alone. LAYERS (default 4), ROUNDS (default 5; a row whose
# rounds would time for < 3 s runs more, up to 25: shapes.py --min-timing-s), DEADLINE
# (s, default 540), VARIANTS (shapes.py's --variants, default its own), MODES (default
# "default,reduce-overhead"). Writes $OUT/shapes.{md,log}; prints the table last.
source "$(dirname "$0")/device_setup.sh"
V=()
[ -n "${VARIANTS:-}" ] && V=(--variants "$VARIANTS")
[ -n "${ROWS:-}" ] && V+=(--rows "$ROWS")
start=$(date +%s)
( cd benchmarks && python3 shapes.py --layers ${LAYERS:-4} --rounds ${ROUNDS:-5} --modes "${MODES:-default,reduce-overhead}" \
    "${V[@]}" --parallel ${PARALLEL:-12} --prepass ${PREPASS:-16} --prepass-limit ${PREPASS_LIMIT:-240} \
    --deadline ${DEADLINE:-540} --no-overhead --out "$OUT/shapes.md" > "$OUT/shapes.log" 2>&1 )
echo "shapes.py rc=$? in $(( $(date +%s) - start )) s"
grep -E "pre-pass:|wave .*built" "$OUT/shapes.log"
grep -hE "Traceback|Error" "$OUT/shapes.log" | cut -c1-200 | head -5
cat "$OUT/shapes.md" 2>/dev/null || tail -30 "$OUT/shapes.log"

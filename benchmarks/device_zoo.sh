#!/usr/bin/env bash
# One device call (one H100 or H200, < 10 min): the timm zoo (issue 28), one mode per call.
#   MODES=default bash benchmarks/device_zoo.sh      (from the repo root; $OUT: where results go)
# MODELS (comma-separated, default all), TASKS, MODES, PARALLEL (default 20), DEADLINE (s, default 530),
# ROUNDS (zoo.py's --rounds, default 5), VARIANTS (zoo.py's --variants), PROFILE (N profiled steps per variant).
# Writes $OUT/zoo_$MODES.{md,json,log}; prints the table last.
source "$(dirname "$0")/device_setup.sh"
M=${MODES:-default}
ARGS=(--modes "$M" --tasks "${TASKS:-infer,train}" --parallel "${PARALLEL:-20}" --deadline "${DEADLINE:-530}")
[ -n "${MODELS:-}" ] && ARGS+=(--models "$MODELS")
[ -n "${ROUNDS:-}" ] && ARGS+=(--rounds "$ROUNDS")
[ -n "${VARIANTS:-}" ] && ARGS+=(--variants "$VARIANTS")  # e.g. compile,fused+compile,plugin-fused
[ -n "${PROFILE:-}" ] && ARGS+=(--profile "$PROFILE")  # N steps profiled per variant (host/GPU time, top kernels)
( cd benchmarks && python3 zoo.py "${ARGS[@]}" --out "$OUT/zoo_$M.md" --json "$OUT/zoo_$M.json" > "$OUT/zoo_$M.log" 2>&1 )
echo "zoo.py rc=$?"
grep -E "Traceback|Error" "$OUT/zoo_$M.log" | cut -c1-200 | head -5
cat "$OUT/zoo_$M.md" 2>/dev/null || tail -30 "$OUT/zoo_$M.log"

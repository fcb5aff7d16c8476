#!/usr/bin/env bash
# One device call (< 10 min): the timm zoo (issue 28).
#   MODES=default bash benchmarks/device_zoo.sh      (from the repo root; $OUT: where results go)
# MODELS (comma-separated, default all), TASKS, MODES, PARALLEL (default 20), DEADLINE (s, default 530),
# PREPASS (N: every (row, variant) compiled alone first, N at a time; PREPASS_LIMIT s, default 240),
# ROUNDS (zoo.py's --rounds, default 5), STEPS (its --steps, default 10), WARM (its --warm-steps, untimed
# steps before each timed run), VARIANTS (zoo.py's --variants),
# PROFILE (N profiled steps per variant).
# On a machine of several GPUs the rows build spread over them and still time one at a time.
# A one-GPU, 16-core machine builds ~16 of default mode's 20 rows in one call (stop 41, H100):
# there, two calls of half the models each (MODELS=vit_s16,deit3_s,eva02_ti,swin_t,beit_b, then the rest).
# Writes $OUT/zoo_<modes>.{md,json,log}; prints the table last.
source "$(dirname "$0")/device_setup.sh"
M=${MODES:-default}
F=${M//,/_}  # no commas or pluses in $OUT's names: the device tool leaves such files behind (stop 54)
ARGS=(--modes "$M" --tasks "${TASKS:-infer,train}" --parallel "${PARALLEL:-20}" --deadline "${DEADLINE:-530}")
[ -n "${MODELS:-}" ] && ARGS+=(--models "$MODELS")
[ -n "${ROUNDS:-}" ] && ARGS+=(--rounds "$ROUNDS")
[ -n "${STEPS:-}" ] && ARGS+=(--steps "$STEPS")  # STEPS=2 ROUNDS=30 times host-bound rows' first steps (stop 54)
[ -n "${WARM:-}" ] && ARGS+=(--warm-steps "$WARM")  # e.g. WARM=3 STEPS=5 ROUNDS=20: short rounds, steady steps
[ -n "${VARIANTS:-}" ] && ARGS+=(--variants "$VARIANTS")  # e.g. compile,fused+compile,plugin-fused
[ -n "${PROFILE:-}" ] && ARGS+=(--profile "$PROFILE")  # N steps profiled per variant (host/GPU time, top kernels)
[ -n "${PREPASS:-}" ] && ARGS+=(--prepass "$PREPASS" --prepass-limit "${PREPASS_LIMIT:-240}")
( cd benchmarks && python3 zoo.py "${ARGS[@]}" --out "$OUT/zoo_$F.md" --json "$OUT/zoo_$F.json" > "$OUT/zoo_$F.log" 2>&1 )
echo "zoo.py rc=$?"
grep -E "pre-pass:|wave .*built" "$OUT/zoo_$F.log"
grep -E "Traceback|Error" "$OUT/zoo_$F.log" | cut -c1-200 | head -5
grep -E "[1-9][0-9]* CUDA-graph skip" "$OUT/zoo_$F.log" | cut -c1-160 | head -10  # a graph run without CUDA graphs
grep -E "\[diff\]" "$OUT/zoo_$F.log" | cut -c1-160 | head -40  # PROFILE: kernels against the fused path's
cat "$OUT/zoo_$F.md" 2>/dev/null || tail -30 "$OUT/zoo_$F.log"

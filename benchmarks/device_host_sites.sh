#!/usr/bin/env bash
# One device call (~2-4 min): host time per attention site, without the profiler (host_sites.py;
# issue 28, NOTES attempt 60).   bash benchmarks/device_host_sites.sh   (from the repo root)
# SITES (default 8,32), TASKS (default infer,train), ROUNDS (default 30), VARIANTS (host_sites.py's),
# TOKENS / KV_TOKENS (host_sites.py's --tokens / --kv-tokens: TOKENS=3136 KV_TOKENS=49 for Twins-SVT's
# global sub-sampled attention), BATCH (--batch).
# Writes $OUT/host_sites.{md,log}; prints the table last.
source "$(dirname "$0")/device_setup.sh"
ARGS=(--sites "${SITES:-8,32}" --tasks "${TASKS:-infer,train}" --rounds "${ROUNDS:-30}")
[ -n "${VARIANTS:-}" ] && ARGS+=(--variants "$VARIANTS")
[ -n "${TOKENS:-}" ] && ARGS+=(--tokens "$TOKENS")
[ -n "${KV_TOKENS:-}" ] && ARGS+=(--kv-tokens "$KV_TOKENS")
[ -n "${BATCH:-}" ] && ARGS+=(--batch "$BATCH")
( cd benchmarks && python3 host_sites.py "${ARGS[@]}" --out "$OUT/host_sites.md" > "$OUT/host_sites.log" 2>&1 )
echo "host_sites.py rc=$?"
grep -E "Traceback|Error" "$OUT/host_sites.log" | cut -c1-200 | head -5
cat "$OUT/host_sites.md" 2>/dev/null || tail -30 "$OUT/host_sites.log"

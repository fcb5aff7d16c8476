#!/usr/bin/env bash
# One device call (~1-3 min): the host's time of one attention call in a compiled graph, per
# implementation (host_cost.py; issue 28, NOTES attempt 66; the source of choice_table.HOST_US).
#   SHAPES=deit3,cait,vit_b bash benchmarks/device_host_cost.sh   (from the repo root)
# SHAPES (host_cost.py's names, default deit3,cait), TASKS (default infer,train), SITES (default 4),
# ROUNDS (default 15). Writes $OUT/host_cost.{md,log}; prints the table last.
source "$(dirname "$0")/device_setup.sh"
( cd benchmarks && python3 host_cost.py --shapes "${SHAPES:-deit3,cait}" --tasks "${TASKS:-infer,train}" \
    --sites "${SITES:-4}" --rounds "${ROUNDS:-15}" --out "$OUT/host_cost.md" > "$OUT/host_cost.log" 2>&1 )
echo "host_cost.py rc=$?"
grep -E "not built|Traceback|Error" "$OUT/host_cost.log" | cut -c1-200 | head -5
cat "$OUT/host_cost.md" 2>/dev/null || tail -30 "$OUT/host_cost.log"

#!/usr/bin/env bash
# Two device calls (one H100, < 10 min each): issue 30's rows outside shapes.py on the current code:
# timm ViT-S / EVA-02 on their fused path under the plugin (zoo.py's plugin-fused, both modes) and
# HF generate on its SDPA path (generate.py's plugin-sdpa, both modes).
#   PART=zoo bash benchmarks/device_sdpa_paths.sh, then PART=generate (from the repo root; $OUT:
#   where results go). Measured stop 31: the zoo's 4 rows ~150 s a mode, generate's 8 rows ~300 s.
# GEN_ROUNDS (default 5), GEN_LIMIT / ZOO_DEADLINE (s). Prints the tables last.
source "$(dirname "$0")/device_setup.sh"
PART=${PART:?PART=zoo or PART=generate}
[ "$PART" = zoo ] && for mode in reduce-overhead default; do
  ( cd benchmarks && python3 zoo.py --modes $mode --models vit_s16,eva02_ti --variants compile,fused+compile,plugin-fused \
      --parallel 4 --deadline ${ZOO_DEADLINE:-260} --out "$OUT/zoo_fused_$mode.md" > "$OUT/zoo_fused_$mode.log" 2>&1 )
  echo "zoo $mode rc=$?"
done
[ "$PART" = generate ] && ( cd benchmarks && timeout ${GEN_LIMIT:-540} python3 generate.py --variants sdpa+compile,plugin-sdpa \
    --modes default,reduce-overhead --parallel --rounds ${GEN_ROUNDS:-5} --out "$OUT/generate_sdpa.md" \
    > "$OUT/generate_sdpa.log" 2>&1 )
[ "$PART" = generate ] && echo "generate rc=$?"
grep -hE "Traceback|Error" "$OUT"/zoo_fused_*.log "$OUT/generate_sdpa.log" | cut -c1-200 | head -5
cat "$OUT"/zoo_fused_*.md "$OUT/generate_sdpa.md" 2>/dev/null

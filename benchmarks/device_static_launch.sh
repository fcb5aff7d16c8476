#!/usr/bin/env bash
# One device call (< 10 min): does kernels/static_launch.py's mend (FUSE_PLUGIN_STATIC_LAUNCH_WORKERS)
# put our kernels on Inductor's static launcher when the compile workers build them, and does the
# host-bound training it cost (twins_svt_s, stop 45) get the time back?
#   bash benchmarks/device_static_launch.sh      (from the repo root; $OUT: where results go)
# 1. tests/static_launch_child.py with the switch off, then on (a fresh process each, pool warm;
#    CHILD_SWITCHES, default "off on").
# 2. The zoo's default-mode training rows MODELS, variants compile, fused+compile, plugin under SWITCH
#    (default STATIC_LAUNCH_WORKERS=on, the default since stop 47: SWITCH=STATIC_LAUNCH_WORKERS=off
#    times the switch off instead). The plain plugin variant is left out on purpose: two
#    variants whose generated code is the same share one module (PyCodeCache keys by its source),
#    so whichever was built first would decide the launcher of both.
# 3. If time is left: benchmarks/host_split.py on twins_svt_s training (compile against the switch),
#    with its cProfile (which launcher each launch went through).
# LIMIT (s, default 560): the call's time; the zoo and host_split fit in what the children leave.
source "$(dirname "$0")/device_setup.sh"
T0=$(date +%s)
SWITCH=${SWITCH:-STATIC_LAUNCH_WORKERS=on}
for sw in ${CHILD_SWITCHES:-off on}; do
  FUSE_PLUGIN_STATIC_LAUNCH_WORKERS=$sw timeout 150 python3 tests/static_launch_child.py > "$OUT/child_$sw.log" 2>&1
  echo "child switch=$sw rc=$? static True: $(grep -c 'static True' "$OUT/child_$sw.log")," \
       "static False: $(grep -c 'static False' "$OUT/child_$sw.log"), $(grep -E '^(recompiled|rel_err|skip)' "$OUT/child_$sw.log" | tr '\n' ' ')"
done
left=$(( ${LIMIT:-560} - ($(date +%s) - T0) ))
MODES=default MODELS=${MODELS:-twins_svt_s,swin_t,cait_xxs24,eva02_ti} TASKS=train STEPS=2 ROUNDS=${ROUNDS:-30} \
  PARALLEL=8 PREPASS=8 PREPASS_LIMIT=$(( left / 2 )) DEADLINE=$(( left - 100 )) \
  VARIANTS="compile,fused+compile,plugin@$SWITCH" bash "$(dirname "$0")/device_zoo.sh"
# the zoo's ratio column reads the plain plugin variant (left out): the switch's ratios from the JSON
( cd "$(dirname "$0")" && python3 - "$OUT/zoo_default.json" "plugin@$SWITCH" <<'PY'
import json, sys
import zoo
for row in json.load(open(sys.argv[1]))["rows"]:
    print(f"{row['model']} {row['task']} {row['mode']}: {sys.argv[2]} over the best of stock:",
          zoo.ratio(row, sys.argv[2]), "paired", zoo.paired_ratio(row, sys.argv[2]))
PY
)
left=$(( ${LIMIT:-560} + 10 - ($(date +%s) - T0) ))
if [ "$left" -gt 150 ]; then
  ( cd benchmarks && timeout $left python3 host_split.py --model twins_svt_s --task train --rounds 10 --steps 2 \
      --variants "compile,plugin@$SWITCH" --cprofile-out "$OUT/cprofile.txt" --build-deadline $(( left - 40 )) \
      > "$OUT/host_split.log" 2>&1 )
  echo "host_split rc=$?"; grep -E "^built" "$OUT/host_split.log" | cut -c1-220; tail -6 "$OUT/host_split.log"
else
  echo "host_split: no time left ($left s)"
fi

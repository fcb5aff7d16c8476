#!/usr/bin/env bash
# One device call (one H100 or H200; about 6 min, at most 10 by the caps below): issue 31's
# sliding-window Musts.
#   bash benchmarks/device_window.sh            (from the repo root; $OUT: where results go)
# 1. window_hang.py (HANG=0 skips): which tiles hang the windowed atomic backward, one process per
#    case with a timeout (NOTES.md attempt 36), so a hang costs 25 s, not the call;
# 2. window.py: the windowed op against a float64 band-masked reference, then forward and backward
#    of causal (registry's family, and general forced), window 4096, SDPA with the band mask and
#    SDPA causal at 16k and 32k tokens (MHA 16 heads, GQA 32/8): $OUT/window.{json,md,log};
#    WINDOW_ARGS: more window.py arguments (e.g. "--layout blhd --head-dim 64 --configs gqa16
#    --gluon-window-head-dims 64,128": e2e.py's model's heads, the Gluon kernels measured at D 64);
# 3. e2e.py --sliding-window 4096 at 1x16384 (E2E=0 skips): HF's sdpa path compiled against the
#    plugin on it and on eager attention, training and inference: $OUT/e2e_window.md;
# 4. with PEERS=1, window_peers.py: the window's cost over r x causal for ours, FlexAttention and
#    cuDNN's own window (through JAX), after the persistent forward's GPU test (its rows only if
#    it passed): $OUT/window_peers.{json,md,log}, persistent_test.log; WINDOW=0 skips 2
#    (PEERS=1 HANG=0 WINDOW=0 E2E=0: the peers alone).
# Prints the hang lines, the check lines and any errors, then the tables last.
source "$(dirname "$0")/device_setup.sh"
if [ "${HANG:-1}" != 0 ]; then
  timeout 150 python3 benchmarks/window_hang.py > "$OUT/window_hang.log" 2>&1
  cat "$OUT/window_hang.log" | cut -c1-200
fi
if [ "${WINDOW:-1}" != 0 ]; then
  start=$(date +%s)
  timeout ${WINDOW_LIMIT:-200} python3 benchmarks/window.py ${WINDOW_ARGS:-} --json "$OUT/window.json" --out "$OUT/window.md" > "$OUT/window.log" 2>&1
  echo "window.py rc=$? in $(( $(date +%s) - start )) s"
fi
if [ "${PEERS:-0}" != 0 ]; then  # 4. window_peers.py: the window against each kernel's own causal
  # the persistent forward's rows only once its test passed, alone, under a timeout (a barrier bug would hang)
  timeout ${PERSIST_LIMIT:-240} python3 -m pytest -q -p no:cacheprovider \
      tests/test_window.py -k persistent > "$OUT/persistent_test.log" 2>&1
  prc=$?
  echo "persistent forward test rc=$prc: $(tail -1 "$OUT/persistent_test.log" | cut -c1-150)"
  impls=ours,flex,cudnn-jax
  [ $prc = 0 ] && impls=$impls,persistent
  timeout ${PEERS_LIMIT:-300} python3 benchmarks/window_peers.py --impls $impls --tile-cost \
      --json "$OUT/window_peers.json" --out "$OUT/window_peers.md" > "$OUT/window_peers.log" 2>&1
  echo "window_peers.py rc=$?"
fi
if [ "${E2E:-1}" != 0 ]; then
  ( cd benchmarks && timeout ${E2E_LIMIT:-220} python3 e2e.py --seq 16384 --batch 1 --sliding-window 4096 \
      --variants sdpa+compile,plugin-sdpa,fuse_plugin --steps 3 --out "$OUT/e2e_window.md" > "$OUT/e2e_window.log" 2>&1 )
  echo "e2e rc=$?"
fi
if [ "${WINDOW:-1}" = 0 ]; then
  :
elif [ -s "$OUT/window.md" ]; then
  grep -E "^check|Error|Traceback|skipped" "$OUT/window.log" | cut -c1-300 | head -12
  cat "$OUT/window.md"
else  # it stopped before the table: the log's end says why
  tail -40 "$OUT/window.log" | cut -c1-300
fi
[ -s "$OUT/e2e_window.md" ] && cat "$OUT/e2e_window.md" || tail -5 "$OUT/e2e_window.log" 2>/dev/null
[ "${PEERS:-0}" != 0 ] && { cat "$OUT/window_peers.md" 2>/dev/null || tail -10 "$OUT/window_peers.log"; }

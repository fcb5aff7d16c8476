#!/usr/bin/env bash
# Every test file with a GPU part, then the GPU check scripts: two device calls (< 10 min each):
#   CHECKS=0 bash benchmarks/device_tests.sh   then   TESTS=0 bash benchmarks/device_tests.sh
# (from the repo root; $OUT: where logs go).
# pytest runs with xdist (-n 12) and a per-test timeout: in series the Triton/Gluon compiles of a
# fresh machine take > 7 min. The check scripts (float64 references, PASS/FAIL rows) run at once, gpu_check a process
# per section. The last lines printed are the summary table.
source "$(dirname "$0")/device_setup.sh"
FILES="tests/test_attention_cudnn.py tests/test_attention_decode.py tests/test_attention_efficient.py tests/test_attention_kernel.py
 tests/test_attention_sinks.py tests/test_attention_small.py tests/test_compiled_gpu.py tests/test_dropout.py
 tests/test_inductor_launch.py tests/test_need_lse.py tests/test_ops.py tests/test_registry.py tests/test_replace_mask.py
 tests/test_rope_attention.py tests/test_rotary_kernel.py tests/test_sdpa_candidate.py tests/test_softcap.py
 tests/test_tune_choices.py tests/test_tuning_table.py tests/test_results_current.py tests/test_window.py
 tests/test_chunk.py tests/test_table_gather.py tests/test_documents.py tests/test_attention_flash.py
 tests/test_cpu_sites.py"
# (test_cpu_sites.py has no GPU part: it checks on the GPU machine's torch that a CPU site left as
# stock compile has it compiles to stock's code, i.e. that its torch copies meta["custom"], stop 57)
# PART=1 / PART=2: the first / second half of the files (a fresh H100 ran the whole list to 97% in
# 540 s at stop 40, so it takes two calls). -v names every result as it comes: a call cut by its
# limit still says which tests failed (-q's summary is printed only at the end).
if [ -n "${PART:-}" ]; then
  set -- $FILES; n=$(( ($# + 1) / 2 ))
  if [ "$PART" = 1 ]; then FILES="${*:1:$n}"; else FILES="${*:$((n + 1))}"; fi
fi
if [ "${TESTS:-1}" != 0 ]; then
  start=$(date +%s)
  timeout ${TEST_LIMIT:-540} python3 -m pytest -v -n ${WORKERS:-12} --timeout 300 -p no:cacheprovider \
    -p no:benchmark --durations 15 $FILES -rfEs > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^(FAILED|ERROR)| (FAILED|ERROR) " "$OUT/pytest.log" | sort -u | head -20
  grep -cE " PASSED " "$OUT/pytest.log" | sed 's/^/passed so far: /'
  grep -E "^SKIPPED" "$OUT/pytest.log" | cut -c1-160 | sort | uniq -c | sort -rn | head -8  # why things skip
  tail -2 "$OUT/pytest.log"
fi
[ "${CHECKS:-1}" = 0 ] && exit 0
run_check() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  timeout ${CHECK_LIMIT:-400} "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/$name.log" | cut -c1-100)"
}
# gpu_check one section per process (its compiles in parallel), the check scripts beside them
i=0
for s in opcheck attention window rotary rope dropout dropout_stats; do
  ( run_check gpu_check_$s python3 benchmarks/gpu_check.py --section $s > "$OUT/c$i.txt" ) &
  i=$((i + 1))
done
for c in replace softcap checkpoint generate; do
  ( run_check gpu_${c}_check python3 tests/gpu_${c}_check.py > "$OUT/c$i.txt" ) &
  i=$((i + 1))
done
wait
cat "$OUT"/c*.txt

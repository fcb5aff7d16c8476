#!/usr/bin/env bash
# One device call: re-measure the learned-bias classes after tune_choices' SDPA forward stopped
# timing tensors that require grad (cuDNN's bias path), then BEiT-B / Swin-T inference rows; the
# test files the GPU run of stop 24 fixed run beside the untimed warm-up.
source "$(dirname "$0")/device_setup.sh"
C=levit-s3,levit-s1,levit-sub,levit-s2,swin-s1,swin-s1-shifted,beit-b
( timeout 150 python3 -m pytest -q -n 8 --timeout 140 -p no:cacheprovider tests/test_inductor_launch.py \
    tests/test_compiled_gpu.py::test_gluon_kernels_under_compile tests/test_attention_sinks.py \
    tests/test_tune_choices.py tests/test_rope_attention.py -rfE > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest.log" ) &
for p in levit-s3,levit-s1 levit-sub,levit-s2 swin-s1,swin-s1-shifted beit-b; do
  timeout 150 python3 -m fuse_plugin.tune --choices --warm --classes $p > "$OUT/warm_${p%%,*}.log" 2>&1 &
done
wait
timeout 170 python3 -m fuse_plugin.tune --choices --classes $C --log "$OUT/choices.jsonl" > "$OUT/choices.log" 2>&1
echo "tune rc=$?"; tail -9 "$OUT/choices.log"
cp fuse_plugin/kernels/attention_choices_sm90.json "$OUT/"
timeout 200 python3 benchmarks/zoo.py --models beit_b,swin_t --tasks infer --modes default --parallel 2 \
  --deadline 190 --json "$OUT/zoo.json" --out "$OUT/zoo.md" > "$OUT/zoo.log" 2>&1
tail -4 "$OUT/zoo.md"; grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/pytest.log" | head

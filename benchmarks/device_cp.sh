#!/usr/bin/env bash
# One device call on a 2-GPU kind (nvidia-h100-x2 / h200-x2; < 10 min by the caps below): issue 32.
#   SEQS="32768" bash benchmarks/device_cp.sh        (from the repo root; $OUT: where results go)
# 1. ring_check.py (CHECK=0 skips): the ring over NCCL against float64, bf16 (PASS/FAIL);
# 2. distributed.py --cp at each length of $SEQS (12 layers, $STEPS steps): ours (ring over our op)
#    vs PyTorch's context_parallel + SDPA, each next to its 1-GPU run: $OUT/cp_<seq>.{md,log}.
# Prints the check, then each run's table (or the end of its log).
source "$(dirname "$0")/device_setup.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/versions.txt"
if [ "${CHECK:-1}" != 0 ]; then
  timeout ${CHECK_LIMIT:-90} python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/ring_check.py \
    > "$OUT/ring_check.log" 2>&1
  echo "ring_check rc=$?"; grep -E "^ring" "$OUT/ring_check.log" | cut -c1-160
fi
for seq in ${SEQS:-32768}; do
  start=$(date +%s)
  timeout ${CP_LIMIT:-400} python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/distributed.py --cp \
    --seq $seq --steps ${STEPS:-10} ${CP_ARGS:-} --out "$OUT/cp_$seq.md" > "$OUT/cp_$seq.log" 2>&1
  echo "cp seq $seq rc=$? in $(( $(date +%s) - start )) s"
  grep -E "PASS|FAIL|OOM|ratio|Error" "$OUT/cp_$seq.log" | grep -v "^\[rank1\]" | cut -c1-200 | head -12
  [ -s "$OUT/cp_$seq.md" ] && cat "$OUT/cp_$seq.md" || tail -25 "$OUT/cp_$seq.log" | cut -c1-300
done

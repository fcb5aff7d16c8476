# Sourced by the benchmarks/device_*.sh scripts (one device call each): strict mode, $OUT, the
# package installed from this tree, the versions printed and kept in $OUT/versions.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
python3 - <<'PY' | tee "$OUT/versions.txt"
import torch, triton, transformers
print(torch.cuda.get_device_name(), torch.__version__, "triton", triton.__version__,
      "cudnn", torch.backends.cudnn.version(), "transformers", transformers.__version__)
PY

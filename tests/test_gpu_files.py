"""The GPU suite's modules (benchmarks/device_tests.sh's FILES) import without expecttest, which
CI installs and the GPU machine does not have: a module-level importorskip of it (or an import of
a module that needs it) skipped a whole file there, its GPU tests included, in every device run
until stop 33 (tests/test_sdpa_candidate.py)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_IMPORT_ALL = r'''
import importlib, sys
sys.modules["expecttest"] = None  # as on the GPU machine: `import expecttest` raises ImportError
sys.path.insert(0, "tests")
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as e:  # pytest's Skipped is a BaseException
        print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
'''


def gpu_files() -> list[str]:
    text = (ROOT / "benchmarks" / "device_tests.sh").read_text()
    block = re.search(r'FILES="([^"]*)"', text).group(1)
    return block.split()


def test_gpu_suite_modules_import_without_expecttest():
    files = gpu_files()
    assert len(files) > 10 and all((ROOT / f).is_file() for f in files), files
    names = [Path(f).stem for f in files]
    r = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *names], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "", r.stdout

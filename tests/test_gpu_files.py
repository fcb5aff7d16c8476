"""The GPU suite's modules (benchmarks/device_tests.sh's FILES) import without expecttest, which
CI installs and the GPU machine does not have: a module-level importorskip of it (or an import of
a module that needs it) skipped a whole file there, its GPU tests included, in every device run
until stop 33 (tests/test_sdpa_candidate.py)."""
import ast
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


def imported_tests_modules(path: Path) -> set[str]:
    """The modules of tests/ that a file imports anywhere, inside its functions too (stop 34: a test's
    own `from test_spellings import ...` failed on the GPU machine, where the module-level check
    above could not see it)."""
    local = {p.stem for p in (ROOT / "tests").glob("*.py")}
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
    return names & local


def test_gpu_suite_modules_import_without_expecttest():
    files = gpu_files()
    assert len(files) > 10 and all((ROOT / f).is_file() for f in files), files
    names = sorted({Path(f).stem for f in files}.union(*(imported_tests_modules(ROOT / f) for f in files)))
    r = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *names], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "", r.stdout

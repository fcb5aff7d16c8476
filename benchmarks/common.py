"""Small pieces the benchmark scripts share.

Importing this module puts the source tree (this folder's parent) on sys.path, right after the
script's own folder, so that `python benchmarks/<script>.py` measures this tree's fuse_plugin from a
checkout without `pip install` (the backend name then comes from `import fuse_plugin`, which registers
it when no entry point declares it)."""
from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(1, _ROOT)


def emit(lines: list[str], out: str | None, quiet: bool = False) -> None:
    """Print the finished table (unless quiet) and, with --out, write it to a file (for RESULTS.md)."""
    text = "\n".join(lines)
    if not quiet:
        print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")

"""Small pieces the benchmark scripts share."""
from __future__ import annotations


def emit(lines: list[str], out: str | None) -> None:
    """Print the finished table and, with --out, write it to a file (for RESULTS.md)."""
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")

"""`python -m fuse_plugin demo [--seq N] [--batch B]` (see fuse_plugin/demo.py)."""
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "demo":
        print("usage: python -m fuse_plugin demo [--seq N] [--batch B]")
        return 2
    from .demo import run

    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

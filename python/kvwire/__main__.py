"""``python -m kvwire bench [...]``: see :mod:`kvwire.bench`."""

import sys


def _main() -> int:
    argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help") or argv[0] != "bench":
        print("usage: python -m kvwire bench [--page-sizes 64K,1M] [--buffers 4] [--pages 8] "
              "[--concurrency 4] [--bytes 1G] [--memory 1G] [--no-check] [--json]")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from .bench import main

    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(_main())

"""Entry point of `dflash-worker` (placeholder until issue 5 lands)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("dflash-worker: not implemented yet (issue 5)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

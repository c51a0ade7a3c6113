"""Entry point of `dflash-serve` (placeholder until issue 6 lands)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("dflash-serve: not implemented yet (issue 6)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

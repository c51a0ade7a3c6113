"""Entry point of `dflash-train` (placeholder until issue 4 lands)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("dflash-train: not implemented yet (issue 4)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

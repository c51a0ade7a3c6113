"""Reading a checkpoint's JSON files without torch (settings validation and the loader)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in `file`; ValueError with a one-line message otherwise."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{file} is not a JSON object")
    return data

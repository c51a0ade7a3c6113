"""Gateway application factory (filled in by the gateway issue)."""

from __future__ import annotations

"""API-key auth: `Authorization: Bearer <key>`, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

# Paths that stay open whatever the keys: probes must work without a Secret mounted.
OPEN_PATHS = frozenset({"/health", "/ready"})
SCHEMA_PATHS = frozenset({"/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"})


class ApiKeyAuth:
    """Checks bearer tokens against the configured keys; no keys means auth is disabled."""

    def __init__(self, keys: list[str], *, protect_metrics: bool) -> None:
        # Compare digests, so the comparison time depends on neither key length nor content.
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]
        self._protect_metrics = protect_metrics

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def protects(self, path: str) -> bool:
        if not self.enabled or path in OPEN_PATHS or path in SCHEMA_PATHS:
            return False
        return self._protect_metrics or path != "/metrics"

    def allows_headers(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        """The one rule of gateway and worker alike: exactly one Authorization header, with
        the Bearer scheme and a known key (two headers are refused: servers and proxies
        disagree on which one counts)."""
        found = [value for name, value in headers if name.lower() == b"authorization"]
        return len(found) == 1 and self.allows(found[0].decode("latin-1"))

    def allows(self, authorization: str | None) -> bool:
        """True when the header carries one of the keys (every key compared, no early exit)."""
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.strip().encode()).digest()
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(digest, known)
        return matched

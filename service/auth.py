"""API-key auth: `Authorization: Bearer <key>`, compared in constant time."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger("dflash.gateway.auth")

# Paths that stay open whatever the keys: probes must work without a Secret mounted.
OPEN_PATHS = frozenset({"/health", "/ready"})
SCHEMA_PATHS = frozenset({"/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"})


class ApiKeyAuth:
    """Checks bearer tokens against the configured keys; no keys means auth is disabled."""

    def __init__(self, keys: list[str], *, protect_metrics: bool) -> None:
        # Compare digests, so the comparison time depends on neither key length nor content.
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]
        self._protect_metrics = protect_metrics

    def replace(self, keys: list[str]) -> None:
        """Swap the key set in one assignment (requests in flight see the old or the new)."""
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]

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


class KeyFileWatcher:
    """Reloads the API keys when the key file changes, so a rotated key (a Kubernetes
    Secret swaps its mounted files atomically) takes effect without a restart. A file that
    cannot be read, or that would leave no key at all, keeps the keys in force."""

    def __init__(self, path: Path, load: Callable[[], list[str]], auth: ApiKeyAuth) -> None:
        self._path, self._load, self._auth = path, load, auth
        self._seen = self._stamp()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            info = self._path.stat()  # follows the Secret's symlinks
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size

    def check(self) -> bool:
        """Reload if the file changed; True when new keys are in force."""
        stamp = self._stamp()
        if stamp == self._seen or stamp is None:
            return False
        self._seen = stamp
        try:
            keys = self._load()
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("API keys not reloaded (%s): the previous keys stay", type(exc).__name__)
            return False
        if not keys and self._auth.enabled:
            log.warning("API key file is empty: the previous keys stay (auth stays on)")
            return False
        self._auth.replace(keys)
        log.info("API keys reloaded from %s: %d key(s)", self._path, len(keys))
        return True

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.check()

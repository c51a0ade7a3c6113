"""API-key auth: `Authorization: Bearer <key>`, looked up by digest, naming the key's tenant."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from service.tenancy.tenants import KeyFileError, KeyRing, Tenant
from wire.bearer import bearer_token, single_authorization

log = logging.getLogger("dflash.gateway.auth")

# Paths that stay open whatever the keys: probes must work without a Secret mounted.
OPEN_PATHS = frozenset({"/health", "/ready"})
SCHEMA_PATHS = frozenset({"/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"})


class ApiKeyAuth:
    """Checks bearer tokens against the configured keys and says whose key it is (its
    tenant); no keys means auth is disabled."""

    def __init__(self, keys: list[str] | KeyRing, *, protect_metrics: bool) -> None:
        self.ring = keys if isinstance(keys, KeyRing) else KeyRing.plain(keys)
        self._protect_metrics = protect_metrics

    def replace(self, ring: KeyRing) -> None:
        """Swap the keys in one assignment (requests in flight see the old or the new)."""
        self.ring = ring

    @property
    def enabled(self) -> bool:
        return bool(self.ring.by_digest)

    def protects(self, path: str) -> bool:
        if not self.enabled or path in OPEN_PATHS or path in SCHEMA_PATHS:
            return False
        return self._protect_metrics or path != "/metrics"

    def allows_headers(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        return self.identify(headers) is not None

    def identify(self, headers: Sequence[tuple[bytes, bytes]]) -> Tenant | None:
        """The one rule of gateway and worker alike (wire/bearer.py), naming the key's tenant."""
        return self.tenant_of(single_authorization(headers))

    def allows(self, authorization: str | None) -> bool:
        return self.tenant_of(authorization) is not None

    def tenant_of(self, authorization: str | None) -> Tenant | None:
        """The tenant of the key in the header, if it is one of ours (looked up by digest)."""
        token = bearer_token(authorization)
        return None if token is None else self.ring.lookup(token)


class KeyFileWatcher:
    """Reloads the API keys when the key file changes, so a rotated key (a Kubernetes
    Secret swaps its mounted files atomically) or a changed limit takes effect without a
    restart. A file that cannot be read or parsed, or that would leave no key at all, keeps
    the keys in force and says why."""

    def __init__(
        self,
        path: Path,
        load: Callable[[], KeyRing],
        auth: ApiKeyAuth,
        on_reload: Callable[[KeyRing], None] | None = None,
    ) -> None:
        self._path, self._load, self._auth, self._on_reload = path, load, auth, on_reload
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
            ring = self._load()
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("API keys not reloaded (%s): the previous keys stay", type(exc).__name__)
            return False
        except KeyFileError as exc:
            log.warning("API keys not reloaded: %s; the previous keys stay", exc)
            return False
        if not ring.by_digest and self._auth.enabled:
            log.warning("API key file is empty: the previous keys stay (auth stays on)")
            return False
        self._auth.replace(ring)
        if self._on_reload is not None:
            self._on_reload(ring)
        log.info(
            "API keys reloaded from %s: %d key(s) of %d tenant(s)",
            self._path,
            len(ring.by_digest),
            len(ring.tenants),
        )
        return True

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.check()

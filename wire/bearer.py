"""The bearer-token rule that the gateway and the worker share: exactly one `Authorization`
header, the `Bearer` scheme, a non-empty token; keys are compared by their SHA-256 digest."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence


def key_digest(key: str) -> bytes:
    """Keys are looked up by digest: the lookup's timing depends on the digest, which a caller
    cannot steer towards a real key's, so one lookup replaces a constant-time scan of every key."""
    return hashlib.sha256(key.strip().encode()).digest()


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value; None for any other value."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token


def single_authorization(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The one Authorization header of raw ASGI headers; None when there is none or several
    (two headers are refused: servers and proxies disagree on which one counts)."""
    found = [value for name, value in headers if name.lower() == b"authorization"]
    return found[0].decode("latin-1") if len(found) == 1 else None


class BearerKeys:
    """A fixed set of keys (the worker's `--api-key`); no keys means the check is off."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = frozenset(key_digest(key) for key in keys if key.strip())

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def allows_headers(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        token = bearer_token(single_authorization(headers))
        return token is not None and key_digest(token) in self._digests

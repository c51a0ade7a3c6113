"""Who a key belongs to and what it may use: the key file, in either of its two formats.

- One key per line (`#` comments), as before tenants: every key is tenant `default`, with no
  limits unless the file is replaced by the tenant format.
- The tenant format, YAML: `defaults` (limits of tenants that do not set their own) and a list
  of `tenants`, each with a name, its keys and its limits:

      defaults: {requests_per_minute: 600, tokens_per_minute: 200000}
      tenants:
        - name: search
          keys: [sk-search-1, sk-search-2]
          requests_per_minute: 60
          tokens_per_minute: 20000
          concurrent_requests: 4
          tokens_per_month: 50000000
          capture: 0.1           # a tenth of its requests captured for drafter training
        - name: ops
          keys: [sk-ops]
          admin: true            # may read every tenant's usage (GET /admin/usage)
          tokens_per_minute: null  # null: no limit, whatever the defaults say

A limit a tenant leaves out is the default's; no value anywhere means no limit. Capture
(docs/capture.md) is opt-in: a tenant without `capture:` is never captured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.capture.policy import CaptureShare
from wire.bearer import key_digest

# Tenant names are metrics labels and Redis key parts: short, printable, no spaces.
TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
DEFAULT_TENANT = "default"
LIMIT_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "concurrent_requests",
    "tokens_per_month",
)


class Limits(BaseModel):
    """Per-tenant limits; None is no limit. Tokens are prompt + completion, as the worker
    reported them."""

    # Strict: YAML's own types only (`admin: 'yes'` is not true, `requests_per_minute: true`
    # not 1), as the chart's schema checks them.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    concurrent_requests: int | None = Field(default=None, ge=1)
    tokens_per_month: int | None = Field(default=None, ge=1)

    @property
    def any(self) -> bool:
        return any(getattr(self, name) is not None for name in LIMIT_FIELDS)


class TenantSpec(Limits):
    """One entry of `tenants:`: its limits override the defaults field by field."""

    name: str = Field(pattern=TENANT_NAME)
    keys: list[str] = Field(min_length=1)
    admin: bool = False
    capture: CaptureShare = 0.0

    def limits(self, defaults: Limits) -> Limits:
        own = {name: getattr(self, name) for name in LIMIT_FIELDS if name in self.model_fields_set}
        inherited = {name: getattr(defaults, name) for name in LIMIT_FIELDS}
        return Limits(**{**inherited, **own})


class TenantFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    defaults: Limits = Field(default_factory=Limits)
    tenants: list[TenantSpec] = Field(default_factory=list)


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: Limits
    admin: bool = False
    # The share of its requests captured (with capture on). Keys without tenants (one per
    # line, or none): every request, the local default.
    capture: float = 1.0


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the entry and the field."""


@dataclass(frozen=True)
class KeyRing:
    """Keys (by SHA-256 digest) to tenants. `tenancy` is True for the tenant format: every
    request of a known key then goes through the tenant's limits and the usage ledger."""

    by_digest: dict[bytes, Tenant]
    tenants: tuple[Tenant, ...]
    tenancy: bool

    @classmethod
    def plain(cls, keys: list[str]) -> KeyRing:
        """Today's keys (env and one-per-line files): all tenant `default`, no limits."""
        tenant = Tenant(DEFAULT_TENANT, Limits())
        ring = {key_digest(key): tenant for key in keys if key.strip()}
        return cls(ring, (tenant,) if ring else (), tenancy=False)

    def lookup(self, key: str) -> Tenant | None:
        return self.by_digest.get(key_digest(key))

    def tenant(self, name: str) -> Tenant | None:
        return next((tenant for tenant in self.tenants if tenant.name == name), None)


def parse_key_file(text: str, extra_keys: list[str]) -> KeyRing:
    """The key file's text (either format) plus keys given outside it (env: tenant `default`).
    Raises KeyFileError naming what is wrong."""
    document, problem = _yaml_mapping(text)
    if document is None:
        lines = [line.strip() for line in text.splitlines()]
        numbered = [(n, line) for n, line in enumerate(lines, 1) if line and line[0] != "#"]
        for n, line in numbered:
            # A key is one token: a line with a space or a trailing colon is a tenant file
            # YAML could not read (one misindented line), never a key to let in.
            if line.split()[0] != line or line.endswith(":"):
                raise KeyFileError(
                    f"line {n}: neither a key (one per line) nor valid tenant YAML{problem}"
                )
        return KeyRing.plain([*extra_keys, *(line for _, line in numbered)])
    try:
        spec = TenantFile.model_validate(document)
    except ValidationError as exc:
        raise KeyFileError(describe(exc, document)) from None
    return tenant_ring(spec, extra_keys)


def tenant_ring(spec: TenantFile, extra_keys: list[str]) -> KeyRing:
    ring: dict[bytes, Tenant] = {}
    owners: dict[bytes, str] = {}
    tenants: list[Tenant] = []
    names = [entry.name for entry in spec.tenants]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise KeyFileError(f"tenants: duplicate tenant names: {', '.join(duplicates)}")
    entries = list(spec.tenants)
    if extra_keys:
        if DEFAULT_TENANT in names:
            raise KeyFileError(
                f"tenants: {DEFAULT_TENANT!r} is the tenant of keys given outside the key "
                "file (DFLASH_GATEWAY_API_KEYS); name the file's tenant otherwise"
            )
        entries.append(TenantSpec(name=DEFAULT_TENANT, keys=extra_keys))
    for entry in entries:
        tenant = Tenant(entry.name, entry.limits(spec.defaults), entry.admin, entry.capture)
        tenants.append(tenant)
        for key in entry.keys:
            found = key_digest(key)
            if not key.strip():
                raise KeyFileError(f"tenants: {entry.name!r} has an empty key")
            if owners.get(found) == entry.name:
                raise KeyFileError(f"tenants: {entry.name!r} lists one key twice")
            if found in owners:
                raise KeyFileError(
                    f"tenants: one key belongs to both {owners[found]!r} and {entry.name!r}"
                )
            owners[found] = entry.name
            ring[found] = tenant
    return KeyRing(ring, tuple(tenants), tenancy=True)


def _yaml_mapping(text: str) -> tuple[dict[str, Any] | None, str]:
    """The parsed document when the file is in the tenant format (a YAML mapping), else None
    (one key per line: a line of keys is a YAML string, or not YAML at all); and where YAML's
    parser stopped, for the error of a file meant as tenant YAML (never the line's text: it
    may hold a key)."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or "not YAML"
        return None, f" (YAML: {problem}" + (f" at line {mark.line + 1})" if mark else ")")
    return (document if isinstance(document, dict) else None), ""


def describe(exc: ValidationError, document: dict[str, Any]) -> str:
    """pydantic's first complaint with a path a person can find in the file (a tenant by
    name, not by index); never a key's value."""
    first = exc.errors()[0]
    loc = list(first.get("loc", ()))
    if len(loc) >= 2 and loc[0] == "tenants" and isinstance(loc[1], int):
        entries = document.get("tenants") or []
        entry = entries[loc[1]] if loc[1] < len(entries) else None
        name = entry.get("name") if isinstance(entry, dict) else None
        loc[1] = repr(name) if isinstance(name, str) else f"#{loc[1] + 1}"
    where = ".".join(str(part) for part in loc) or "key file"
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{where}: {message}"

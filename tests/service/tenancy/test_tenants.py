"""The key file's two formats: one key per line (every key tenant `default`, no limits) and the
tenant format (names, keys, limits inherited from `defaults`)."""

from __future__ import annotations

import pytest

from service.tenancy.tenants import DEFAULT_TENANT, KeyFileError, Limits, parse_key_file

TENANTS = """
defaults: {requests_per_minute: 100, tokens_per_minute: 5000}
tenants:
  - name: search
    keys: [sk-search-1, sk-search-2]
    requests_per_minute: 10
    concurrent_requests: 2
    tokens_per_month: 90000
  - name: ops
    keys: [sk-ops]
    admin: true
    tokens_per_minute: null
"""


def test_one_key_per_line_is_tenant_default_without_limits() -> None:
    ring = parse_key_file("# rotated weekly\nsk-a\n\n  sk-b  \n", ["sk-env"])
    assert not ring.tenancy
    for key in ("sk-a", "sk-b", "sk-env"):
        tenant = ring.lookup(key)
        assert tenant is not None and tenant.name == DEFAULT_TENANT
        assert not tenant.limits.any
    assert ring.lookup("sk-c") is None and ring.lookup("# rotated weekly") is None


def test_tenant_format_names_keys_and_inherits_limits_field_by_field() -> None:
    ring = parse_key_file(TENANTS, [])
    assert ring.tenancy and [t.name for t in ring.tenants] == ["search", "ops"]
    search = ring.lookup("sk-search-2")
    assert search is not None and search is ring.lookup("sk-search-1")
    assert search.limits == Limits(
        requests_per_minute=10,
        tokens_per_minute=5000,  # from defaults
        concurrent_requests=2,
        tokens_per_month=90000,
    )
    ops = ring.lookup("sk-ops")
    assert ops is not None and ops.admin and not search.admin
    # null: no limit although the defaults have one; absent: the default.
    assert ops.limits == Limits(requests_per_minute=100, tokens_per_minute=None)
    assert ring.tenant("ops") is ops and ring.tenant("nobody") is None


def test_keys_from_env_join_the_tenant_file_as_tenant_default() -> None:
    ring = parse_key_file(TENANTS, ["sk-env"])
    env = ring.lookup("sk-env")
    assert env is not None and env.name == DEFAULT_TENANT
    assert env.limits == Limits(requests_per_minute=100, tokens_per_minute=5000)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tenants:\n  - {name: a, keys: [k1]}\n  - {name: a, keys: [k2]}\n", "duplicate tenant"),
        ("tenants:\n  - {name: a, keys: [k1]}\n  - {name: b, keys: [k1]}\n", "both 'a' and 'b'"),
        ("tenants:\n  - {name: a, keys: [k1, k1]}\n", "'a' lists one key twice"),
        (
            "tenants:\n  - {name: a, keys: [k1], requests_per_minte: 3}\n",
            "tenants.'a'.requests_per_minte: Extra inputs are not permitted",
        ),
        ("tenants:\n  - {name: a, keys: [k1], tokens_per_minute: 0}\n", "tenants.'a'.tokens_per"),
        ("tenants:\n  - {name: 'has space', keys: [k1]}\n", "tenants.'has space'.name"),
        ("tenants:\n  - {name: a, keys: []}\n", "tenants.'a'.keys"),
        ("tenants:\n  - {keys: [k1]}\n", "tenants.#1.name: Field required"),
        ("defaults: {rpm: 3}\n", "defaults.rpm: Extra inputs are not permitted"),
        ("tenant: []\n", "tenant: Extra inputs are not permitted"),
        # YAML's own types only, as the chart's schema: a quoted "yes" is not an admin.
        ("tenants:\n  - {name: a, keys: [k1], admin: 'yes'}\n", "tenants.'a'.admin"),
        ("tenants:\n  - {name: a, keys: [k1], requests_per_minute: true}\n", "minute"),
        ("tenants:\n  - {name: a, keys: [k1], requests_per_minute: '10'}\n", "minute"),
        # One misindented line: not YAML, and not keys either (each line would have been a
        # key: `tenants:` let in, the real keys locked out, every limit gone).
        (
            "tenants:\n  - name: a\n    keys: [k1]\n    requests_per_minute: 3\n"
            "   tokens_per_minute: 40\n",
            "line 1: neither a key (one per line) nor valid tenant YAML (YAML:",
        ),
        ("sk-one\nsk two\n", "line 2: neither a key"),
    ],
)
def test_a_bad_tenant_file_is_refused_naming_the_entry_and_field(text: str, message: str) -> None:
    with pytest.raises(KeyFileError) as caught:
        parse_key_file(text, [])
    assert message in str(caught.value)
    assert "k1" not in str(caught.value).replace("'a'", "")  # never a key's value


def test_the_env_keys_tenant_name_cannot_be_taken_by_the_file() -> None:
    text = "tenants:\n  - {name: default, keys: [k1]}\n"
    assert parse_key_file(text, []).lookup("k1") is not None
    with pytest.raises(KeyFileError, match="DFLASH_GATEWAY_API_KEYS"):
        parse_key_file(text, ["sk-env"])

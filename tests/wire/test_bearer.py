"""The bearer rule shared by gateway and worker: one header, Bearer scheme, digest lookup."""

from __future__ import annotations

import pytest

from wire.bearer import BearerKeys, bearer_token, single_authorization


@pytest.mark.parametrize(
    ("value", "token"),
    [
        ("Bearer sk-1", "sk-1"),
        ("bearer sk-1", "sk-1"),
        ("Basic sk-1", None),
        ("Bearer ", None),
        ("Bearer", None),
        ("", None),
        (None, None),
    ],
)
def test_bearer_token(value: str | None, token: str | None) -> None:
    assert bearer_token(value) == token


def test_exactly_one_authorization_header_counts() -> None:
    one = [(b"host", b"x"), (b"Authorization", b"Bearer a")]
    assert single_authorization(one) == "Bearer a"
    assert single_authorization([*one, (b"authorization", b"Bearer b")]) is None
    assert single_authorization([(b"host", b"x")]) is None


def test_bearer_keys_allow_only_their_keys() -> None:
    keys = BearerKeys(["sk-a", " ", "sk-b"])
    assert keys.enabled
    assert keys.allows_headers([(b"authorization", b"Bearer sk-b")])
    assert not keys.allows_headers([(b"authorization", b"Bearer sk-c")])
    assert not keys.allows_headers([(b"authorization", b"Bearer sk-a"), (b"authorization", b"x")])
    assert not BearerKeys([]).enabled

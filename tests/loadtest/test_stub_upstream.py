"""The gateway benchmark's stub worker: its JSON replies, with x's or with a new passage of
prose for each request (`--reply-chars`)."""

from __future__ import annotations

import json

from loadtest.stub_upstream import Passages, Stub, unary_body


def content(reply: bytes) -> str:
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1] if reply.startswith(b"HTTP") else reply)
    text: str = body["choices"][0]["message"]["content"]
    return text


def test_a_reply_holds_x_s_or_the_text_given_escaped() -> None:
    assert content(unary_body(5)) == "xxxxx"
    tricky = 'a "quote", a \\ and\na line'
    assert content(unary_body(5, tricky)) == tricky
    assert json.loads(unary_body(5, tricky))["usage"]["completion_tokens"] == 5


def test_passages_are_new_for_each_request_until_the_corpus_is_used_up() -> None:
    passages = Passages(1000)
    seen = [passages.next() for _ in range(50)]
    assert all(len(p) == 1000 for p in seen)
    assert len(set(seen)) == 50
    whole = Passages(len(passages._text) // 2 + 1)  # one fits, the next starts over
    assert whole.next() == whole.next()


def test_the_stub_sends_the_same_reply_without_reply_chars_and_new_prose_with_it() -> None:
    plain = Stub(events=4, gap_ms=0)
    assert plain.unary() == plain.unary() and content(plain.unary()) == "xxxx"
    prose = Stub(events=4, gap_ms=0, reply_chars=300)
    first, second = content(prose.unary()), content(prose.unary())
    assert len(first) == len(second) == 300 and first != second

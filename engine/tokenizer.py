"""Tokenizer of a Hugging Face model folder, without transformers: `tokenizer.json` through
the `tokenizers` library, the chat template of `tokenizer_config.json` through Jinja (the
same sandboxed rendering transformers uses), and the EOS ids from the tokenizer config,
`generation_config.json` and `config.json`.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

# A UTF-8 character is at most 4 bytes and a byte-level token at least 1: once this many
# tokens are pending, a trailing replacement character is real, not a split character.
_MAX_PENDING_TOKENS = 4
# Prompt tokens a detokenizer starts from, so the first output token decodes with the
# spacing it has in context (SentencePiece-style leading spaces).
_CONTEXT_TOKENS = 4


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class WindowDetokenizer:
    """Streams text for appended tokens; never emits half a UTF-8 character. The fallback
    for tokenizers that are not byte-level (ByteLevelDetokenizer is the fast path).

    Decodes a short window (`prefix_offset`..end) and emits what it adds over the already
    emitted part (`prefix_offset`..`read_offset`), so each push costs O(window), not
    O(output length)."""

    def __init__(self, tokenizer: HFTokenizer, context: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(context[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def push(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        pending = len(self._ids) - self._read_offset
        if len(full) <= len(prefix):
            return ""  # nothing printable yet (a skipped special token)
        if full.endswith("\ufffd") and pending < _MAX_PENDING_TOKENS:
            return ""  # the last token ends inside a character: wait for the rest
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]


def _byte_level_alphabet() -> dict[str, int]:
    """The printable-character stand-in of each byte used by byte-level BPE vocabularies
    (printable Latin-1 bytes are themselves; the others map to 256 + n in order)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def byte_level_table(tokenizer: HFTokenizer) -> list[bytes] | None:
    """Bytes of every token id for a byte-level BPE tokenizer (special tokens: empty),
    or None when the tokenizer is not byte-level or a token does not map to bytes."""
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    alphabet = _byte_level_alphabet()
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
    table: list[bytes] = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        piece = tokenizer.id_to_token(token_id) or ""
        if token_id in special:
            table.append(b"")
        elif token_id in added:
            table.append(added[token_id].encode("utf-8"))
        elif all(c in alphabet for c in piece):
            table.append(bytes(alphabet[c] for c in piece))
        else:
            return None
    return table


class ByteLevelDetokenizer:
    """Streaming text for byte-level BPE: token bytes through an incremental UTF-8
    decoder, which holds an incomplete character until its last byte arrives (and
    turns invalid bytes into U+FFFD at once). O(new tokens) per push, no re-decoding."""

    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Sequence[int]) -> str:
        table = self._table
        size = len(table)
        data = b"".join(table[t] if 0 <= t < size else b"" for t in token_ids)
        return self._utf8.decode(data)


class Tokenizer:
    """encode / decode / chat template / EOS ids of one model folder."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        chat_template: str | None,
        special_tokens: dict[str, str],
        eos_token_ids: set[int],
    ) -> None:
        self._tok = tokenizer
        self._special_tokens = special_tokens
        self.eos_token_ids = eos_token_ids
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._byte_table = byte_level_table(tokenizer)
        self._template: jinja2.Template | None = None
        if chat_template is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(chat_template)

    @classmethod
    def from_dir(cls, path: Path | str) -> Tokenizer:
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        tokenizer = HFTokenizer.from_file(str(tok_file))
        config = _read_json(folder / "tokenizer_config.json")
        specials = {
            key: content
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (content := _token_content(config.get(key))) is not None
        }
        eos: set[int] = set()
        eos_id = tokenizer.token_to_id(specials.get("eos_token", ""))
        if eos_id is not None:
            eos.add(eos_id)
        eos.update(_id_list(_read_json(folder / "generation_config.json").get("eos_token_id")))
        eos.update(_id_list(_read_json(folder / "config.json").get("eos_token_id")))
        template = config.get("chat_template")
        return cls(
            tokenizer,
            chat_template=template if isinstance(template, str) else None,
            special_tokens=specials,
            eos_token_ids=eos,
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        text: str = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def bad_words(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Token sequences for vLLM's `bad_words`: each word as written (leading spaces
        stripped) and, where it tokenizes to as many tokens but starts differently, with
        one leading space, as it reads mid-sentence."""
        out: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(self.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.encode(" " + word.lstrip(), add_special_tokens=False))
            if not bare:
                raise ValueError(f"bad word {word!r} has no tokens")
            out.append(bare)
            if len(spaced) == len(bare) and spaced[0] != bare[0]:
                out.append(spaced)
        return tuple(out)

    def logprob_token(self, token_id: int) -> tuple[str, bytes]:
        """A token as logprobs name it: the text of the token alone, special tokens
        spelled out (as vLLM), and its own bytes (OpenAI's `bytes`: joining a character's
        tokens' bytes rebuilds it, where each token's text alone may be U+FFFD)."""
        text = self.decode([token_id], skip_special_tokens=False)
        table = self._byte_table
        raw = table[token_id] if table is not None and 0 <= token_id < len(table) else b""
        return text, raw or text.encode("utf-8")

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (vLLM's `token_strs`)."""
        return [self._tok.id_to_token(i) or "" for i in ids]

    def render_chat(
        self,
        messages: list[dict[str, str]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation as the chat template writes it. `template_kwargs` are extra
        template variables (vLLM's `chat_template_kwargs`, e.g. enable_thinking);
        `continue_final_message` leaves the last message open for the model to go on
        (the text ends where that message's content ends, as transformers does)."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat_template")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        rendered: str = self._template.render(
            **{**self._special_tokens, **(template_kwargs or {})},
            messages=messages,
            add_generation_prompt=add_generation_prompt,
        )
        if not continue_final_message:
            return rendered
        final = messages[-1]["content"] if messages else ""
        core = final.strip()
        at = rendered.rfind(core) if core else -1
        if at < 0:
            raise ValueError("the final message does not appear in the rendered chat")
        # The template may trim the message's trailing spaces: keep them only where the
        # rendered text still has them (transformers' rule).
        kept = final.lstrip()
        end = at + (len(kept) if rendered[at : at + len(kept)] == kept else len(core))
        return rendered[:end]

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        *,
        add_special_tokens: bool = False,
        **options: Any,
    ) -> list[int]:
        """Token ids of the conversation, by default with the assistant turn opened
        (`options`: render_chat's). The template writes special tokens as text, so by
        default none are added again (vLLM's chat default)."""
        text = self.render_chat(messages, **options)
        return self.encode(text, add_special_tokens=add_special_tokens)

    def detokenizer(self, context: Sequence[int] = ()) -> ByteLevelDetokenizer | WindowDetokenizer:
        """A streaming detokenizer for one request's output (`context`: its prompt)."""
        if self._byte_table is not None:
            return ByteLevelDetokenizer(self._byte_table)
        return WindowDetokenizer(self._tok, context)

"""The bundled tokenizer: AutoTokenizer loads it, the chat template renders, specials fixed."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from engine.train.tokenizer_recipe import (
    MASK,
    SPECIAL_TOKENS,
    TokenizerConfig,
    load_tokenizer,
    save_tokenizer,
    special_token_ids,
    train_tokenizer,
)

BUNDLED = Path(__file__).resolve().parents[3] / "engine" / "assets" / "tiny-coder" / "target"


def test_bundled_tokenizer_loads_with_autotokenizer_and_renders_chat() -> None:
    tok = AutoTokenizer.from_pretrained(BUNDLED)
    assert len(tok) == 4096
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    messages = [{"role": "user", "content": "def add(a, b):"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n"
    code = "    def run(self):\n        return {'a': 1}\n"
    assert tok.decode(tok.encode(code, add_special_tokens=False)) == code
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # one id per special token


def test_bundled_special_token_ids_are_fixed() -> None:
    ids = special_token_ids(load_tokenizer(BUNDLED))
    assert [ids[name] for name in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert ids[MASK] == 3


def test_train_and_save_small_tokenizer(tmp_path: Path) -> None:
    docs = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n"] * 20
    config = TokenizerConfig(vocab_size=300, min_frequency=1)
    tok = train_tokenizer(docs, config)
    assert tok.get_vocab_size() <= 300
    save_tokenizer(tok, tmp_path, config)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.decode(loaded.encode(docs[0], add_special_tokens=False)) == docs[0]
    assert loaded.mask_token == MASK and loaded.chat_template

"""Tokenizer of a model folder: encode/decode, chat template, EOS ids, streaming text."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.sequence import Detokenizer
from engine.tokenizer import ByteLevelDetokenizer, Tokenizer, WindowDetokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content']"
    " + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "café crème brûlée, naïve façade — 中文字符 and emoji 🙂🚀 mixed in",
    "for i in range(10):\n    print(i * i)\n",
] * 20
SAMPLE = "def façade(x):\n    return '中文 🙂🚀 crème' + x\n"


def write_tokenizer(folder: Path, *, template: str | None = TEMPLATE) -> None:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, object] = {"eos_token": {"content": "<|im_end|>"}, "bos_token": None}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(folder: Path) -> Tokenizer:
    return Tokenizer.from_dir(folder)


def detokenizers(folder: Path, context: list[int]) -> list[Detokenizer]:
    """Both streaming paths: the byte-table one and the generic re-decoding window."""
    tok = Tokenizer.from_dir(folder)
    fast = tok.detokenizer(context)
    generic = WindowDetokenizer(HFTokenizer.from_file(str(folder / "tokenizer.json")), context)
    assert isinstance(fast, ByteLevelDetokenizer)
    return [fast, generic]


def test_round_trip_and_vocab(tok: Tokenizer) -> None:
    ids = tok.encode(SAMPLE)
    assert len(ids) > 5 and tok.decode(ids) == SAMPLE
    assert 259 < tok.vocab_size <= 400  # 256 bytes + 3 specials + merges
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_eos_ids_from_config_and_generation_config(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == {0, 2}  # <|im_end|> is id 2, <|endoftext|> id 0


def test_chat_template_opens_the_assistant_turn(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(messages)
    assert ids.count(1) == 3  # <|im_start|> is one token per turn, not spelled out
    assert ids.count(2) == 2
    rendered = tok.decode(ids, skip_special_tokens=False)
    assert rendered == tok.render_chat(messages)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert tok.decode(ids) == "system\nbe brief\nuser\nhi\nassistant\n"


def test_no_template_and_no_tokenizer_are_clear_errors(tmp_path: Path) -> None:
    write_tokenizer(tmp_path / "a", template=None)
    bare = Tokenizer.from_dir(tmp_path / "a")
    with pytest.raises(ValueError, match="chat_template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path / "missing")


@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("kind", [0, 1], ids=["byte-table", "window"])
def test_streaming_never_splits_a_character(
    tok: Tokenizer, folder: Path, chunk: int, kind: int
) -> None:
    prompt = tok.encode("x = ")
    ids = tok.encode(SAMPLE)
    # Byte-level tokens split the multi-byte characters: the stream must hold them back.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = detokenizers(folder, prompt)[kind]
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == SAMPLE


def test_byte_table_agrees_with_decode_on_random_ids(tok: Tokenizer, folder: Path) -> None:
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(20)]
        detok = detokenizers(folder, [])[0]
        text = "".join(detok.push(ids[i : i + 3]) for i in range(0, 20, 3))
        # Only an incomplete character at the very end may still be held back.
        full = tok.decode(ids)
        assert full.startswith(text) and set(full[len(text) :]) <= {"\ufffd"}


def test_non_byte_level_tokenizer_uses_the_window(tmp_path: Path) -> None:
    wl = HFTokenizer(models.WordLevel({"[UNK]": 0, "héllo": 1, "wörld": 2}, unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wl.decoder = decoders.WordPiece()
    wl.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    detok = tok.detokenizer()
    assert isinstance(detok, WindowDetokenizer)
    assert (
        "".join(detok.push([i]) for i in (1, 2, 1)) == tok.decode([1, 2, 1]) == "héllo wörld héllo"
    )


@pytest.mark.parametrize("kind", [0, 1], ids=["byte-table", "window"])
def test_streaming_skips_special_tokens(tok: Tokenizer, folder: Path, kind: int) -> None:
    detok = detokenizers(folder, [])[kind]
    ids = [*tok.encode("ab"), 2, *tok.encode("cd")]
    assert "".join(detok.push([i]) for i in ids) == "abcd"


@pytest.mark.parametrize("kind", [0, 1], ids=["byte-table", "window"])
def test_invalid_bytes_are_eventually_emitted(tok: Tokenizer, folder: Path, kind: int) -> None:
    # A random model can emit a lone continuation byte forever: text must not stall.
    lone = next(i for i in range(3, tok.vocab_size) if tok.decode([i]) == "\ufffd")
    detok = detokenizers(folder, [])[kind]
    text = "".join(detok.push([lone]) for _ in range(12))
    assert text.count("\ufffd") >= 8


def test_bad_words_as_written_and_mid_sentence(tok: Tokenizer) -> None:
    """vLLM's rule: the word without leading spaces, plus its " word" form when that is as
    many tokens and starts with a different one."""
    for word in ("hello", "  hello", "hello world"):
        bare = tuple(tok.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tok.encode(" " + word.lstrip(), add_special_tokens=False))
        expected = [bare]
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            expected.append(spaced)
        assert list(tok.bad_words([word])) == expected
    assert len(tok.bad_words(["hello", "world"])) >= 2
    with pytest.raises(ValueError, match="no tokens"):
        tok.bad_words([""])


def test_logprob_token_names_text_and_own_bytes(tok: Tokenizer) -> None:
    ids = tok.encode("é", add_special_tokens=False)
    named = [tok.logprob_token(i) for i in ids]
    assert b"".join(raw for _, raw in named).decode() == "é"
    eos = next(iter(tok.eos_token_ids))
    text, raw = tok.logprob_token(eos)
    assert text and raw == text.encode()  # special tokens are spelled out, as vLLM


BUNDLED = Path(__file__).resolve().parents[2] / "engine/assets/tiny-coder/target"
CHAT_CASES = [
    ([{"role": "user", "content": "hi"}], {"add_generation_prompt": True}),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], {}),
    (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f(x):"}],
        {"continue_final_message": True},
    ),
    (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  spaced  "}],
        {"continue_final_message": True},
    ),
]


@pytest.mark.parametrize(("messages", "options"), CHAT_CASES)
def test_chat_options_render_as_transformers_does(
    messages: list[dict[str, str]], options: dict[str, bool]
) -> None:
    """The peer itself: transformers' apply_chat_template on the bundled tokenizer."""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(BUNDLED))
    ours = Tokenizer.from_dir(BUNDLED)
    add = options.get("add_generation_prompt", False)
    cont = options.get("continue_final_message", False)
    expected = theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add, continue_final_message=cont
    )
    assert ours.render_chat(messages, add_generation_prompt=add, continue_final_message=cont) == (
        expected
    )


def test_template_kwargs_reach_the_template(tok: Tokenizer, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    write_tokenizer(tmp_path, template="{{ greeting }}{{ messages[0].content }}")
    reading = Tokenizer.from_dir(tmp_path)
    assert reading.render_chat(messages, template_kwargs={"greeting": "HELLO "}) == "HELLO hi"
    assert tok.render_chat(messages, template_kwargs={"unused": 1}) == tok.render_chat(messages)
    with pytest.raises(ValueError, match="exclude each other"):
        tok.render_chat(messages, continue_final_message=True)
    with pytest.raises(ValueError, match="does not appear"):
        tok.render_chat(
            [{"role": "assistant", "content": "   "}],
            add_generation_prompt=False,
            continue_final_message=True,
        )

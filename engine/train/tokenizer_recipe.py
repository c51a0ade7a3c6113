"""Byte-level BPE tokenizer for the tiny-coder target, trained on the corpus.

Saved as `tokenizer.json` + `tokenizer_config.json` (with a ChatML Jinja template), so
`transformers.AutoTokenizer.from_pretrained(folder)` and the engine's tokenizer both load it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.train.corpus import CorpusConfig, read_documents, training_files

# Reserved special tokens, ids 0..5 in this order (the BPE trainer places them first).
ENDOFTEXT = "<|endoftext|>"  # document separator; also a stop token
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of a chat turn: the chat eos
MASK = "<|mask|>"  # the DFlash drafter's mask token
PAD = "<|pad|>"
BOS = "<|bos|>"  # reserved; not added by default (like Qwen)
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK, PAD, BOS)

# ChatML, as Qwen uses it; a generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 4096  # total, special tokens and the 256 byte tokens included
    min_frequency: int = 2
    model_max_length: int = 2048


def train_tokenizer(docs: list[str], config: TokenizerConfig) -> Tokenizer:
    """Train a byte-level BPE over `docs` (deterministic for a fixed corpus)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def token_id(tok: Tokenizer, name: str) -> int:
    """Id of a reserved token; a tokenizer without it is not ours."""
    found = tok.token_to_id(name)
    if found is None:
        raise ValueError(f"tokenizer lacks special token {name}")
    return int(found)


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    return {name: token_id(tok, name) for name in SPECIAL_TOKENS}


def _tokenizer_config(tok: Tokenizer, config: TokenizerConfig) -> dict[str, object]:
    ids = special_token_ids(tok)
    added = {
        str(ids[name]): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for name in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD,
        "mask_token": MASK,
        "unk_token": None,
        "additional_special_tokens": [ENDOFTEXT, IM_START, IM_END],
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, out_dir: Path, config: TokenizerConfig) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    text = json.dumps(_tokenizer_config(tok, config), indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")


def load_tokenizer(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer at {path}: run `dflash-train tokenizer`")
    return Tokenizer.from_file(str(path))


def run_tokenizer_stage(corpus: CorpusConfig, out_dir: Path, *, smoke: bool = False) -> None:
    """`dflash-train tokenizer`: train on the training files, write into `out_dir`."""
    docs = read_documents(training_files(corpus))
    config = TokenizerConfig(vocab_size=512 if smoke else 4096)
    tok = train_tokenizer(docs, config)
    save_tokenizer(tok, out_dir, config)
    print(f"tokenizer: {tok.get_vocab_size()} tokens from {len(docs)} files -> {out_dir}")

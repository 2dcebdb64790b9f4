"""Tokenizers from a checkpoint's `tokenizer/` folder through the `tokenizers` library, padded and truncated the way
transformers' fast tokenizers do; and the tiny word-level tokenizer of the built-in demo.

This module imports nothing but `tokenizers` and the standard library, so the fixture script (PyTorch side) can load
it by path to build the same demo tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, models, pre_tokenizers


class TextTokenizer:
    """A `tokenizers.Tokenizer` with the padding token and sides of its `tokenizer_config.json`."""

    def __init__(self, tokenizer: Tokenizer, pad_token: str | None, padding_side: str = "right",
                 truncation_side: str = "right", model_max_length: int | None = None):
        self.tokenizer = tokenizer
        self.model_max_length = model_max_length
        self.pad_token = pad_token
        self.pad_token_id = tokenizer.token_to_id(pad_token) if pad_token is not None else None
        if pad_token is not None and self.pad_token_id is None:
            raise ValueError(f"pad token {pad_token!r} is not in the vocabulary")
        self.padding_side, self.truncation_side = padding_side, truncation_side

    @classmethod
    def from_folder(cls, folder: str | Path) -> "TextTokenizer":
        """Read `tokenizer.json` and `tokenizer_config.json` (pad token, padding and truncation sides)."""
        from .loading import CheckpointError, read_json  # here, so that this module alone needs only `tokenizers`

        folder = Path(folder)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise CheckpointError(f"{file}: file not found (a tokenizer folder needs tokenizer.json)")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:
            raise CheckpointError(f"{file}: not a readable tokenizers file ({e})") from None
        config = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
        pad = config.get("pad_token")
        if isinstance(pad, dict):  # older configs store AddedToken dicts
            pad = pad.get("content")
        max_length = config.get("model_max_length")
        max_length = max_length if isinstance(max_length, int) and max_length < 10**9 else None  # huge = unset
        return cls(tokenizer, pad, config.get("padding_side", "right"), config.get("truncation_side", "right"),
                   max_length)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def __call__(self, texts: list[str], max_length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention mask, (batch, length) int32 / bool.

        With `max_length`, each sequence is truncated to it and padded to exactly that length (transformers'
        `truncation=True, padding="max_length"`); without, sequences are padded to the longest. Truncation and
        padding are the tokenizers library's own, as transformers' fast tokenizers use them, so special tokens that
        a post-processor adds (CLIP's start/end, T5's end) survive truncation.
        """
        tok = self.tokenizer
        if max_length is not None:
            tok.enable_truncation(max_length, direction=self.truncation_side)
        else:
            tok.no_truncation()
        if self.pad_token_id is not None:
            tok.enable_padding(direction=self.padding_side, pad_id=self.pad_token_id, pad_token=self.pad_token,
                               length=max_length)
        else:
            tok.no_padding()
        try:
            encodings = tok.encode_batch(list(texts))
        finally:
            tok.no_truncation()
            tok.no_padding()
        lengths = {len(e.ids) for e in encodings}
        if len(lengths) > 1:
            raise ValueError("this tokenizer has no pad token, so sequences of different lengths cannot be batched")
        ids = np.array([e.ids for e in encodings], np.int32)
        mask = np.array([e.attention_mask for e in encodings], bool)
        return ids, mask


# The demo tokenizer: words, punctuation and newlines each one token, so the Krea 2 prompt template's system prefix is
# 34 tokens and its suffix 5, as with the real Qwen tokenizer.
DEMO_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
DEMO_WORDS = (
    "system user assistant Describe the image by detailing color shape size texture quantity text spatial "
    "relationships of objects and background a an in on with at red green blue yellow white black orange purple cat "
    "dog bird fox horse tree forest mountain river sea sky cloud sun moon city street house car boat photo painting "
    "portrait landscape small large old young sitting running flying under over near big tiny bright dark light "
    "night day morning evening snow rain field flower garden table cup book window door wall floor lamp chair"
).split()
DEMO_SYMBOLS = list(",.:;!?'\"()-\n")


def build_demo_tokenizer() -> Tokenizer:
    """The built-in demo's word-level tokenizer (vocabulary of a few hundred ids; unknown words map to <unk>)."""
    vocab = {token: i for i, token in enumerate(DEMO_SPECIAL_TOKENS + DEMO_WORDS + DEMO_SYMBOLS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
        pre_tokenizers.Punctuation(behavior="isolated"),
    ])
    tokenizer.add_special_tokens(DEMO_SPECIAL_TOKENS[:3])
    return tokenizer


def save_demo_tokenizer(folder: str | Path) -> Path:
    """Write the demo tokenizer as a `tokenizer/` folder (tokenizer.json + tokenizer_config.json)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_demo_tokenizer().save(str(folder / "tokenizer.json"))
    config = {"pad_token": "<|endoftext|>", "unk_token": "<unk>", "padding_side": "right",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder

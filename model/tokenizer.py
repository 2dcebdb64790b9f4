"""Tokenizers from a checkpoint's `tokenizer/` folder through the `tokenizers` library, padded and truncated the way
transformers' fast tokenizers do; and the tiny word-level tokenizer of the built-in demo.

A folder loads in any layout that real model folders ship: `tokenizer.json` (used as it is); byte-level BPE from
`vocab.json` + `merges.txt` (CLIP, as FLUX.1's `tokenizer/`; Qwen2/Qwen3, as Krea 2's); or a SentencePiece
`spiece.model` (T5, as FLUX.1's `tokenizer_2/`). Without `tokenizer.json`, the tokenizer is built as transformers
builds it for the `tokenizer_class` of `tokenizer_config.json`, with the added and special tokens of that file and
`special_tokens_map.json`.

This module imports nothing but `tokenizers`, numpy and the standard library, so the fixture script (PyTorch side) can
load it by path to build the same demo tokenizer.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

TOKENIZER_FILES = "tokenizer.json, vocab.json + merges.txt, or spiece.model"

# tokenizer_config.json's `tokenizer_class` -> how the folder is built when it has no tokenizer.json.
TOKENIZER_KINDS = {
    "CLIPTokenizer": "clip", "CLIPTokenizerFast": "clip",
    "Qwen2Tokenizer": "qwen2", "Qwen2TokenizerFast": "qwen2",
    "T5Tokenizer": "t5", "T5TokenizerFast": "t5",
}

# CLIP's word split (the special tokens, English contractions, letter runs, single digits, other symbol runs) and
# Qwen2's (GPT-4-like: contractions, letter runs with one leading non-letter, single digits, symbol runs, newlines).
CLIP_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
               r"""|\s+(?!\S)|\s+""")
T5_EXTRA_IDS = 100  # T5's sentinel tokens <extra_id_0..99>, after the SentencePiece pieces in reverse order
# The special tokens of each kind where its config names none, as the transformers classes default them.
KIND_DEFAULTS = {
    "clip": {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
             "pad_token": "<|endoftext|>"},
    "qwen2": {"eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "t5": {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
}


def _error(message: str) -> Exception:
    from .loading import CheckpointError  # here, so that this module alone needs only `tokenizers`

    return CheckpointError(message)


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
        """Read a tokenizer folder: `tokenizer.json` when present, else `vocab.json` + `merges.txt` or
        `spiece.model` built for `tokenizer_config.json`'s class; the pad token, padding and truncation sides and
        model_max_length from `tokenizer_config.json` (special tokens also from `special_tokens_map.json`)."""
        folder = Path(folder)
        if not folder.is_dir():
            raise _error(f"{folder}: not a folder (a tokenizer folder holds {TOKENIZER_FILES})")
        settings = _tokenizer_settings(folder)
        file = folder / "tokenizer.json"
        if file.is_file():
            try:
                tokenizer = Tokenizer.from_file(str(file))
            except Exception as e:
                raise _error(f"{file}: not a readable tokenizers file ({e})") from None
        else:
            tokenizer, settings = _build_tokenizer(folder, settings)
        pad = _token_content(settings.get("pad_token"))
        if pad is not None and tokenizer.token_to_id(pad) is None:
            raise _error(f"{folder / 'tokenizer_config.json'}: pad_token {pad!r} is not in the vocabulary")
        max_length = settings.get("model_max_length")
        max_length = max_length if isinstance(max_length, int) and max_length < 10**9 else None  # huge = unset
        return cls(tokenizer, pad, settings.get("padding_side", "right"), settings.get("truncation_side", "right"),
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


# -- building a tokenizer from the files of a folder without tokenizer.json --------------------------------------------


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json / special_tokens_map.json store it: a string, an AddedToken dict or
    null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tokenizer_settings(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json, with the special tokens of special_tokens_map.json where the config has none."""
    from .loading import read_json

    config_file, map_file = folder / "tokenizer_config.json", folder / "special_tokens_map.json"
    config = read_json(config_file) if config_file.is_file() else {}
    special = read_json(map_file) if map_file.is_file() else {}
    settings = dict(config)
    for key, value in special.items():
        if settings.get(key) is None:
            settings[key] = value
    decoder = settings.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict) or not all(str(k).isdigit() and isinstance(v, dict) and isinstance(
            v.get("content"), str) for k, v in decoder.items()):
        raise _error(f"{config_file}: added_tokens_decoder must map ids to token objects with a content string")
    return settings


def _build_tokenizer(folder: Path, settings: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer of a folder without tokenizer.json, and its settings completed with its kind's defaults."""
    kind = _tokenizer_kind(folder, settings)
    if kind == "t5":
        settings = {**KIND_DEFAULTS[kind], **settings}
        return _sentencepiece_t5(folder, settings), settings
    vocab, merges = _read_bpe_files(folder)
    if kind is None:  # CLIP marks the end of a word with </w>; GPT-2-style vocabularies mark a leading space
        kind = "clip" if any(token.endswith("</w>") for token in vocab) else "qwen2"
    settings = {**KIND_DEFAULTS[kind], **settings}
    return _byte_level_bpe(vocab, merges, kind, folder, settings), settings


def _tokenizer_kind(folder: Path, settings: dict[str, Any]) -> str | None:
    """"clip", "qwen2" or "t5" from tokenizer_config.json's tokenizer_class; None: byte-level BPE of no stated class
    (decided from the vocabulary)."""
    has_bpe = (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()
    has_spm = (folder / "spiece.model").is_file()
    if not has_bpe and not has_spm:
        raise _error(f"{folder}: no tokenizer files (expected {TOKENIZER_FILES})")
    name = settings.get("tokenizer_class")
    if name is None:
        return None if has_bpe else "t5"
    kind = TOKENIZER_KINDS.get(name)
    if kind is None:
        raise _error(f"{folder / 'tokenizer_config.json'}: tokenizer_class {name!r} cannot be built without "
                     f"tokenizer.json (known: {', '.join(sorted(TOKENIZER_KINDS))})")
    if kind == "t5" and not has_spm:
        raise _error(f"{folder}: tokenizer_class {name} needs spiece.model (or tokenizer.json)")
    if kind != "t5" and not has_bpe:
        raise _error(f"{folder}: tokenizer_class {name} needs vocab.json and merges.txt (or tokenizer.json)")
    return kind


def _read_bpe_files(folder: Path) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """vocab.json (token -> id) and merges.txt (an optional `#version` line, then one `left right` pair a line)."""
    file = folder / "vocab.json"
    try:
        vocab = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _error(f"{file}: not a readable JSON file ({e})") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise _error(f"{file}: expected a JSON object of token -> integer id")
    file = folder / "merges.txt"
    try:
        lines = file.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise _error(f"{file}: not a readable text file ({e})") from None
    merges = []
    for number, line in enumerate(lines, 1):
        line = line.rstrip("\r")
        if not line or (number == 1 and line.startswith("#version")):
            continue
        pair = line.split(" ")
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab:
            raise _error(f"{file}: line {number} is not a merge of two vocabulary tokens: {line[:60]!r}")
        merges.append((pair[0], pair[1]))
    return vocab, merges


def _byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], kind: str, folder: Path,
                    settings: dict[str, Any]) -> Tokenizer:
    """CLIP or Qwen2 byte-level BPE from vocab.json + merges.txt, as transformers' CLIPTokenizer and Qwen2Tokenizer
    build it."""
    if kind == "clip":
        unk = _token_content(settings.get("unk_token"))
        tokenizer = Tokenizer(models.BPE(vocab, merges, dropout=None, continuing_subword_prefix="",
                                         end_of_word_suffix="</w>", fuse_unk=False, unk_token=unk))
        # Unicode-composed, runs of whitespace as one space, lower case: CLIP's own text cleaning.
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(CLIP_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ])
    else:
        tokenizer = Tokenizer(models.BPE(vocab, merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                                         end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=bool(settings.get("add_prefix_space")), use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    _add_tokens(tokenizer, folder, settings)
    config_file = folder / "tokenizer_config.json"
    if kind == "clip":  # <|startoftext|> text <|endoftext|>
        bos = _special_id(tokenizer, settings, "bos_token", config_file)
        eos = _special_id(tokenizer, settings, "eos_token", config_file)
        tokenizer.post_processor = processors.RobertaProcessing(eos, bos, trim_offsets=False, add_prefix_space=False)
    else:  # Qwen adds no BOS/EOS unless the config asks for them
        template = []
        if settings.get("add_bos_token"):
            template.append(_special_id(tokenizer, settings, "bos_token", config_file))
        template.append(None)
        if settings.get("add_eos_token"):
            template.append(_special_id(tokenizer, settings, "eos_token", config_file))
        tokenizer.post_processor = processors.TemplateProcessing(
            single=" ".join("$A" if t is None else t[0] for t in template),
            special_tokens=[t for t in template if t is not None])
    return tokenizer


def _special_id(tokenizer: Tokenizer, settings: dict[str, Any], key: str, config_file: Path) -> tuple[str, int]:
    token = _token_content(settings.get(key))
    token_id = tokenizer.token_to_id(token) if token is not None else None
    if token_id is None:
        raise _error(f"{config_file}: {key} {token!r} is not in the vocabulary")
    return token, token_id


def _add_tokens(tokenizer: Tokenizer, folder: Path, settings: dict[str, Any]) -> None:
    """The added tokens of tokenizer_config.json's added_tokens_decoder, each at its stated id and with its stated
    matching (lstrip, rstrip, single_word, normalized) and special flag; then the named special tokens (bos, eos,
    unk, pad, additional_special_tokens) that are not added tokens yet, as transformers adds them."""
    config_file = folder / "tokenizer_config.json"
    decoder = settings.get("added_tokens_decoder") or {}
    for key in sorted(decoder, key=int):
        entry = decoder[key]
        special = bool(entry.get("special", False))
        token = AddedToken(entry["content"], single_word=bool(entry.get("single_word", False)),
                           lstrip=bool(entry.get("lstrip", False)), rstrip=bool(entry.get("rstrip", False)),
                           normalized=bool(entry.get("normalized", not special)), special=special)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
        if tokenizer.token_to_id(entry["content"]) != int(key):
            raise _error(f"{config_file}: added token {entry['content']!r} has id {key} there, but the vocabulary "
                         f"gives it {tokenizer.token_to_id(entry['content'])}")
    added = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    named = [_token_content(settings.get(key)) for key in ("bos_token", "eos_token", "unk_token", "pad_token")]
    named += [_token_content(t) for t in settings.get("additional_special_tokens") or []]
    missing = list(dict.fromkeys(t for t in named if t is not None and t not in added))
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in missing])


# -- SentencePiece .model files (protobuf) -----------------------------------------------------------------------------

SPM_UNIGRAM = 1
SPM_NORMAL, SPM_UNKNOWN, SPM_CONTROL, SPM_USER_DEFINED, SPM_UNUSED, SPM_BYTE = 1, 2, 3, 4, 5, 6


# A NamedTuple, not a dataclass: dataclasses need the module registered, and the fixture script loads it by path.
class SentencePieceModel(NamedTuple):
    """What a tokenizer needs from a SentencePiece `ModelProto`: the pieces (text, score, type), the trainer's
    model type, unknown-piece id and byte fallback, and the normalizer's precompiled character map."""

    pieces: tuple[tuple[str, float, int], ...]
    model_type: int = SPM_UNIGRAM
    unk_id: int = 0
    byte_fallback: bool = False
    precompiled_charsmap: bytes = b""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _proto_fields(data: bytes):
    """(field number, value) of each field of a protobuf message: an int for varints, bytes otherwise."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = data[pos:pos + size], pos + size
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
        else:
            raise ValueError(f"unsupported wire type {wire} (field {number})")
        if pos > len(data):
            raise ValueError(f"truncated field {number}")
        if number == 0:
            raise ValueError("field number 0")
        yield number, value


def _int32(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def read_sentencepiece_model(path: str | Path) -> SentencePieceModel:
    """Read a SentencePiece `.model` file (a `ModelProto`: pieces = 1 {piece = 1, score = 2, type = 3},
    trainer_spec = 2 {model_type = 3, byte_fallback = 35, unk_id = 40}, normalizer_spec = 3 {precompiled_charsmap =
    2})."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise _error(f"{path}: cannot read ({e})") from None
    try:
        pieces, trainer, charsmap = [], {}, b""
        for number, value in _proto_fields(data):
            if number == 1:
                piece = {1: b"", 2: struct.pack("<f", 0.0), 3: SPM_NORMAL}
                piece.update(_proto_fields(value))
                pieces.append((piece[1].decode("utf-8"), struct.unpack("<f", piece[2])[0], int(piece[3])))
            elif number == 2:
                trainer.update(_proto_fields(value))
            elif number == 3:
                charsmap = dict(_proto_fields(value)).get(2, b"")
        model = SentencePieceModel(
            pieces=tuple(pieces), model_type=int(trainer.get(3, SPM_UNIGRAM)), unk_id=_int32(trainer.get(40, 0)),
            byte_fallback=bool(trainer.get(35, 0)), precompiled_charsmap=bytes(charsmap))
    except (ValueError, TypeError, AttributeError, struct.error, UnicodeDecodeError) as e:
        raise _error(f"{path}: not a readable SentencePiece model ({e})") from None
    if not model.pieces or not 0 <= model.unk_id < len(model.pieces):
        raise _error(f"{path}: not a readable SentencePiece model ({len(model.pieces)} pieces, "
                     f"unk_id {model.unk_id})")
    if model.model_type != SPM_UNIGRAM:
        raise _error(f"{path}: SentencePiece model type {model.model_type} is not Unigram (1), the only one read here")
    return model


def _sentencepiece_t5(folder: Path, settings: dict[str, Any]) -> Tokenizer:
    """T5's Unigram tokenizer from spiece.model as transformers' T5Tokenizer builds it: the pieces then the
    <extra_id_*> sentinels, the SentencePiece normalization (its precompiled character map), words split at
    whitespace with "▁" in front of each, and `</s>` appended."""
    spm = read_sentencepiece_model(folder / "spiece.model")
    extra_ids = settings.get("extra_ids", T5_EXTRA_IDS)
    if not isinstance(extra_ids, int) or extra_ids < 0:
        raise _error(f"{folder / 'tokenizer_config.json'}: extra_ids must be a count, got {extra_ids!r}")
    vocab = [(piece, score) for piece, score, _ in spm.pieces]
    vocab += [(f"<extra_id_{i}>", 0.0) for i in range(extra_ids - 1, -1, -1)]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=spm.unk_id, byte_fallback=spm.byte_fallback))
    if spm.precompiled_charsmap:
        tokenizer.normalizer = normalizers.Precompiled(spm.precompiled_charsmap)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True),
    ])
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    # The control and unknown pieces and the sentinels are special tokens (matched whole in the text).
    tokenizer.add_special_tokens([AddedToken(piece, normalized=False, special=True) for piece, _, kind in spm.pieces
                                  if kind in (SPM_CONTROL, SPM_UNKNOWN)])
    _add_tokens(tokenizer, folder, settings)
    added = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    tokenizer.add_special_tokens([AddedToken(f"<extra_id_{i}>", normalized=False, special=True)
                                  for i in range(extra_ids) if f"<extra_id_{i}>" not in added])
    eos, eos_id = _special_id(tokenizer, settings, "eos_token", folder / "tokenizer_config.json")
    tokenizer.post_processor = processors.TemplateProcessing(single=f"$A {eos}", pair=f"$A {eos} $B {eos}",
                                                             special_tokens=[(eos, eos_id)])
    return tokenizer


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

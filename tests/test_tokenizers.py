"""Tokenizer folders in the layouts real checkpoints ship: tokenizer.json; vocab.json + merges.txt (CLIP, Qwen);
spiece.model (T5). Ids and attention masks equal transformers' on the prompts recorded by
`scripts/make_fixtures.py --only tokenizers`, called as the diffusers pipelines call them, with the real vocabularies
in ../shared/tokenizers/."""

import importlib.util
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file, save_file

from conftest import FIXTURES
from mxdit.model.loading import CheckpointError
from mxdit.model.pipeline_krea2 import PREFIX_TOKENS, PROMPT_PREFIX, PROMPT_SUFFIX, SUFFIX_TOKENS, template_tokens
from mxdit.model.tokenizer import TextTokenizer, read_sentencepiece_model, save_demo_tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared"  # ../shared from the repository root
TOKENIZERS = SHARED / "tokenizers"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} is absent: the real tokenizer vocabularies "
                                                               "are not on this machine")
PROMPTS = json.loads((FIXTURES / "tokenizers" / "prompts.json").read_text(encoding="utf-8"))
T5_FILES = ("spiece.model", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURES / "tokenizers" / "reference.npz"))


def assert_same_tokens(ids, mask, reference, name):
    """Every prompt's ids and mask equal transformers' (the first differing prompt is named)."""
    assert ids.shape == reference[f"{name}_ids"].shape
    for i, prompt in enumerate(PROMPTS):
        np.testing.assert_array_equal(ids[i], reference[f"{name}_ids"][i], err_msg=f"ids of {prompt[:60]!r}")
        np.testing.assert_array_equal(mask[i], reference[f"{name}_mask"][i], err_msg=f"mask of {prompt[:60]!r}")


@needs_shared
def test_clip_vocab_and_merges_folder_gives_transformers_ids(reference):
    folder = TOKENIZERS / "clip"
    assert not (folder / "tokenizer.json").exists()  # as FLUX.1's tokenizer/ ships
    tokenizer = TextTokenizer.from_folder(folder)
    assert tokenizer.model_max_length == 77 and tokenizer.vocab_size == 49408
    assert_same_tokens(*tokenizer(PROMPTS, max_length=tokenizer.model_max_length), reference, "clip")


@needs_shared
def test_clip_folder_without_configs_is_recognised_from_its_vocabulary(tmp_path, reference):
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(TOKENIZERS / "clip" / name, tmp_path)
    # transformers' CLIPTokenizer defaults: the same ids, but for the special tokens' text in upper case, which
    # tokenizer_config.json's <|startoftext|> (normalized: true) matches after lower-casing and the default does not.
    ids, mask = TextTokenizer.from_folder(tmp_path)(PROMPTS, max_length=77)
    assert_same_tokens(ids, mask, reference, "clip_without_configs")
    assert (ids != reference["clip_ids"]).any(1).sum() == 1


@needs_shared
def test_qwen3_vocab_and_merges_folder_gives_the_krea2_pipeline_ids(reference):
    folder = TOKENIZERS / "qwen3"
    assert not (folder / "tokenizer.json").exists()
    tokenizer = TextTokenizer.from_folder(folder)
    assert_same_tokens(*template_tokens(tokenizer, PROMPTS, 512), reference, "krea2")


@needs_shared
def test_qwen3_vocabulary_gives_minimax_h3_its_verbatim_prompt_ids(reference):
    tokenizer = TextTokenizer.from_folder(TOKENIZERS / "qwen3")
    offsets = reference["minimax_h3_offsets"]
    for i, prompt in enumerate(PROMPTS):
        want = reference["minimax_h3_ids"][offsets[i] : offsets[i + 1]]
        if not len(want):  # the empty prompt: no tokens (the pipeline refuses it)
            continue
        ids, mask = tokenizer([prompt])
        np.testing.assert_array_equal(ids[0], want, err_msg=repr(prompt))
        assert mask.all()


@needs_shared
def test_krea2_template_is_34_prefix_and_5_suffix_tokens_with_the_real_vocabulary(reference):
    tokenizer = TextTokenizer.from_folder(TOKENIZERS / "qwen3")
    prefix, _ = tokenizer([PROMPT_PREFIX])
    suffix, _ = tokenizer([PROMPT_SUFFIX])
    assert prefix.shape == (1, PREFIX_TOKENS) and suffix.shape == (1, SUFFIX_TOKENS)
    np.testing.assert_array_equal(prefix[0], reference["qwen_prefix_ids"])
    np.testing.assert_array_equal(suffix[0], reference["qwen_suffix_ids"])
    # <|im_start|>, <|im_end|> are the added tokens at their ids, matched whole
    assert prefix[0, 0] == suffix[0, 2] == 151644 and suffix[0, 0] == 151645


@needs_shared
@pytest.mark.parametrize("layout", ["spiece.model", "tokenizer.json"])
def test_t5_folder_gives_transformers_ids_at_both_flux_lengths(tmp_path, reference, layout):
    files = T5_FILES if layout == "spiece.model" else T5_FILES + ("tokenizer.json",)
    for name in files:
        shutil.copy(TOKENIZERS / "t5" / name, tmp_path)
    tokenizer = TextTokenizer.from_folder(tmp_path)
    assert tokenizer.vocab_size == 32100 and tokenizer.pad_token_id == 0
    for length in (512, 256):  # FLUX.1-dev, FLUX.1-schnell
        assert_same_tokens(*tokenizer(PROMPTS, max_length=length), reference, f"t5_{length}")


@needs_shared
def test_sentencepiece_reader_reads_the_t5_model():
    model = read_sentencepiece_model(TOKENIZERS / "t5" / "spiece.model")
    assert len(model.pieces) == 32000 and model.unk_id == 2 and model.model_type == 1
    assert [(piece, kind) for piece, _, kind in model.pieces[:4]] == [("<pad>", 3), ("</s>", 3), ("<unk>", 2),
                                                                      ("\u2581", 1)]
    assert model.pieces[3][1] == pytest.approx(-2.0122929) and len(model.precompiled_charsmap) == 237539


# -- a tiny SentencePiece model written here, and the error cases (no ../shared needed) --------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32 fields are 10-byte two's complement
    out = b""
    while value >= 0x80:
        out += bytes([value & 0x7F | 0x80])
        value >>= 7
    return out + bytes([value])


def _message(*fields) -> bytes:
    """A protobuf message of (number, value) fields: int -> varint, float -> fixed32, str/bytes -> length-delimited."""
    out = b""
    for number, value in fields:
        if isinstance(value, float):
            out += _varint(number << 3 | 5) + struct.pack("<f", value)
        elif isinstance(value, int):
            out += _varint(number << 3) + _varint(value)
        else:
            value = value.encode() if isinstance(value, str) else value
            out += _varint(number << 3 | 2) + _varint(len(value)) + value
    return out


TINY_PIECES = [("<pad>", 0.0, 3), ("</s>", 0.0, 3), ("<unk>", 0.0, 2), ("\u2581", -2.0, 1), ("\u2581a", -1.0, 1),
               ("\u2581b", -1.5, 1), ("a", -3.0, 1), ("b", -3.0, 1), ("\u2581ab", -1.0, 1)]


def _tiny_spiece(model_type: int = 1) -> bytes:
    pieces = [(1, _message((1, p), (2, s), (3, t))) for p, s, t in TINY_PIECES]
    trainer = _message((3, model_type), (4, len(TINY_PIECES)), (40, 2), (41, -1), (42, 1), (43, 0))
    return _message(*pieces, (2, trainer), (3, _message((1, "identity"), (3, 1))))


def test_spiece_model_alone_builds_t5s_tokenizer(tmp_path):
    (tmp_path / "spiece.model").write_bytes(_tiny_spiece())
    tokenizer = TextTokenizer.from_folder(tmp_path)
    ids, mask = tokenizer(["ab b", "a  <extra_id_0> c", ""], max_length=6)
    # ▁ab ▁b </s>; ▁a <extra_id_0> ▁ c(unknown) </s>; </s>. Sentinels follow the pieces in reverse: <extra_id_0> last.
    assert ids.tolist() == [[8, 5, 1, 0, 0, 0], [4, 108, 3, 2, 1, 0], [1, 0, 0, 0, 0, 0]]
    assert mask.sum(1).tolist() == [3, 5, 1]
    assert tokenizer.vocab_size == len(TINY_PIECES) + 100


def _bpe_folder(folder: Path, config: dict | None = None, merges: str = "#version: 0.2\na b\n") -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}))
    (folder / "merges.txt").write_text(merges)
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing", "missing: not a folder"),
    (lambda d: d, "no tokenizer files (expected tokenizer.json, vocab.json + merges.txt, or spiece.model)"),
    (lambda d: _bpe_folder(d, {"tokenizer_class": "LlamaTokenizer"}),
     "tokenizer_config.json: tokenizer_class 'LlamaTokenizer' cannot be built without tokenizer.json"),
    (lambda d: _bpe_folder(d, {"tokenizer_class": "T5Tokenizer"}), "tokenizer_class T5Tokenizer needs spiece.model"),
    (lambda d: _bpe_folder(d, merges="#version: 0.2\na b\na b c\n"),
     "merges.txt: line 3 is not a merge of two vocabulary tokens"),
    (lambda d: _bpe_folder(d, merges="a x\n"), "merges.txt: line 1 is not a merge of two vocabulary tokens"),
    (lambda d: (_bpe_folder(d) / "vocab.json").write_text("{not json") and d, "vocab.json: not a readable JSON file"),
    (lambda d: (_bpe_folder(d) / "tokenizer_config.json").write_text("[") and d,
     "tokenizer_config.json: not a readable JSON file"),
    (lambda d: _bpe_folder(d, {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": {
        "9": {"content": "<|im_start|>", "special": True}}}),
     "tokenizer_config.json: added token '<|im_start|>' has id 9 there, but the vocabulary gives it 4"),
    (lambda d: (save_demo_tokenizer(d) / "tokenizer_config.json").write_text('{"pad_token": "<pad>"}') and d,
     "tokenizer_config.json: pad_token '<pad>' is not in the vocabulary"),
    (lambda d: (d / "tokenizer.json").write_text("{}") and d, "tokenizer.json: not a readable tokenizers file"),
    (lambda d: (d / "spiece.model").write_bytes(_tiny_spiece()[:-7]) and d,
     "spiece.model: not a readable SentencePiece model (truncated"),
    (lambda d: (d / "spiece.model").write_bytes(b"\x0f" * 40) and d,
     "spiece.model: not a readable SentencePiece model"),
    (lambda d: (d / "spiece.model").write_bytes(_tiny_spiece(model_type=2)) and d,
     "spiece.model: SentencePiece model type 2 is not Unigram"),
])
def test_bad_tokenizer_folder_is_one_line_naming_the_file(tmp_path, make, message):
    folder = make(tmp_path)
    with pytest.raises(CheckpointError) as error:
        TextTokenizer.from_folder(folder)
    assert message in str(error.value) and "\n" not in str(error.value)


# -- a FLUX.1 folder laid out as released: the real tokenizer files, no tokenizer.json ---------------------------------

spec = importlib.util.spec_from_file_location("generate", Path(__file__).parent.parent / "scripts" / "generate.py")
generate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate)


def _grow_embeddings(folder: Path, rows: dict[str, int], config: dict) -> None:
    """Give a tiny text encoder the real vocabulary's (and CLIP's 77 positions') table sizes: the existing rows, then
    random rows at their scale."""
    file = next(folder.glob("*.safetensors"))
    state = load_file(file)
    rng = np.random.default_rng(0)
    for key, size in rows.items():
        table = state[key]
        extra = rng.normal(0.0, table.std(), (size - table.shape[0], table.shape[1])).astype(table.dtype)
        state[key] = np.concatenate([table, extra])
    save_file(state, file)
    config_file = folder / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **config}, indent=1))


@needs_shared
def test_flux_folder_with_released_tokenizer_files_generates_an_image(tmp_path, capsys):
    folder = tmp_path / "FLUX.1-dev"
    shutil.copytree(FIXTURES / "flux" / "tiny_pipeline", folder)
    for name, source, files in (("tokenizer", "clip", ("vocab.json", "merges.txt", "tokenizer_config.json",
                                                       "special_tokens_map.json")),
                                ("tokenizer_2", "t5", T5_FILES)):
        shutil.rmtree(folder / name)
        (folder / name).mkdir()
        for file in files:
            shutil.copy(TOKENIZERS / source / file, folder / name)
    _grow_embeddings(folder / "text_encoder", {"embeddings.token_embedding.weight": 49408,
                                               "embeddings.position_embedding.weight": 77},
                     {"vocab_size": 49408, "max_position_embeddings": 77})
    _grow_embeddings(folder / "text_encoder_2", {"shared.weight": 32128}, {"vocab_size": 32128})
    out = tmp_path / "x.png"
    # The sizes of test_generate_cli's FLUX run, so that the denoiser and VAE programs come from the compile cache.
    code = generate.main(["--model", str(folder), "--prompt", "A Red Fox 🦊 in the snow, 35mm photo", "--height", "64",
                          "--width", "80", "--steps", "2", "--dtype", "fp32", "--max-sequence-length", "16",
                          "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (80, 64)

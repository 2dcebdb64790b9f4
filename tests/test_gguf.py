"""GGUF transformer files (model/gguf_checkpoint.py) in ComfyUI-GGUF's layout, written by the gguf package's writer
(`scripts/make_fixtures.py --only gguf`): Q8_0 and Q4_0 of the tiny Krea 2 and FLUX.1 transformers, Q4_K of a Krea 2
transformer 256 wide. Each loads as the weights the format's dequantizer makes of it, so the output is diffusers' with
its dequantizers run in float32 to float32 parity; diffusers as its users run it forms d * q in float16."""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES, relative_l2
from mxdit.model.flux import FluxTransformer
from mxdit.model.gguf_checkpoint import GGUFCheckpoint
from mxdit.model.krea2 import Krea2Transformer
from mxdit.model.loading import CheckpointError, iter_params

GGUF = FIXTURES / "gguf"
KREA2_TINY, KREA2_WIDE = FIXTURES / "krea2" / "tiny" / "config.json", GGUF / "krea2_wide" / "config.json"


@pytest.fixture(scope="module")
def references():
    return dict(np.load(GGUF / "reference.npz"))


@pytest.mark.parametrize("name, block_type, config", [("krea2_q8_0", "Q8_0", KREA2_TINY),
                                                      ("krea2_q4_0", "Q4_0", KREA2_TINY),
                                                      ("krea2_wide_q4_k", "Q4_K", KREA2_WIDE)])
def test_krea2_gguf_computes_what_diffusers_computes(name, block_type, config, references):
    file = GGUF / f"{name}.gguf"
    checkpoint = GGUFCheckpoint(file)
    assert checkpoint.block_type("model.diffusion_model.blocks.0.mlp.up.weight") == block_type
    model = Krea2Transformer.from_pretrained(file, jnp.float32, config=config)
    up = dict(iter_params(model))["transformer_blocks.0.ff.up.weight"]
    tensor = next(t for t in gguf.GGUFReader(str(file)).tensors
                  if t.name == "model.diffusion_model.blocks.0.mlp.up.weight")
    np.testing.assert_array_equal(np.asarray(up), gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    r = dict(np.load(FIXTURES / "krea2" / "reference.npz"))
    out = model(r["hidden_states"], r["encoder_hidden_states"], r["timestep"], r["position_ids"],
                r["encoder_attention_mask"])
    assert relative_l2(out, references[name + "_float32"]) <= 2e-6  # measured 2.7e-7 to 3.6e-7
    # diffusers' from_single_file as its users run it: its dequantizers form d * q in float16 (measured 2.3e-4 to
    # 4.0e-4 from that rounding alone)
    assert relative_l2(out, references[name]) <= 1e-3


@pytest.mark.parametrize("name", ["flux_q8_0", "flux_q4_0"])
def test_flux_gguf_computes_what_diffusers_computes(name, references):
    model = FluxTransformer.from_pretrained(GGUF / f"{name}.gguf", jnp.float32,
                                            config=FIXTURES / "flux" / "tiny" / "config.json")
    r = dict(np.load(FIXTURES / "flux" / "reference.npz"))
    out = model(r["hidden_states"], r["encoder_hidden_states"], r["pooled_projections"], r["timestep"], r["img_ids"],
                r["txt_ids"], r["guidance"])
    assert relative_l2(out, references[name + "_float32"]) <= 3e-5  # measured 6.7e-6 and 7.2e-6, as FLUX.1's tiny


def test_what_is_not_a_gguf_file_of_a_model_read_here_is_named(tmp_path):
    broken = tmp_path / "model.gguf"
    broken.write_bytes(b"GGUF but not really")
    with pytest.raises(CheckpointError, match=f"{broken}: not a readable GGUF file"):
        Krea2Transformer.from_pretrained(broken)
    other = tmp_path / "int.gguf"
    writer = gguf.GGUFWriter(str(other), "krea2")
    writer.add_tensor("model.diffusion_model.first.weight", np.zeros((4, 8), np.int8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=f"{other}: tensor 'model.diffusion_model.first.weight' is stored as I8, "
                                              "a GGUF block type mxdit does not read"):
        Krea2Transformer.from_pretrained(other)
    with pytest.raises(CheckpointError, match="flux_q8_0.gguf: not a Krea 2 transformer checkpoint"):
        Krea2Transformer.from_pretrained(GGUF / "flux_q8_0.gguf", jnp.float32)
    with pytest.raises(CheckpointError, match="krea2_q8_0.gguf: not a FLUX transformer checkpoint"):
        FluxTransformer.from_pretrained(GGUF / "krea2_q8_0.gguf", jnp.float32)


def _gguf_copy(source, path, block_type: str | None) -> None:
    """`source`'s tensors (a safetensors file, diffusers' key names) as a GGUF file: F32, or the matrices whose rows
    blocks of 32 divide in `block_type` (Q8_0, Q4_0: the gguf package quantizes those)."""
    from safetensors.numpy import load_file

    writer = gguf.GGUFWriter(str(path), "krea2")
    for name, value in load_file(str(source)).items():
        value = np.asarray(value, np.float32)
        if block_type and name.endswith(".weight") and value.ndim == 2 and value.shape[-1] % 32 == 0:
            kind = gguf.GGMLQuantizationType[block_type]
            writer.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow  # ~10 s on 2 cores: three generate.py runs
def test_generate_reads_the_transformer_from_a_gguf_file(tmp_path, capsys):
    """generate.py --transformer FILE: the folder's other components and config, the transformer's weights from the
    file. An F32 copy of the folder's weights gives the folder's image; Q8_0 one close to it."""
    import importlib.util
    from pathlib import Path

    from PIL import Image

    spec = importlib.util.spec_from_file_location("generate", Path(__file__).parent.parent / "scripts" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    folder = FIXTURES / "krea2" / "tiny_pipeline"
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    _gguf_copy(weights, tmp_path / "f32.gguf", None)
    _gguf_copy(weights, tmp_path / "q8_0.gguf", "Q8_0")
    common = ["--model", str(folder), "--prompt", "a cat", "--height", "64", "--width", "64", "--steps", "2",
              "--dtype", "fp32", "--max-sequence-length", "16", "--compile-cache", ""]
    images = []
    for extra in ([], ["--transformer", str(tmp_path / "f32.gguf")], ["--transformer", str(tmp_path / "q8_0.gguf")]):
        out = tmp_path / f"{len(images)}.png"
        assert generate.main(common + extra + ["--output", str(out)]) == 0, capsys.readouterr().err
        with Image.open(out) as image:
            images.append(np.asarray(image, np.float32))
    np.testing.assert_array_equal(images[1], images[0])
    assert 0 < np.abs(images[2] - images[0]).mean() < 2.0
    with pytest.raises(SystemExit):
        generate.main(["--demo", "--prompt", "x", "--transformer", str(tmp_path / "f32.gguf")])
    assert "--transformer needs --model" in capsys.readouterr().err


def test_quantize_sizes_counts_gguf_files_as_they_are_written(tmp_path):
    """quantize.py --sizes' GGUF rows: llama.cpp's block sizes, and the bytes of a file the converter's way (the
    matrices the blocks divide quantized, the rest F16, 1-D F32) as the writer writes it, but for its header."""
    import importlib.util
    from pathlib import Path

    from safetensors.numpy import load_file

    spec = importlib.util.spec_from_file_location("quantize", Path(__file__).parent.parent / "scripts" / "quantize.py")
    quantize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quantize)
    for kind, size in quantize.GGUF_SIZES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]] == size
    tensors = load_file(str(FIXTURES / "krea2" / "tiny_original.safetensors"))
    shapes = {k: (v.shape, v.dtype) for k, v in tensors.items()}
    reader = gguf.GGUFReader(str(GGUF / "krea2_q8_0.gguf"))
    assert quantize.gguf_file_bytes(shapes, "Q8_0") == sum(int(t.n_bytes) for t in reader.tensors)


@pytest.mark.slow  # ~22 s on 2 cores: six tiny pipelines
def test_a_lora_on_an_int8_or_q4_0_base_acts_as_on_the_float_base(tmp_path):
    """A LoRA applied at run time (its update added after the base's product) on an INT8 base (--precision int8) and
    on a Q4_0 GGUF base changes the transformer's output as it does on the float32 base, about as far off as the
    base's own quantization moves the output: the LoRA's effect measured 2.2% off on INT8 (whose base moves the output
    0.5%) and 15.9% on Q4_0 (whose base moves it 14.8%), relative L2."""
    import jax.numpy as jnp

    from mxdit.model.inference import InferenceOptions, build_pipeline

    folder = FIXTURES / "krea2" / "tiny_pipeline"
    _gguf_copy(folder / "transformer" / "diffusion_pytorch_model.safetensors", tmp_path / "q4_0.gguf", "Q4_0")
    lora = (FIXTURES / "krea2" / "lora" / "diffusers.safetensors", 1.0)
    rng = np.random.default_rng(0)
    config = build_pipeline(folder, InferenceOptions(dtype="float32")).transformer.config
    image_len, text_len = 16, 8
    ids = np.zeros((text_len + image_len, 3), np.float32)
    ids[text_len:, 1], ids[text_len:, 2] = np.arange(image_len) // 4, np.arange(image_len) % 4
    inputs = (jnp.asarray(rng.standard_normal((1, image_len, config.in_channels)), jnp.float32),
              jnp.asarray(rng.standard_normal((1, text_len, config.num_text_layers, config.text_hidden_dim)),
                          jnp.float32), jnp.array([0.6]), jnp.asarray(ids), jnp.ones((1, text_len), bool))

    def output(**options):
        transformer = build_pipeline(folder, InferenceOptions(dtype="float32", stack=False, **options)).transformer
        return np.asarray(transformer(*inputs), np.float64)

    base = output()
    effect = output(loras=(lora,)) - base
    for options, bound in ((dict(precision="int8"), 0.03), (dict(transformer=tmp_path / "q4_0.gguf"), 0.2)):
        quantized = output(**options)
        moved = relative_l2(quantized, base)
        error = relative_l2(output(loras=(lora,), **options) - quantized, effect)
        print(f"{options}: the base moves the output {moved:.3f}; the LoRA's effect is off by {error:.3f}")
        assert error <= bound


@pytest.mark.slow  # ~12 s on 2 cores
def test_fusing_a_lora_into_a_base_that_is_quantized_next_warns_with_the_loss():
    """--fuse-lora with --precision: the update that survives re-quantizing the fused weights, measured layer by
    layer (lora_files.fused_update_loss); at 0.1 of the fixture's LoRA INT8 errs by 44% of it and MXFP4 by 347%,
    where at run time the update is exact."""
    from mxdit.model.inference import FusedLoraWarning, InferenceOptions, build_pipeline

    folder = FIXTURES / "krea2" / "tiny_pipeline"
    lora = (FIXTURES / "krea2" / "lora" / "diffusers.safetensors", 0.1)
    with pytest.warns(FusedLoraWarning, match=r"--precision int8: quantizing the fused weights errs by 44% of"):
        build_pipeline(folder, InferenceOptions(dtype="float32", precision="int8", loras=(lora,), fuse_loras=True))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FusedLoraWarning)
        build_pipeline(folder, InferenceOptions(dtype="float32", loras=(lora,), fuse_loras=True))  # bf16: none
        build_pipeline(folder, InferenceOptions(dtype="float32", precision="int8", loras=(lora,)))  # run time: none


def test_a_gguf_file_in_place_of_the_folders_safetensors(tmp_path):
    """A diffusers transformer/ folder whose weights are one GGUF file (its config.json gives the sizes) loads as
    that file does; two GGUF files are named rather than guessed between."""
    import shutil

    folder = tmp_path / "transformer"
    folder.mkdir()
    shutil.copy(FIXTURES / "krea2" / "tiny" / "config.json", folder)
    shutil.copy(GGUF / "krea2_q4_0.gguf", folder)
    from_folder = dict(iter_params(Krea2Transformer.from_pretrained(folder, jnp.float32)))
    from_file = dict(iter_params(Krea2Transformer.from_pretrained(GGUF / "krea2_q4_0.gguf", jnp.float32,
                                                                  config=KREA2_TINY)))
    for key, value in from_file.items():
        np.testing.assert_array_equal(np.asarray(from_folder[key]), np.asarray(value), err_msg=key)
    shutil.copy(GGUF / "krea2_q8_0.gguf", folder)
    with pytest.raises(CheckpointError, match="several GGUF files \\(krea2_q4_0.gguf, krea2_q8_0.gguf\\)"):
        Krea2Transformer.from_pretrained(folder, jnp.float32)


def test_a_transformer_file_and_a_quantized_checkpoint_are_not_given_together():
    from mxdit.model.inference import InferenceOptions, options_error

    message = "--transformer with --quantized: both name the transformer's weights; give one"
    with pytest.raises(ValueError, match=message):
        InferenceOptions(quantized="q.safetensors", transformer="t.gguf")
    assert options_error(precision="bf16", quantized=True, sharded=False, offload=None, prefetch=2, fuse_loras=False,
                         transformer=True) == message


@pytest.mark.parametrize("name", ["krea2_q8_0", "flux_q8_0"])
def test_q8_0_matrices_stay_in_their_blocks_on_the_device(name):
    """Under `keep_file_blocks` (generate.py's default with a GGUF transformer), each Q8_0 block matrix loads as an
    int8_b32 QuantizedArray holding the file's own codes and scales (FLUX.1's fused projections as their row
    ranges), dequantized for each product: the output of the weights dequantized on read, in a bit more than half
    the device bytes of bf16."""
    from mxdit.model.loading import keep_file_blocks
    from mxdit.quant.formats import QuantizedArray
    from mxdit.quant.model import any_family_rules, format_for

    flux = name.startswith("flux")
    build = FluxTransformer if flux else Krea2Transformer
    config = FIXTURES / "flux" / "tiny" / "config.json" if flux else KREA2_TINY
    rules = any_family_rules("int8_b32")
    with keep_file_blocks(lambda key: (format_for(key, (1, 1), rules),)):  # int8_b32
        kept = build.from_pretrained(GGUF / f"{name}.gguf", jnp.float32, config=config)
    plain = dict(iter_params(build.from_pretrained(GGUF / f"{name}.gguf", jnp.float32, config=config)))
    blocks = {k: v for k, v in iter_params(kept) if isinstance(v, QuantizedArray)}
    selected = [k for k, v in plain.items() if format_for(k, v.shape, rules) and v.shape[1] % 32 == 0]
    assert sorted(blocks) == sorted(selected) and blocks
    for key, q in blocks.items():
        assert q.fmt == "int8_b32" and q.data.dtype == jnp.int8 and q.scale.dtype == jnp.float16
        np.testing.assert_array_equal(np.asarray(q.dequantize()), np.asarray(plain[key]), err_msg=key)
    stored = sum(q.nbytes for q in blocks.values())
    assert stored == sum(plain[k].size for k in blocks) * 34 // 32  # Q8_0's 34 bytes a block of 32
    reference = dict(np.load(FIXTURES / ("flux" if flux else "krea2") / "reference.npz"))
    names = (("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids",
              "guidance") if flux else
             ("hidden_states", "encoder_hidden_states", "timestep", "position_ids", "encoder_attention_mask"))
    args = [reference[k] for k in names]
    whole = build.from_pretrained(GGUF / f"{name}.gguf", jnp.float32, config=config)
    np.testing.assert_array_equal(np.asarray(kept(*args)), np.asarray(whole(*args)))


def test_generate_keeps_q8_0_blocks_unless_a_precision_is_asked(tmp_path):
    """build_pipeline with a Q8_0 transformer file: int8_b32 block matrices at the default precision; with
    --precision the file's values quantized into that format, as before."""
    from mxdit.model.inference import InferenceOptions, build_pipeline
    from mxdit.pallas_kernels.gemm import GemmWeight
    from mxdit.quant.formats import QuantizedArray

    folder = FIXTURES / "krea2" / "tiny_pipeline"
    _gguf_copy(folder / "transformer" / "diffusion_pytorch_model.safetensors", tmp_path / "q8_0.gguf", "Q8_0")
    for options, kind in ((dict(), QuantizedArray), (dict(precision="int8"), GemmWeight)):
        transformer = build_pipeline(folder, InferenceOptions(dtype="float32", transformer=tmp_path / "q8_0.gguf",
                                                              **options)).transformer
        ff = transformer.transformer_blocks[0].ff  # stacked with gate into gate_up where the format allows
        weight = (ff.up or ff.gate_up).weight.get_value()
        assert isinstance(weight, kind), (options, type(weight))

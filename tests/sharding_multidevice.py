"""Multi-device checks of sharding/ on 8 simulated CPU devices (float32, tiny Krea 2 transformer).

The device count is fixed when jax loads, so this module runs in its own process: tests/test_sharding.py starts it,
or by hand:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q -s tests/sharding_multidevice.py

(its name does not match test_*.py, so the main test run collects it only through that child process). `-s` prints
the measured relative L2 errors and collective counts.
"""

import contextlib
import dataclasses
import functools
import importlib.util
import logging
import os
import re
import sys
from pathlib import Path

if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import relative_l2
from mxdit.model.krea2 import Krea2Config, Krea2Transformer
from mxdit.model.pipeline_krea2 import demo_pipeline, denoise_step
from mxdit.sharding.attention import SequenceParallelAttention, ring_attention, ulysses_attention
from mxdit.sharding.krea2 import krea2_denoise_step, shard_krea2_pipeline
from mxdit.sharding.mesh import BATCH_AXES, activation_rules, batch_sharding, make_mesh, param_shardings

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set XLA_FLAGS before jax loads")

# The demo pipeline's transformer: 8 query heads, 2 KV heads, head_dim 32, 4 layers.
CONFIG = Krea2Config(
    in_channels=64, num_layers=4, attention_head_dim=32, num_attention_heads=8, num_key_value_heads=2,
    intermediate_size=512, timestep_embed_dim=64, text_hidden_dim=64, num_text_layers=4, text_num_attention_heads=4,
    text_num_key_value_heads=4, text_intermediate_size=128, axes_dims_rope=(8, 12, 12),
)
# 2 images of 4x3 tokens, 13 text tokens of which some are padding: the joint sequence of 25 tokens divides by none
# of 2, 4, 8, so every seq degree also checks the step's text padding.
BATCH, TEXT, GRID = 2, 13, (4, 3)
TEXT_LENGTHS = (5, 13, 1, 9)  # [conditional; unconditional] real text tokens
TOLERANCE = 1e-5


def _model(config: Krea2Config = CONFIG):
    return Krea2Transformer(config, dtype=jnp.float32, attention="xla", rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))


@pytest.fixture(scope="module")
def model():
    return _model()


def _inputs(cfg: bool):
    rng = np.random.default_rng(0)
    image_len = GRID[0] * GRID[1]
    rows = 2 * BATCH if cfg else BATCH
    latents = rng.standard_normal((BATCH, image_len, CONFIG.in_channels), np.float32)
    embeds = rng.standard_normal((rows, TEXT, CONFIG.num_text_layers, CONFIG.text_hidden_dim), np.float32)
    mask = np.arange(TEXT)[None, :] < np.asarray(TEXT_LENGTHS[:rows])[:, None]
    ids = np.zeros((TEXT + image_len, 3), np.float32)
    ids[TEXT:, 1], ids[TEXT:, 2] = np.divmod(np.arange(image_len), GRID[1])
    # sigma 1 -> 0: the step's update is minus the (guided) velocity, which is what the comparison measures.
    scalars = (np.float32(0.7), np.float32(1.0), np.float32(0.0), np.float32(4.5))
    return tuple(jnp.asarray(x) for x in (latents, embeds, mask, ids, *scalars))


@pytest.fixture(scope="module")
def reference(model):
    """The unsharded step's update (next latents - latents), with and without CFG."""
    step = functools.partial(denoise_step, model)
    out = {}
    for cfg in (True, False):
        args = _inputs(cfg)
        out[cfg] = np.asarray(step(*args, cfg)) - np.asarray(args[0])
    return out


@pytest.mark.parametrize("mesh_text, cfg, method, weights", [
    ("seq=2", True, None, "replicated"),     # Ulysses, KV heads split
    ("seq=4", True, None, "replicated"),     # Ulysses, KV heads repeated to 4
    ("seq=8", True, None, "replicated"),     # Ulysses, one query head and one KV head per device
    ("seq=8", True, "ring", "replicated"),
    ("cfg=2", True, None, "replicated"),
    ("data=2", False, None, "replicated"),   # data parallel alone: the batch of 2 prompts split
    ("data=2,cfg=2,seq=2", True, None, "replicated"),
    ("data=2,seq=4", False, None, "sharded"),  # data parallel without CFG; weights spread over all 8 devices
])
def test_sharded_step_equals_unsharded(model, reference, mesh_text, cfg, method, weights, caplog):
    mesh = make_mesh(mesh_text)
    step = krea2_denoise_step(model, mesh, method=method, weights=weights)
    args = _inputs(cfg)
    out = step(*args, cfg)
    assert out.sharding.device_set == {jax.devices()[0]}
    error = relative_l2(np.asarray(out) - np.asarray(args[0]), reference[cfg])
    print(f"\n{mesh_text} cfg={cfg} method={method or 'auto'} weights={weights}: relative L2 {error:.2e}")
    assert error <= TOLERANCE
    # The next step takes the output as it is, without compiling again.
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        step(out, *args[1:], cfg)
    assert [r.getMessage() for r in caplog.records if "sharded_step" in r.getMessage()] == []


_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*?) (all-to-all|all-gather|collective-permute|all-reduce|"
                         r"reduce-scatter)(?:-start)?\(", re.M)


def _collectives(hlo: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(kind, result shapes) of every collective in compiled HLO text."""
    return [(kind, [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", result)])
            for result, kind in _COLLECTIVE.findall(hlo)]


@pytest.mark.parametrize("mesh_text", ["seq=2", "seq=4"])
def test_ulysses_step_has_two_all_to_alls_per_layer_and_no_activation_gather(model, mesh_text):
    """Per joint attention layer: one all-to-all takes q, k, v from sequence-split to head-split, one takes the
    output back. Nothing else moves activations: the only other collectives carry the (batch, tokens,
    in_channels) velocity to its replicated output."""
    step = krea2_denoise_step(model, make_mesh(mesh_text))
    hlo = step.lower(*_inputs(False), cfg=False).compile().as_text()
    collectives = _collectives(hlo)
    all_to_alls = [shapes for kind, shapes in collectives if kind == "all-to-all"]
    others = [(kind, shapes) for kind, shapes in collectives if kind != "all-to-all"]
    print(f"\n{mesh_text}: {len(all_to_alls)} all-to-alls for {CONFIG.num_layers} layers; others: {others}")
    assert len(all_to_alls) == 2 * CONFIG.num_layers
    assert all(shape[-1] == CONFIG.attention_head_dim for shapes in all_to_alls for shape in shapes)
    assert all(shape[-1] == CONFIG.in_channels for _, shapes in others for shape in shapes)  # no activation gather


@pytest.mark.parametrize("degree", [2, 8])
def test_ulysses_and_ring_attention_equal_unsharded_with_key_lengths(degree):
    rng = np.random.default_rng(degree)
    batch, seq, heads, kv_heads, dim = 2, 32, 8, 2, 16
    q = jnp.asarray(rng.standard_normal((batch, seq, heads, dim), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((batch, seq, kv_heads, dim), np.float32)) for _ in range(2))
    lengths = jnp.asarray([11, 29], jnp.int32)  # keys end inside a device's block, not at its edge
    expected = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths)
    mesh = make_mesh(f"seq={degree}")
    for attention in (ulysses_attention, ring_attention):
        for key_lengths, want in ((lengths, expected), (None, jax.nn.dot_product_attention(q, k, v))):
            out = jax.jit(lambda *a, f=attention: f(*a, mesh=mesh))(q, k, v, key_lengths)
            error = relative_l2(out, want)
            print(f"\n{attention.__name__} seq={degree} lengths={key_lengths is not None}: relative L2 {error:.2e}")
            assert error <= TOLERANCE


def test_bad_degrees_are_refused_or_fall_back_to_ring(model):
    q = jnp.zeros((1, 16, 6, 8))
    k = jnp.zeros((1, 16, 2, 8))
    with pytest.raises(ValueError, match="6 query heads divisible by the mesh's seq=4; use ring"):
        ulysses_attention(q, k, k, None, mesh=make_mesh("seq=4"))
    assert SequenceParallelAttention(make_mesh("seq=4")).method_for(6) == "ring"
    assert SequenceParallelAttention(make_mesh("seq=4")).method_for(8) == "ulysses"
    with pytest.raises(ValueError, match="mesh tensor=2: tensor parallelism is not implemented"):
        krea2_denoise_step(model, make_mesh("tensor=2"))
    k = jnp.zeros((1, 12, 2, 8))
    with pytest.raises(ValueError, match="sequence length 12 is not divisible by the mesh's seq=8"):
        ring_attention(jnp.zeros((1, 12, 8, 8)), k, k, None, mesh=make_mesh("seq=8"))


# --------------------------------------------------------------------------------------------------------------------
# The pipeline and the command line


def test_sharded_pipeline_and_generate_cli(tmp_path, monkeypatch, capsys):
    """Krea 2 Base (CFG) end to end on cfg=2,seq=2,data=2 equals the one-device pipeline; generate.py --mesh runs."""
    pipe = demo_pipeline(tmp_path / "tokenizer", seed=0, dtype=jnp.float32, distilled=False)
    kwargs = dict(height=64, width=64, num_inference_steps=2, guidance_scale=4.5, max_sequence_length=8,
                  output_type="np", seed=3)
    prompts = ["a red fox", "a small house by the lake"]
    expected = pipe(prompts, **kwargs)
    out = shard_krea2_pipeline(pipe, make_mesh("cfg=2,seq=2,data=2"))(prompts, **kwargs)
    latent_error, image_error = relative_l2(out.latents, expected.latents), relative_l2(out.images, expected.images)
    with capsys.disabled():
        print(f"\npipeline cfg=2,seq=2,data=2: latents relative L2 {latent_error:.2e}, images {image_error:.2e}")
    assert latent_error <= TOLERANCE and image_error <= TOLERANCE

    spec = importlib.util.spec_from_file_location("generate", Path(__file__).parent.parent / "scripts" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    monkeypatch.setattr("mxdit.model.pipeline_krea2.demo_pipeline", lambda *args, **kw: pipe)  # built once
    output = tmp_path / "x.png"
    code = generate.main(["--demo", "--prompt", "a", "--prompt", "b", "--mesh", "cfg=2,seq=2,data=2", "--height", "64",
                          "--width", "64", "--steps", "1", "--max-sequence-length", "8", "--output", str(output)])
    assert code == 0 and (tmp_path / "x_0.png").is_file() and (tmp_path / "x_1.png").is_file(), capsys.readouterr().err
    prompts_file = tmp_path / "prompts.txt"  # many images, data-parallel: 3 lines in batches of 2 (the last padded)
    prompts_file.write_text("a\nb\nc\n")
    for start in ("first", "second"):  # the second from the first's stored programs, on a host of 8 devices
        code = generate.main(["--demo", "--prompts", str(prompts_file), "--mesh", "data=2", "--batch-size", "2",
                              "--height", "64", "--width", "64", "--steps", "1", "--max-sequence-length", "8",
                              "--compile-cache", str(tmp_path / "cache"), "--overwrite",
                              "--output", str(tmp_path / "p.png")])
        assert code == 0 and all((tmp_path / f"p_{n}.png").is_file() for n in (1, 2, 3)), capsys.readouterr().err
    code = generate.main(["--demo", "--prompt", "a", "--mesh", "seq=16", "--output", str(tmp_path / "y.png")])
    err = capsys.readouterr().err
    assert code == 2 and "--mesh: mesh seq=16: needs 16 devices, which does not divide the 8 devices" in err


def test_lora_weights_change_per_batch_on_a_mesh():
    """LoRA slots on a data-parallel pipeline: new weights keep the adapters where sharding placed them, and the same
    weights give the image they give on one device."""
    from conftest import FIXTURES
    from mxdit.model.inference import InferenceOptions, build_pipeline
    from mxdit.model.requests import GenerationRequest, generate_batch
    from mxdit.sharding.mesh import make_mesh

    loras = ((FIXTURES / "krea2" / "lora" / "kohya.safetensors", 1.0),)
    folder = FIXTURES / "krea2" / "tiny_pipeline"
    sharded = build_pipeline(folder, InferenceOptions(dtype="float32", loras=loras, swap_loras=True,
                                                      mesh=make_mesh("data=2")))
    single = build_pipeline(folder, InferenceOptions(dtype="float32", loras=loras, swap_loras=True))
    requests = [GenerationRequest(prompt=p, seed=i, height=64, width=64, steps=1, loras=(("kohya", 0.25),))
                for i, p in enumerate(["a cat", "a dog"])]
    kwargs = dict(max_sequence_length=16)
    first, _ = generate_batch(sharded, requests, lora_slots=sharded.lora_slots, **kwargs)
    again, _ = generate_batch(sharded, [dataclasses.replace(r, loras=()) for r in requests],
                              lora_slots=sharded.lora_slots, **kwargs)  # all off, then on again
    expected, _ = generate_batch(single, requests, lora_slots=single.lora_slots, **kwargs)
    off = np.asarray(again[0], np.float32)
    assert np.abs(np.asarray(first[0], np.float32) - off).mean() > 0.5  # the weight changed the picture
    for a, b in zip(first, expected, strict=True):
        assert np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max() <= 2.0


# --------------------------------------------------------------------------------------------------------------------
# FSDP training


def _flow_matching_batch(batch: int = 8):
    rng = np.random.default_rng(1)
    image_len, text = 6, 4
    x0 = rng.standard_normal((batch, image_len, CONFIG.in_channels), np.float32)
    noise = rng.standard_normal(x0.shape, np.float32)
    t = rng.uniform(0.05, 0.95, (batch,)).astype(np.float32)
    embeds = rng.standard_normal((batch, text, CONFIG.num_text_layers, CONFIG.text_hidden_dim), np.float32)
    mask = np.arange(text)[None, :] < rng.integers(1, text + 1, (batch, 1))
    ids = np.zeros((text + image_len, 3), np.float32)
    ids[text:, 1], ids[text:, 2] = np.divmod(np.arange(image_len), 3)
    return x0, noise, t, embeds, mask, ids


TRAIN_CONFIG = dataclasses.replace(CONFIG, num_layers=2, num_layerwise_text_blocks=1, num_refiner_text_blocks=1)


def _train(model, mesh=None, steps: int = 2):
    """AdamW steps of the flow-matching loss over all of `model`'s parameters (left unchanged); returns (losses,
    gradients (flat, per step), params)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optax.adamw(1e-3, weight_decay=0.01)

    def loss_fn(params, rest, x0, noise, t, embeds, mask, ids):
        model = nnx.merge(graphdef, params, rest)
        xt = (1 - t)[:, None, None] * x0 + t[:, None, None] * noise
        return jnp.mean((model(xt, embeds, t, ids, mask) - (noise - x0)) ** 2)

    def train_step(params, opt_state, rest, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, rest, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    batch = _flow_matching_batch()
    if mesh is None:
        step = jax.jit(train_step)
    else:
        shardings = param_shardings(params, mesh, ("fsdp",))
        params = jax.device_put(params, shardings)
        rest = jax.device_put(rest, NamedSharding(mesh, P()))
        batch = tuple(jax.device_put(x, batch_sharding(mesh, np.ndim(x))) for x in batch[:-1]) + (
            jax.device_put(batch[-1], NamedSharding(mesh, P())),)
        step = jax.jit(train_step, out_shardings=(shardings, None, NamedSharding(mesh, P()), shardings))
    opt_state = jax.jit(optimizer.init)(params)  # one compile, not one per parameter shape
    losses, grads = [], []
    for _ in range(steps):
        with contextlib.nullcontext() if mesh is None else activation_rules(mesh):
            params, opt_state, loss, g = step(params, opt_state, rest, *batch)
        losses.append(float(loss))
        grads.append(_flat(g))
    return losses, grads, params


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


def test_fsdp_training_steps_equal_single_device_steps():
    mesh = make_mesh("fsdp=4,data=2")
    assert BATCH_AXES == ("cfg", "data", "fsdp")
    model = _model(TRAIN_CONFIG)
    losses, grads, params = _train(model)
    sharded_losses, sharded_grads, sharded_params = _train(model, mesh)
    # The big matrices really are split 4 ways over fsdp (and replicated over data).
    ff = sharded_params["transformer_blocks"][0]["ff"]["gate"]["weight"][...]
    assert ff.sharding.spec == P(("fsdp",), None) and ff.addressable_shards[0].data.shape == (128, 256)
    initial = _flat(nnx.state(model, nnx.Param))
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(sharded_losses, losses))
    grad_error = max(relative_l2(a, b) for a, b in zip(sharded_grads, grads))
    param_error = relative_l2(_flat(sharded_params), _flat(params))
    # Reported, not bounded: Adam divides by sqrt(v) + eps, so a gradient element near 1e-8 (a few hundred of them
    # here) moves its update by a large fraction for a rounding-level change of the gradient.
    update_error = relative_l2(_flat(sharded_params) - initial, _flat(params) - initial)
    print(f"\nFSDP fsdp=4,data=2, 2 AdamW steps: losses {losses} vs {sharded_losses}; relative errors: loss "
          f"{loss_error:.2e}, gradients {grad_error:.2e}, params {param_error:.2e} (updates alone {update_error:.2e})")
    assert loss_error <= TOLERANCE and grad_error <= TOLERANCE and param_error <= TOLERANCE


def test_lora_training_on_a_data_by_fsdp_mesh_equals_one_device(tmp_path):
    """training.train.train (the LoRA trainer behind scripts/train_lora.py --mesh) on data=2,fsdp=4: the frozen
    weights split over fsdp, each micro-batch over all 8 devices; the LoRA weights after 3 steps equal the
    one-device run's."""
    from test_lora_training import write_photo_patches

    from mxdit.model.lora import LoraConfig, remove_lora
    from mxdit.training.train import TrainConfig, TrainError, train

    write_photo_patches(tmp_path / "photos")
    pipe = demo_pipeline(tmp_path / "tokenizer", seed=0, dtype=jnp.float32, distilled=False)
    config = TrainConfig(steps=3, batch_size=8, learning_rate=1e-2, resolution=32, bucket_multiple=16, aspects=(1.0,),
                         max_sequence_length=16, save_every=100, seed=0)
    lora = LoraConfig(rank=4, alpha=4)
    mesh = make_mesh("data=2,fsdp=4")
    single = train(pipe, tmp_path / "photos", tmp_path / "one", config, lora, model_tag="demo",
                   cache_dir=tmp_path / "cache", progress=False)
    remove_lora(pipe.transformer)
    sharded = train(pipe, tmp_path / "photos", tmp_path / "mesh", config, lora, model_tag="demo",
                    cache_dir=tmp_path / "cache", progress=False, mesh=mesh)
    leaf = jax.tree.leaves(sharded.lora)[0]
    assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh.shape["fsdp"] == 4
    losses = [loss for _, loss in single.losses]
    sharded_losses = [loss for _, loss in sharded.losses]
    error = relative_l2(_flat(sharded.lora), _flat(single.lora))
    print(f"\nLoRA training data=2,fsdp=4 vs one device: losses {sharded_losses} vs {losses}; LoRA rel L2 {error:.2e}")
    np.testing.assert_allclose(sharded_losses, losses, rtol=1e-6)
    # The LoRA weights are all update (B starts at zero), and Adam's g / (sqrt(v) + eps) turns rounding-level changes
    # of near-zero gradient elements into visible ones (see the FSDP test above, whose gradients agree to 1e-5):
    # measured 1.3e-5 after 3 steps at lr 1e-2.
    assert error <= 4e-5
    remove_lora(pipe.transformer)
    with pytest.raises(TrainError, match="--batch-size of 3 does not split"):
        train(pipe, tmp_path / "photos", tmp_path / "bad", dataclasses.replace(config, batch_size=3), lora,
              model_tag="demo", cache_dir=tmp_path / "cache", progress=False, mesh=mesh)


# --------------------------------------------------------------------------------------------------------------------
# MiniMax H3: one video's packed sequence over seq


@pytest.fixture(scope="module")
def h3_case():
    """The tiny H3 transformer (3 heads) and the first denoising step's inputs of its fixture layout."""
    from mxdit.model import pipeline_minimax_h3 as h3
    from mxdit.model.minimax_h3 import MiniMaxH3Transformer

    fixtures = Path(__file__).parent / "fixtures" / "minimax_h3"
    model = MiniMaxH3Transformer.from_pretrained(fixtures / "tiny", dtype=jnp.float32)
    ref = dict(np.load(fixtures / "denoising_reference.npz"))
    patch = model.config.patch_size
    layout = h3.packed_layout(ref["prompt_embeds"].shape[1], int(ref["num_latent_frames"]), int(ref["latent_height"]),
                              int(ref["latent_width"]), int(ref["num_audio_latents"]), patch)
    (sigma, audio_sigma), *_ = h3._schedules(int(ref["steps"]))
    args = (jnp.asarray(ref["prompt_embeds"]), h3.patchify(jnp.asarray(ref["initial_latents"]), patch),
            jnp.asarray(ref["initial_audio_rows"])[None], h3.layout_arrays(layout), sigma, audio_sigma)
    # the jitted unsharded step: eager rounds the rows' update differently (4e-6 of the step, which is 1% of the rows)
    return model, args, h3._step(model, *args), layout.length


def _h3_mesh(degree: int):
    return make_mesh(f"seq={degree}", jax.devices()[:degree])


@pytest.mark.parametrize("degree, method, weights", [
    (3, None, "replicated"),   # Ulysses: 3 heads over 3 devices
    (2, None, "replicated"),   # ring: 3 heads do not divide by 2
    (8, "ring", "sharded"),
    (3, None, "sharded"),
])
def test_sharded_minimax_h3_step_equals_unsharded(h3_case, degree, method, weights, caplog):
    from mxdit.sharding.minimax_h3 import minimax_h3_denoise_step

    model, args, expected, length = h3_case
    mesh = _h3_mesh(degree)
    step = minimax_h3_denoise_step(model, mesh, method=method, weights=weights)
    out = step(*args)
    assert all(x.sharding.device_set == {jax.devices()[0]} for x in out)
    errors = [relative_l2(np.asarray(o) - np.asarray(a), np.asarray(e) - np.asarray(a))
              for o, e, a in zip(out, expected, args[1:3])]
    print(f"\nH3 seq={degree} ({length} rows, padded by {-length % mesh.shape['seq']}) method={method or 'auto'} "
          f"weights={weights}: relative L2 of the steps {errors[0]:.2e} video, {errors[1]:.2e} audio")
    assert max(errors) <= TOLERANCE  # measured 1.7e-7 to 1.2e-6 (ring over 8)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):  # the next step compiles nothing
        step(args[0], *out, *args[3:])
    assert [r.getMessage() for r in caplog.records if "sharded_step" in r.getMessage()] == []


def test_minimax_h3_ulysses_has_two_all_to_alls_per_block(h3_case):
    from mxdit.sharding.minimax_h3 import minimax_h3_denoise_step

    model, args, _, _ = h3_case
    hlo = minimax_h3_denoise_step(model, _h3_mesh(3)).lower(*args).compile().as_text()
    all_to_alls = [shapes for kind, shapes in _collectives(hlo) if kind == "all-to-all"]
    assert len(all_to_alls) == 2 * model.config.num_layers
    assert all(shape[-1] == model.config.attention_head_dim for shapes in all_to_alls for shape in shapes)


def test_minimax_h3_meshes_other_than_seq_are_refused(h3_case):
    from mxdit.sharding.minimax_h3 import minimax_h3_denoise_step

    with pytest.raises(ValueError, match="over seq alone .*, not data"):
        minimax_h3_denoise_step(h3_case[0], make_mesh("data=2,seq=2"))


def test_sharded_video_pipeline_makes_the_same_video(tmp_path, capsys):
    """`shard_minimax_h3_pipeline` (generate_video.py --mesh) on the demo pipeline: the unsharded latents; a mesh
    that splits anything but the sequence is refused by the script in one line."""
    from mxdit.model.pipeline_minimax_h3 import demo_pipeline
    from mxdit.sharding.minimax_h3 import shard_minimax_h3_pipeline

    kwargs = dict(height=32, width=64, num_steps=3, seed=1)
    expected = demo_pipeline(tmp_path / "tok")("a red fox", **kwargs)
    out = shard_minimax_h3_pipeline(demo_pipeline(tmp_path / "tok2"), make_mesh("seq=2"))("a red fox", **kwargs)
    error = relative_l2(out.latents, expected.latents)
    with capsys.disabled():
        print(f"\nH3 demo pipeline over seq=2: latents relative L2 {error:.2e}")
    assert error <= TOLERANCE  # measured 6.1e-8
    spec = importlib.util.spec_from_file_location("generate_video", Path(__file__).parent.parent / "scripts" /
                                                  "generate_video.py")
    generate_video = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate_video)
    assert generate_video.main(["--demo", "--prompt", "x", "--mesh", "data=2", "--output",
                                str(tmp_path / "x.mp4")]) == 2
    assert "over seq alone" in capsys.readouterr().err and not (tmp_path / "x.mp4").exists()

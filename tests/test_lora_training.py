"""training/train.py on the demo Krea 2 pipeline (random weights, float32, CPU; its transformer one block of each
kind) with real photographs: patches of scikit-image's sample images at 32x32. The loss falls; resuming is exact;
gradient accumulation equals one big batch; bad input gets a one-line error and leaves the run folder as it was; the
CLI."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from PIL import Image

from conftest import relative_l2
from mxdit.model.lora import LoraConfig, remove_lora
from mxdit.model.pipeline_krea2 import demo_pipeline
from mxdit.training import data as data_lib
from mxdit.training.lora import add_lora
from mxdit.training.train import (TrainConfig, TrainError, jit_accumulated_gradients, make_batch, make_optimizer,
                                  train)

skimage_data = pytest.importorskip("skimage.data")

LORA = LoraConfig(rank=4, alpha=4)
CONFIG = TrainConfig(steps=32, batch_size=4, learning_rate=1e-2, resolution=32, bucket_multiple=16,
                     aspects=(1.0,), max_sequence_length=16, save_every=10, keep_checkpoints=2, seed=0)


def write_photo_patches(folder: Path, per_photo: int = 6) -> None:
    """24 patches of four sample photographs, most square, a few wide and tall (so three buckets)."""
    folder.mkdir(parents=True)
    photos = {"astronaut": skimage_data.astronaut(), "coffee": skimage_data.coffee(),
              "cat": skimage_data.chelsea(), "rocket": skimage_data.rocket()}
    for name, photo in photos.items():
        height, width = photo.shape[:2]
        for i in range(per_photo):
            h, w = {0: (48, 96), 1: (96, 48)}.get(i, (96, 96))
            y, x = (i * 53) % (height - h), (i * 97) % (width - w)
            Image.fromarray(photo[y : y + h, x : x + w]).save(folder / f"{name}_{i}.png")
            (folder / f"{name}_{i}.txt").write_text(f"a photo of a {name}")


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("photos") / "data"
    write_photo_patches(folder)
    return folder


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    """The demo pipeline with a transformer of one joint, one layerwise and one refiner block (the training treats
    every block alike, and compiles and steps the smaller one faster)."""
    from mxdit.model.krea2 import Krea2Transformer
    from mxdit.model.pipeline_krea2 import Krea2Pipeline

    demo = demo_pipeline(tmp_path_factory.mktemp("tokenizer"), seed=0, dtype=jnp.float32, distilled=False)
    one_block = dataclasses.replace(demo.transformer.config, num_layers=1, num_layerwise_text_blocks=1,
                                    num_refiner_text_blocks=1)
    transformer = Krea2Transformer(one_block, dtype=jnp.float32, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    return Krea2Pipeline(transformer, demo.vae, demo.text_encoder, demo.tokenizer, demo.config)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")  # shared: the photos are encoded once for the whole module


def fresh(pipe):
    remove_lora(pipe.transformer)
    return pipe


@pytest.fixture(scope="module")
def trained(pipe, photos, cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    result = train(fresh(pipe), photos, out, CONFIG, LORA, model_tag="demo", cache_dir=cache, progress=False)
    return result


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_loss_falls_on_real_photographs(trained):
    losses = [loss for _, loss in trained.losses]
    assert len(losses) == CONFIG.steps and all(np.isfinite(losses))
    first, last = np.mean(losses[:8]), np.mean(losses[-8:])
    print(f"loss: first 8 steps {first:.4f}, last 8 steps {last:.4f}")
    assert last < 0.8 * first
    out = trained.output_dir
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, CONFIG.steps + 1))
    assert {"loss", "grad_norm", "lr", "seconds", "epoch"} <= set(rows[0])
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [30, 32]  # keeps the last 2
    from safetensors.numpy import load_file

    saved = load_file(out / "lora.safetensors")
    assert saved["transformer.transformer_blocks.0.attn.to_q.lora_A.weight"].shape == (4, 256)
    np.testing.assert_array_equal(saved["transformer.transformer_blocks.0.attn.to_q.lora_B.weight"],
                                  trained.lora["transformer_blocks"][0]["attn"]["to_q"]["lora"]["B"][...])


def test_buckets_by_aspect_ratio(photos):
    buckets = data_lib.make_buckets(32, (0.5, 1.0, 2.0), 16)
    assert buckets == [(48, 16), (32, 32), (16, 48)]
    sizes = {data_lib.nearest_bucket(data_lib.image_size(e.image), buckets) for e in data_lib.read_folder(photos)}
    assert sizes == set(buckets)
    batches = data_lib.epoch_batches([(1, 1)] * 5 + [(2, 1)] * 3, 2, seed=0, epoch=0)
    assert all(len(b) == 2 and (max(b) < 5 or min(b) >= 5) for b in batches) and len(batches) == 5
    assert batches == data_lib.epoch_batches([(1, 1)] * 5 + [(2, 1)] * 3, 2, seed=0, epoch=0)


def test_resume_is_exact(trained, pipe, photos, cache, tmp_path):
    """The same config as `trained` (32 steps straight), stopped after 16 steps and resumed in a new call."""
    half = train(fresh(pipe), photos, tmp_path / "halves", CONFIG, LORA, model_tag="demo", cache_dir=cache,
                 stop_at=16, progress=False)
    assert half.step == 16 and not (tmp_path / "halves" / "lora.safetensors").exists()
    # how often to save and to validate may change on resume (they do not enter the weights)
    validated = dataclasses.replace(CONFIG, save_every=7, validate_every=8, validation_prompts=("a cat",),
                                    validation_steps=1)
    resumed = train(fresh(pipe), photos, tmp_path / "halves", validated, LORA, model_tag="demo", cache_dir=cache,
                    resume=True, progress=False)
    assert sorted(int(p.name) for p in (tmp_path / "halves" / "checkpoints").iterdir()) == [28, 32]
    assert sorted(p.name for p in (tmp_path / "halves" / "validation").iterdir()) == ["step_000024_0.png",
                                                                                        "step_000032_0.png"]
    assert resumed.step == 32 and [s for s, _ in resumed.losses] == list(range(17, 33))
    assert [loss for _, loss in half.losses + resumed.losses] == [loss for _, loss in trained.losses]
    for a, b in zip(jax.tree.leaves(trained.lora), jax.tree.leaves(resumed.lora), strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit
    from safetensors.numpy import load_file

    files = [load_file(folder / "lora.safetensors") for folder in (tmp_path / "halves", trained.output_dir)]
    assert files[0].keys() == files[1].keys()
    for key in files[0]:
        np.testing.assert_array_equal(files[0][key], files[1][key])


@pytest.mark.slow  # ~35 s on 2 cores
def test_gradient_accumulation_equals_one_big_batch(trained, pipe, photos, cache):
    """At the LoRA weights `trained` ended with: 4 micro-batches of 1 against one batch of 4, same examples, same
    noise and timesteps. Equal up to float32 rounding: the batch's LoRA weight gradients are reductions over
    batch x tokens, summed in another order than the micro-batches' (measured: loss 1.4e-7, gradients 0.8e-6, the
    weights after one AdamW step 2.3e-6 -- Adam's first step divides each gradient by its own magnitude, which
    amplifies the rounding of the smallest ones)."""
    examples = data_lib.read_folder(photos)
    buckets = data_lib.make_buckets(32, (1.0,), 16)
    cached = data_lib.build_cache(pipe, examples[:4], buckets, cache, max_sequence_length=16, tag="accumulation")
    model = fresh(pipe).transformer
    add_lora(model, LORA)
    graphdef, _, frozen = nnx.split(model, nnx.LoRAParam, ...)
    lora = trained.lora
    big = dataclasses.replace(CONFIG, batch_size=4, grad_accum=1)
    accumulated = dataclasses.replace(CONFIG, batch_size=1, grad_accum=4)
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
    runs = {}
    for name, config in (("big", big), ("accumulated", accumulated)):
        batch = make_batch(cached, config, text_len=16)
        assert batch["latents"].shape[:2] == (config.grad_accum, config.batch_size)
        loss, grads = jit_accumulated_gradients(graphdef, config, frozen, lora, batch, jax.random.key(7))
        optimizer = make_optimizer(config)  # one AdamW step with clipping, as train_step applies it
        updates, _ = optimizer.update(grads, optimizer.init(lora), lora)
        runs[name] = (float(loss), flat(grads), flat(optax.apply_updates(lora, updates)))
    (loss_b, grads_b, params_b), (loss_a, grads_a, params_a) = runs["big"], runs["accumulated"]
    print(f"accumulation: loss rel diff {abs(loss_a - loss_b) / loss_b:.2e}, gradient rel L2 "
          f"{relative_l2(grads_a, grads_b):.2e}, LoRA weights after the step rel L2 "
          f"{relative_l2(params_a, params_b):.2e}")
    assert abs(loss_a - loss_b) <= 1e-6 * loss_b
    assert relative_l2(grads_a, grads_b) <= 2e-6
    assert relative_l2(params_a, params_b) <= 5e-6


@pytest.mark.slow  # ~30 s on 2 cores
def test_training_draws_batches_from_every_bucket(pipe, photos, cache, tmp_path):
    """A training step compiles for each bucket's shape (the module's one-block pipeline, so its cached latents and
    text states)."""
    config = dataclasses.replace(CONFIG, steps=6, aspects=(0.5, 1.0, 2.0), save_every=100)
    result = train(fresh(pipe), photos, tmp_path / "run", config, LORA, model_tag="demo", cache_dir=cache,
                   progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert {tuple(r["bucket"]) for r in rows} == {(48, 16), (32, 32), (16, 48)}  # 1 wide, 1 tall, 4 square batches
    assert all(np.isfinite([loss for _, loss in result.losses]))


# --------------------------------------------------------------------------------------------------------------------
# Bad input: one clear message, nothing overwritten


def test_empty_folder_unreadable_image_and_missing_caption(pipe, photos, tmp_path):
    pipe = fresh(pipe)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(data_lib.DataError, match="no images"):
        train(pipe, empty, tmp_path / "out", CONFIG, LORA)
    assert not (tmp_path / "out").exists()

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "a.png").write_bytes(b"this is not a PNG")
    (broken / "a.txt").write_text("a caption")
    with pytest.raises(data_lib.DataError, match=r"a\.png: unreadable image"):
        train(pipe, broken, tmp_path / "out", CONFIG, LORA)
    assert not (tmp_path / "out").exists()

    uncaptioned = tmp_path / "uncaptioned"
    uncaptioned.mkdir()
    Image.new("RGB", (40, 40)).save(uncaptioned / "b.png")
    with pytest.raises(data_lib.DataError, match=r"b\.png: caption missing"):
        train(pipe, uncaptioned, tmp_path / "out", CONFIG, LORA)
    (uncaptioned / "metadata.jsonl").write_text('{"file_name": "c.png", "text": "x"}\n')
    with pytest.raises(data_lib.DataError, match=r"metadata\.jsonl: no caption for b\.png"):
        data_lib.read_folder(uncaptioned)
    (uncaptioned / "metadata.jsonl").write_text('{"file_name": "b.png", "text": "x"}\nnot json\n')
    with pytest.raises(data_lib.DataError, match=r"metadata\.jsonl:2: not a JSON object"):
        data_lib.read_folder(uncaptioned)
    (uncaptioned / "metadata.jsonl").write_text('{"file_name": "b.png", "text": "a grey square"}\n')
    assert data_lib.read_folder(uncaptioned)[0].caption == "a grey square"


def test_resume_with_another_config_and_a_second_run_in_the_same_folder_change_nothing(trained, pipe, photos, cache):
    out = trained.output_dir
    before = snapshot(out)
    with pytest.raises(TrainError, match=r"cannot resume.*rank=4 in the checkpoint, 8 now"):
        train(fresh(pipe), photos, out, CONFIG, dataclasses.replace(LORA, rank=8), resume=True, model_tag="demo",
              cache_dir=cache, progress=False)
    with pytest.raises(TrainError, match=r"learning_rate=0.01 in the checkpoint, 0.001 now"):
        train(fresh(pipe), photos, out, dataclasses.replace(CONFIG, learning_rate=1e-3), LORA, resume=True,
              model_tag="demo", cache_dir=cache, progress=False)
    with pytest.raises(TrainError, match="already holds a training run"):
        train(fresh(pipe), photos, out, CONFIG, LORA, model_tag="demo", cache_dir=cache, progress=False)
    assert snapshot(out) == before
    with pytest.raises(TrainError, match="nothing to resume"):
        train(fresh(pipe), photos, out.parent / "elsewhere", CONFIG, LORA, resume=True, progress=False)


# --------------------------------------------------------------------------------------------------------------------
# The command line

spec = importlib.util.spec_from_file_location("train_lora", Path(__file__).parent.parent / "scripts" / "train_lora.py")
train_lora = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_lora)


def run_cli(argv, capsys):
    try:
        code = train_lora.main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr()


def demo_argv(photos: Path, out: Path) -> list[str]:
    return ["--demo", "--data", str(photos), "--output", str(out), "--steps", "3", "--resolution", "32", "--rank", "2",
            "--max-sequence-length", "16", "--aspects", "1", "--validate-every", "3", "--validation-prompt", "a cat",
            "--validation-steps", "1", "--no-progress"]


# ~50 s on 2 cores: a training of its own. By default test_loss_falls_on_real_photographs and test_resume_is_exact
# check what a training writes (the LoRA file, validation images), and
# test_cli_checks_data_and_output_folders_before_building_a_model the CLI's refusal of a folder that holds a run.
@pytest.mark.slow
def test_cli_demo_trains_and_a_second_run_in_its_folder_exits_with_one_line(photos, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = demo_argv(photos, out)
    code, captured = run_cli(argv, capsys)
    assert code == 0, captured.err
    assert (out / "lora.safetensors").is_file() and (out / "validation" / "step_000003_0.png").is_file()
    assert "RANDOM weights" in captured.out

    code, captured = run_cli(argv, capsys)  # the same folder again, without --resume
    assert code == 2 and "already holds a training run" in captured.err and len(captured.err.splitlines()) == 1


def test_cli_bad_arguments_exit_with_one_line(photos, tmp_path, capsys):
    out = tmp_path / "cli"
    code, captured = run_cli(["--demo", "--data", str(tmp_path / "nope"), "--output", str(out)], capsys)
    assert code == 2 and captured.err.strip() == f"train_lora.py: error: --data {tmp_path / 'nope'}: no such folder"
    code, captured = run_cli(demo_argv(photos, out)[:-1] + ["--remat", "everything"], capsys)
    assert code == 2 and "--remat" in captured.err and len(captured.err.splitlines()) == 1


def test_cli_checks_data_and_output_folders_before_building_a_model(tmp_path, capsys, monkeypatch):
    """An empty or broken data folder, or an output folder that holds a run (or none to resume), exits with one line
    before any model is built or loaded."""
    import mxdit.model.pipeline_krea2
    import mxdit.model.pipelines

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the inputs were checked")

    monkeypatch.setattr(mxdit.model.pipeline_krea2, "demo_pipeline", no_model)
    monkeypatch.setattr(mxdit.model.pipelines, "load_pipeline", no_model)
    empty, broken, uncaptioned, good, taken = (tmp_path / name for name in ("empty", "broken", "uncaptioned", "good",
                                                                              "taken"))
    for folder in (empty, broken, uncaptioned, good, taken):
        folder.mkdir()
    (broken / "a.png").write_bytes(b"this is not a PNG")
    (broken / "a.txt").write_text("a caption")
    Image.new("RGB", (40, 40)).save(uncaptioned / "b.png")
    Image.new("RGB", (40, 40)).save(good / "c.png")
    (good / "c.txt").write_text("a black square")
    (taken / "train_log.jsonl").write_text("")
    model = Path(__file__).parent / "fixtures" / "krea2" / "tiny_pipeline"
    for source in (["--demo"], ["--model", str(model)]):
        for data, output, extra, message in (
                (empty, tmp_path / "out", [], f"{empty}: no images"),
                (broken, tmp_path / "out", [], f"{broken / 'a.png'}: unreadable image"),
                (uncaptioned, tmp_path / "out", [], f"{uncaptioned / 'b.png'}: caption missing"),
                (good, taken, [], f"{taken}: already holds a training run (train_log.jsonl)"),
                (good, tmp_path / "out", ["--resume"], f"{tmp_path / 'out'}: nothing to resume")):
            code, captured = run_cli([*source, "--data", str(data), "--output", str(output), *extra], capsys)
            assert code == 2 and captured.err.startswith(f"train_lora.py: error: {message}"), captured.err
            assert len(captured.err.splitlines()) == 1 and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------------------------
# FLUX.1: the same training on the tiny FLUX.1-dev fixture (random weights in diffusers' layout)

FLUX_PIPELINE = Path(__file__).parent / "fixtures" / "flux" / "tiny_pipeline"


@pytest.mark.slow  # ~25 s on 2 cores; test_flux_remat_changes_memory_not_the_gradients trains FLUX.1 by default
def test_flux_lora_trains_from_the_command_line(photos, tmp_path, capsys):
    """The FLUX folder is recognised by its model_index.json; the default targets are FLUX's attention and MLPs; the
    loss falls; the LoRA file holds diffusers' FLUX key names and loads back onto a fresh transformer."""
    from mxdit.model.pipeline_flux import FluxPipeline
    from mxdit.model.lora import adapters
    from mxdit.training.lora import load_lora

    out = tmp_path / "flux"
    argv = ["--model", str(FLUX_PIPELINE), "--data", str(photos), "--output", str(out), "--steps", "24",
            "--batch-size", "4", "--lr", "1e-2", "--resolution", "32", "--bucket-multiple", "16", "--aspects", "1",
            "--rank", "4", "--max-sequence-length", "16", "--dtype", "fp32", "--save-every", "100", "--no-progress"]
    code, captured = run_cli(argv, capsys)
    assert code == 0, captured.err
    losses = [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    first, last = np.mean(losses[:4]), np.mean(losses[-4:])
    print(f"FLUX loss: first 4 steps {first:.4f}, last 4 steps {last:.4f}")  # measured 2.86 -> 1.90
    assert len(losses) == 24 and last < 0.8 * first
    from safetensors.numpy import load_file

    saved = load_file(out / "lora.safetensors")
    for module in ("transformer_blocks.0.attn.add_q_proj", "transformer_blocks.1.ff_context.net.2",
                   "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.1.attn.to_v"):
        assert f"transformer.{module}.lora_A.weight" in saved
    assert len(saved) == 2 * 34  # 2 double blocks x 12 + 2 single blocks x 5 adapters
    transformer = FluxPipeline.from_pretrained(FLUX_PIPELINE, jnp.float32).transformer
    load_lora(transformer, out / "lora.safetensors")
    b = dict(adapters(transformer))["single_transformer_blocks.0.proj_mlp"].B[...]
    np.testing.assert_array_equal(b, saved["transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight"])
    assert np.abs(b).max() > 0
    # The file read as any diffusers-layout LoRA (lora_files, checked against diffusers on FLUX elsewhere): the same
    # velocity as with our own loader.
    from mxdit.model.lora_files import apply_loras

    other = FluxPipeline.from_pretrained(FLUX_PIPELINE, jnp.float32).transformer
    rng = np.random.default_rng(1)
    ids = np.zeros((24, 3), np.float32)
    ids[8:, 1], ids[8:, 2] = np.arange(16) // 4, np.arange(16) % 4
    args = (jnp.asarray(rng.standard_normal((1, 16, 64)), jnp.float32),
            jnp.asarray(rng.standard_normal((1, 8, 24)), jnp.float32),
            jnp.asarray(rng.standard_normal((1, 32)), jnp.float32), jnp.array([0.4]), jnp.asarray(ids[8:]),
            jnp.asarray(ids[:8]), jnp.array([3.5]))
    base = np.asarray(other(*args))
    apply_loras(other, [(out / "lora.safetensors", 1.0)])
    ours, theirs = np.asarray(transformer(*args)), np.asarray(other(*args))
    assert np.abs(ours - base).max() > 1e-3  # the LoRA changes the output
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5)

    code, captured = run_cli(argv[:6] + ["--output", str(tmp_path / "other"), "--targets", "authors"], capsys)
    assert code == 2 and "no preset 'authors' for flux" in captured.err and len(captured.err.splitlines()) == 1


@pytest.mark.parametrize("base", ["bf16", pytest.param("fp8_e4m3", marks=pytest.mark.slow)])  # ~26 s
def test_flux_remat_changes_memory_not_the_gradients(base):
    """Per-block remat recomputes the blocks in the backward: the same loss and gradients, on the unquantized base
    and on a quantized one (whose products' custom gradient is recomputed too)."""
    from mxdit.model.pipeline_flux import FluxPipeline
    from mxdit.quant.model import flux_rules
    from mxdit.training.lora import quantize_base
    from mxdit.training.train import REMAT_POLICIES, flow_matching_loss

    model = FluxPipeline.from_pretrained(FLUX_PIPELINE, jnp.float32).transformer
    if base != "bf16":
        quantize_base(model, flux_rules(base))
    add_lora(model, LoraConfig(rank=2, alpha=2))
    rng = np.random.default_rng(0)
    latents, noise = (jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.float32) for _ in range(2))
    embeds = jnp.asarray(rng.standard_normal((2, 8, 24)), jnp.float32)
    pooled = jnp.asarray(rng.standard_normal((2, 32)), jnp.float32)
    ids = np.zeros((24, 3), np.float32)
    ids[8:, 1], ids[8:, 2] = np.arange(16) // 4, np.arange(16) % 4
    results = []
    for policy in ("none", "block"):
        model.remat_policy = REMAT_POLICIES[policy]
        graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)

        def loss(lora):
            m = nnx.merge(graphdef, lora, frozen)
            return flow_matching_loss(m, latents, embeds, None, jnp.asarray(ids), noise, jnp.array([0.3, 0.8]),
                                      pooled, 3.5)

        results.append(jax.jit(jax.value_and_grad(loss))(lora))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert abs(float(loss_a) - float(loss_b)) <= 1e-6 * abs(float(loss_a))
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # ~20 s on 2 cores: the validation images' programs
def test_the_encoders_wait_in_host_memory_while_the_transformer_trains(pipe, photos, cache, tmp_path, monkeypatch):
    """The text encoder and the VAE leave the device's memory for the training steps (they have encoded the data),
    come back for the validation images and stay there when training ends."""
    from mxdit.training import train as train_lib

    def kinds():
        return {x.sharding.memory_kind for name in train_lib.ENCODERS if hasattr(pipe, name)
                for x in jax.tree.leaves(nnx.state(getattr(pipe, name)))}

    seen = []
    step = train_lib.jit_train_step

    def watched(*args):
        seen.append(kinds())
        return step(*args)

    monkeypatch.setattr(train_lib, "jit_train_step", watched)
    config = dataclasses.replace(CONFIG, steps=2, validate_every=1, validation_prompts=("a cat",),
                                 validation_steps=1, validation_size=(32, 32))
    train(fresh(pipe), photos, tmp_path / "run", config, LORA, model_tag="demo", cache_dir=cache, progress=False)
    assert seen == [{"pinned_host"}, {"pinned_host"}] and kinds() == {"device"}
    assert sorted(p.name for p in (tmp_path / "run" / "validation").iterdir()) == ["step_000001_0.png",
                                                                                     "step_000002_0.png"]


@pytest.mark.slow  # ~15 s on 2 cores
def test_cli_quantizes_the_base_as_it_reads_the_folder(photos, tmp_path, capsys, monkeypatch):
    """train_lora.py --model DIR --quantize-base FMT: the block matrices arrive quantized (the device never holds the
    base in bf16), so the quantize_base call after loading finds nothing left to do."""
    from mxdit.training import lora as lora_lib

    left = []
    quantize_base = lora_lib.quantize_base

    def watched(model, rules):
        left.append(quantize_base(model, rules))
        return left[-1]

    monkeypatch.setattr(lora_lib, "quantize_base", watched)
    argv = ["--model", str(Path(__file__).parent / "fixtures" / "krea2" / "tiny_pipeline"), "--data", str(photos),
            "--output", str(tmp_path / "run"), "--steps", "2", "--resolution", "32", "--bucket-multiple", "16",
            "--aspects", "1", "--rank", "2", "--max-sequence-length", "16", "--dtype", "fp32",
            "--quantize-base", "fp8_e4m3", "--no-progress"]
    code, captured = run_cli(argv, capsys)
    assert code == 0, captured.err
    assert left == [[]] and (tmp_path / "run" / "lora.safetensors").is_file()
    config = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert config["model"]["quantized"] == ["fp8_e4m3"]  # the base's formats, as a resume compares them
    code, captured = run_cli(argv[:-2] + ["int8", "--no-progress", "--resume"], capsys)
    assert code == 2 and "cannot resume" in captured.err and "quantized" in captured.err

"""LoRA fine-tuning of the Krea 2 and FLUX.1 transformers with flow matching.

The pieces, top to bottom: the config; timestep sampling; the loss; the training step (a pure jitted function of the
frozen base, the LoRA parameters, the optimizer state, a batch and a key); checkpoints through orbax; the loop
(`train`), with its progress bar, log file and validation images.

Flow matching as Krea 2 (and diffusers' Krea 2 trainer) defines it: `x_t = (1 - sigma) x_0 + sigma * noise`, the
model is called at timestep sigma (in [0, 1]) and predicts the velocity `noise - x_0`; the loss is its mean squared
error, per example, then averaged. FLUX.1 trains the same way (diffusers' train_dreambooth_lora_flux.py), with its
CLIP pooled text vector and, for FLUX.1-dev, the distilled guidance scale `guidance_scale` as extra inputs. Sigma
is drawn logit-normal (`sigmoid(N(mean, std))`) or uniform then shifted by the same exponential time shift as the
sampling schedule (mu fixed, or from the image token count as Krea 2 Base).

A step of `grad_accum` micro-batches of `batch_size`: the noise and sigmas of the whole step are drawn at once for
`grad_accum * batch_size` examples and the gradients of the micro-batches averaged by a `lax.scan`, so it computes the
same update as one batch of `grad_accum * batch_size` (up to float summation order). Dropout keys differ per micro-
batch, so with LoRA dropout the two are equal in distribution only.

Exact resume: the batch order is a pure function of (seed, epoch) (`data.epoch_batches`), the step's key is
`fold_in(key(seed), step)`, and a checkpoint holds the LoRA weights, the optimizer state, the step, the key and the
data position (epoch, batch index). Resuming restores them all, so N steps in one run and N/2 + N/2 with a restart
produce the same weights bit for bit (on one device, same program).

Sharding: the step takes every array as an argument (nothing large is closed over), so a mesh can later give it
input and output shardings (data-parallel batch, FSDP base and LoRA) without changing the math.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mxdit.model.flow_match import ShiftConfig, calculate_shift
from mxdit.model.loading import write_atomically
from mxdit.model.lora import LoraConfig, adapters
from mxdit.model.pipeline_common import image_position_ids, pack_latents
from mxdit.ops.linear import differentiated_products

from . import data as data_lib
from .lora import add_lora, save_lora

REMAT_POLICIES = {
    "none": None,  # keep every activation of the backward pass
    "block": jax.checkpoint_policies.nothing_saveable,  # keep each block's input only, recompute the block
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep the projections' outputs
    "dots_all": jax.checkpoint_policies.dots_saveable,  # keep every matrix product, attention's too
}
TIMESTEP_SAMPLING = ("logit_normal", "shifted")


class TrainError(ValueError):
    """A training run that cannot start or resume; the message names the folder, file or setting at fault."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that decides the trained weights (plus how often to save, validate and log).

    `batch_size` is the micro-batch; one optimizer step sees `batch_size * grad_accum` examples. The learning rate
    warms up linearly from 0 over `warmup_steps`, then decays by a cosine to `learning_rate * final_lr_ratio` at
    `steps`. Buckets have about `resolution^2` pixels, sides multiples of `bucket_multiple`.
    """

    steps: int = 1000
    batch_size: int = 1
    grad_accum: int = 1
    learning_rate: float = 3e-4
    warmup_steps: int = 0
    final_lr_ratio: float = 0.1
    weight_decay: float = 1e-4
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    timestep_sampling: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift_mu: float | None = None  # "shifted": None computes mu from the image token count, as Krea 2 Base samples
    guidance_scale: float = 3.5  # FLUX.1-dev's embedded guidance while training (diffusers' default); else unused
    resolution: int = 1024
    bucket_multiple: int = 64
    aspects: tuple[float, ...] = data_lib.DEFAULT_ASPECTS
    max_sequence_length: int = 512
    remat: str = "none"
    seed: int = 0
    save_every: int = 500
    keep_checkpoints: int = 3
    validate_every: int = 0
    validation_prompts: tuple[str, ...] = ()
    validation_steps: int | None = None  # None: the pipeline's default (28 Base, 8 Turbo)
    validation_size: tuple[int, int] | None = None  # (height, width); None: the first bucket's

    def __post_init__(self):
        positive = ("steps", "batch_size", "grad_accum", "resolution", "max_sequence_length", "save_every",
                    "keep_checkpoints")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}")
        if self.timestep_sampling not in TIMESTEP_SAMPLING:
            raise ValueError(f"timestep_sampling must be one of {', '.join(TIMESTEP_SAMPLING)}, "
                             f"got {self.timestep_sampling!r}")
        if self.learning_rate <= 0 or self.max_grad_norm <= 0 or self.logit_std <= 0:
            raise ValueError("learning_rate, max_grad_norm and logit_std must be > 0")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps), got {self.warmup_steps}")
        if self.validate_every < 0:
            raise ValueError(f"validate_every must be >= 0, got {self.validate_every}")


# Settings that may change when resuming: they do not enter the weights.
RESUMABLE_CHANGES = ("save_every", "keep_checkpoints", "validate_every", "validation_prompts", "validation_steps",
                     "validation_size")


def step_config(config: TrainConfig) -> TrainConfig:
    """`config` with the settings that do not enter the step (RESUMABLE_CHANGES) at their defaults: the static
    argument of the jitted step, so changing how often to save or validate does not recompile it."""
    defaults = TrainConfig()
    return dataclasses.replace(config, **{name: getattr(defaults, name) for name in RESUMABLE_CHANGES})


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW with linear warm-up and cosine decay (the schedule counts optimizer steps)."""
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                       optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2,
                                   eps=config.adam_eps, weight_decay=config.weight_decay))


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, config.warmup_steps, config.steps,
                                              end_value=config.learning_rate * config.final_lr_ratio)


def sample_sigmas(key: jax.Array, n: int, image_seq_len: int, config: TrainConfig) -> jax.Array:
    """(n,) float32 noise levels in (0, 1): logit-normal, or uniform then exponentially time-shifted by mu."""
    if config.timestep_sampling == "logit_normal":
        return jax.nn.sigmoid(config.logit_mean + config.logit_std * jax.random.normal(key, (n,), jnp.float32))
    mu = config.shift_mu if config.shift_mu is not None else calculate_shift(image_seq_len, ShiftConfig())
    u = jax.random.uniform(key, (n,), jnp.float32, minval=1e-6, maxval=1.0)
    return math.exp(mu) / (math.exp(mu) + (1.0 / u - 1.0))


# --------------------------------------------------------------------------------------------------------------------
# The step


def flow_matching_loss(model, latents, embeds, mask, position_ids, noise, sigmas, pooled=None,
                       guidance: float = 3.5) -> jax.Array:
    """Mean over examples of the mean squared error of the predicted velocity, float32.

    latents, noise: (batch, S, C) packed clean latents and Gaussian noise; embeds (batch, L, layers, dim) for Krea 2,
    (batch, L, dim) T5 states for FLUX.1; mask (batch, L) bool (FLUX.1 attends to every text token, as it was
    trained); position_ids (L + S, 3), text first; sigmas (batch,). FLUX.1 only: pooled (batch, dim), the CLIP
    pooled output, and `guidance`, the scale FLUX.1-dev embeds."""
    from mxdit.model.flux import FluxTransformer

    s = sigmas[:, None, None]
    noisy = (1.0 - s) * latents + s * noise
    with differentiated_products():  # a quantized base's products pass the gradient to their inputs
        if isinstance(model, FluxTransformer):
            text_len = embeds.shape[1]
            g = jnp.full(sigmas.shape, guidance, jnp.float32) if model.config.guidance_embeds else None
            velocity = model(noisy, embeds, pooled, sigmas, position_ids[text_len:], position_ids[:text_len], g)
        else:
            velocity = model(noisy, embeds, sigmas, position_ids, mask)
    velocity = velocity.astype(jnp.float32)
    return jnp.mean(jnp.mean(jnp.square(velocity - (noise - latents)), axis=(1, 2)))


def _loss(lora: nnx.State, frozen: nnx.State, graphdef, examples: dict, position_ids, noise, sigmas, dropout_key,
          guidance: float):
    model = nnx.merge(graphdef, lora, frozen)
    if dropout_key is not None:  # on this traced copy only: the model the caller holds never drops out
        for i, (_, adapter) in enumerate(adapters(model)):
            adapter.dropout_key = nnx.data(jax.random.fold_in(dropout_key, i))
    return flow_matching_loss(model, examples["latents"], examples["embeds"], examples["mask"], position_ids, noise,
                              sigmas, examples.get("pooled"), guidance)


def accumulated_gradients(graphdef, config: TrainConfig, frozen: nnx.State, lora: nnx.State,
                          batch: dict[str, jax.Array], key: jax.Array) -> tuple[jax.Array, nnx.State]:
    """(mean loss, mean gradient w.r.t. the LoRA parameters) of one optimizer step.

    batch: latents (k, b, S, C) packed; embeds (k, b, L, ...); mask (k, b, L); FLUX.1 also pooled (k, b, dim);
    position_ids (L + S, 3) -- k micro-batches of b examples. Noise and sigmas are drawn for all k * b examples at
    once from `key`, so the result does not depend on how they are split into micro-batches (dropout aside)."""
    k, b, seq, channels = batch["latents"].shape
    noise_key, sigma_key, dropout_key = jax.random.split(key, 3)
    noise = jax.random.normal(noise_key, (k * b, seq, channels), jnp.float32).reshape(k, b, seq, channels)
    sigmas = sample_sigmas(sigma_key, k * b, seq, config).reshape(k, b)
    dropout = any(adapter.dropout > 0 for _, adapter in adapters(nnx.merge(graphdef, lora, frozen)))
    dropout_keys = jax.random.split(dropout_key, k)
    grad_fn = jax.value_and_grad(_loss)

    def micro_batch(carry, xs):
        loss_sum, grad_sum = carry
        examples, noise, sigmas, dkey = xs
        loss, grads = grad_fn(lora, frozen, graphdef, examples, batch["position_ids"], noise, sigmas,
                              dkey if dropout else None, config.guidance_scale)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

    examples = {name: batch[name] for name in PER_EXAMPLE if name in batch}
    xs = (examples, noise, sigmas, dropout_keys)
    zeros = jax.tree.map(jnp.zeros_like, lora)
    (loss, grads), _ = jax.lax.scan(micro_batch, (jnp.zeros((), jnp.float32), zeros), xs)
    return loss / k, jax.tree.map(lambda g: g / k, grads)


def train_step(graphdef, config: TrainConfig, frozen: nnx.State, lora: nnx.State, opt_state: optax.OptState,
               batch: dict[str, jax.Array], key: jax.Array) -> tuple[nnx.State, optax.OptState, dict[str, jax.Array]]:
    """One optimizer step: accumulated gradients, clipping, AdamW. Returns (lora, opt_state, {loss, grad_norm})."""
    loss, grads = accumulated_gradients(graphdef, config, frozen, lora, batch, key)
    updates, opt_state = make_optimizer(config).update(grads, opt_state, lora)
    return optax.apply_updates(lora, updates), opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}


# The graph definition and the config are static (hashable); one compiled program per bucket shape, shared by every
# run in the process (which is why the jit is here and not per run).
jit_train_step = jax.jit(train_step, static_argnums=(0, 1), donate_argnums=(3, 4))
jit_accumulated_gradients = jax.jit(accumulated_gradients, static_argnums=(0, 1))


# The batch's arrays with a (micro-batch, example) leading pair; position_ids is shared.
PER_EXAMPLE = ("latents", "embeds", "mask", "pooled")


def make_batch(cached: Sequence[data_lib.CachedExample], config: TrainConfig, text_len: int) -> dict[str, np.ndarray]:
    """The step's `batch_size * grad_accum` cached examples (one bucket) as the arrays `train_step` takes."""
    arrays = data_lib.load_batch(cached, text_len)
    latents = pack_latents(arrays["latents"])  # (n, S, 64); pack_latents is plain reshapes, numpy works too
    n, seq, channels = latents.shape
    k, b = config.grad_accum, config.batch_size
    grid_h, grid_w = arrays["latents"].shape[1] // 2, arrays["latents"].shape[2] // 2
    ids = np.concatenate([np.zeros((text_len, 3), np.float32), image_position_ids(grid_h, grid_w)])
    batch = {"latents": latents.reshape(k, b, seq, channels),
             "embeds": arrays["embeds"].reshape(k, b, *arrays["embeds"].shape[1:]),
             "mask": arrays["mask"].reshape(k, b, text_len), "position_ids": ids}
    if "pooled" in arrays:  # FLUX.1
        batch["pooled"] = arrays["pooled"].reshape(k, b, -1)
    return batch


# --------------------------------------------------------------------------------------------------------------------
# Checkpoints


def _manager(output_dir: Path, keep: int):
    import orbax.checkpoint as ocp

    # Orbax writes each step to a temporary folder and renames it when complete: a crash never leaves a half checkpoint
    # that resume would pick.
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager((output_dir / "checkpoints").absolute(), options=options)


def _cache_tag(pipe, model_tag: str) -> str:
    """What the cached latents and text states depend on besides the image and caption: the model and the dtypes of
    the VAE and text encoder(s)."""
    encoders = [getattr(pipe, name) for name in ("text_encoder", "text_encoder_2") if hasattr(pipe, name)]
    dtypes = [",".join(sorted({jnp.dtype(x.dtype).name for x in jax.tree.leaves(nnx.state(m, nnx.Param))}))
              for m in (pipe.vae, *encoders)]
    return "|".join([model_tag, *dtypes])


def _comparable(config: TrainConfig, lora_config: LoraConfig, model, model_tag: str) -> dict:
    """What must match for a resume: the configs (but for RESUMABLE_CHANGES) and the base model (tag, dtype, the
    formats of a quantized base)."""
    from mxdit.model.lora import linear_layers
    from mxdit.ops.linear import is_gemm_weight
    from mxdit.quant.formats import QuantizedArray

    train = {k: v for k, v in dataclasses.asdict(config).items() if k not in RESUMABLE_CHANGES}
    weights = [layer.weight.get_value() for _, layer in linear_layers(model)]
    formats = sorted({w.fmt for w in weights if isinstance(w, QuantizedArray) or is_gemm_weight(w)})
    base = {"tag": model_tag, "dtype": jnp.dtype(model.dtype).name, "quantized": formats}
    return json.loads(json.dumps({"train": train, "lora": dataclasses.asdict(lora_config), "model": base}))


def _config_differences(saved: dict, current: dict) -> list[str]:
    out = []
    for part in ("train", "lora", "model"):
        for name in sorted(set(saved.get(part, {})) | set(current[part])):
            old, new = saved.get(part, {}).get(name), current[part].get(name)
            if old != new:
                out.append(f"{name}={old!r} in the checkpoint, {new!r} now")
    return out


def data_fingerprint(examples: Sequence[data_lib.Example]) -> str:
    """A hash of the data set's file names and captions (not bytes: renaming nothing, editing a caption counts)."""
    import hashlib

    return hashlib.sha256(json.dumps([[e.image.name, e.caption] for e in examples]).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------------------------
# The loop


@dataclasses.dataclass
class TrainResult:
    step: int  # optimizer steps done in total
    losses: list[tuple[int, float]]  # (step, loss) of the steps this call ran
    lora: nnx.State  # the LoRA parameters, also written into the model
    output_dir: Path


def check_inputs(data_dir: str | Path, output_dir: str | Path, config: TrainConfig, *,
                 resume: bool = False) -> tuple[list[data_lib.Example], list[tuple[int, int]]]:
    """What `train` checks before any work, and needs no model for: the output folder (an existing run only with
    `resume`, and one to resume with it), the data folder (images, each with a caption, each readable) and the
    buckets. Returns the examples and the (height, width) buckets; raises TrainError or DataError naming the folder
    or file at fault. scripts/train_lora.py calls it before building or loading a model."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise TrainError(f"{output_dir}: exists and is not a folder")
    manager_dir = output_dir / "checkpoints"
    has_run = manager_dir.is_dir() and any(manager_dir.iterdir())
    if resume and not has_run:
        raise TrainError(f"{output_dir}: nothing to resume (no checkpoints/ with a saved step)")
    if not resume:
        taken = [name for name in ("checkpoints", "lora.safetensors", "train_log.jsonl")
                 if (output_dir / name).exists() and not (name == "checkpoints" and not has_run)]
        if taken:
            raise TrainError(f"{output_dir}: already holds a training run ({', '.join(taken)}); pass resume (--resume) "
                             "to continue it, or choose another output folder")
    examples = data_lib.read_folder(data_dir)
    buckets = data_lib.make_buckets(config.resolution, config.aspects, config.bucket_multiple)
    for example in examples:  # errors about the images come out here, before anything is written
        data_lib.image_size(example.image)
    return examples, buckets


def train(pipe, data_dir: str | Path, output_dir: str | Path, config: TrainConfig, lora_config: LoraConfig, *,
          resume: bool = False, model_tag: str = "", cache_dir: str | Path | None = None, validation_pipe=None,
          stop_at: int | None = None, progress: bool = True, mesh=None) -> TrainResult:
    """Train a LoRA on `pipe.transformer` (a Krea2Pipeline or FluxPipeline; the transformer stays frozen) with the
    captioned images of `data_dir`, writing checkpoints, the metric log, validation images and finally
    `lora.safetensors` to `output_dir`.

    `resume`: continue the run in `output_dir` from its latest checkpoint (the configs must match, but for
    `RESUMABLE_CHANGES`). Without it, an `output_dir` that already holds a run is an error: nothing is overwritten.
    `model_tag` names the base model in the cache keys. `validation_pipe`: generate validation images with that
    pipeline (e.g. Krea 2 Turbo) and the adapters copied onto its transformer, instead of `pipe`. `stop_at`: stop
    (with a checkpoint) after that many steps, as an interrupted run would. `mesh` (`sharding.mesh.make_mesh`): data
    parallel over `data` and FSDP over `fsdp` (the frozen weights split over `fsdp`, each micro-batch over both;
    the LoRA weights and optimizer state replicated: they are small).
    """
    if mesh is not None:
        from mxdit.sharding.mesh import check_batch, describe

        busy = [a for a in ("cfg", "seq", "tensor") if mesh.shape[a] > 1]
        if busy:
            raise TrainError(f"mesh {describe(mesh)}: training splits over data and fsdp only, not {', '.join(busy)}")
        try:
            check_batch(config.batch_size, mesh, ("data", "fsdp"), what="--batch-size")
        except ValueError as e:
            raise TrainError(str(e)) from None
        if config.validation_prompts and config.validate_every:
            raise TrainError(f"mesh {describe(mesh)}: validation images are not made on a mesh yet; train without "
                             "validation prompts, then generate with the saved LoRA")
    output_dir = Path(output_dir)
    examples, buckets = check_inputs(data_dir, output_dir, config, resume=resume)
    fingerprint = data_fingerprint(examples)
    comparable = _comparable(config, lora_config, pipe.transformer, model_tag)
    manager = None
    restored_meta = None
    if resume:
        manager = _manager(output_dir, config.keep_checkpoints)
        import orbax.checkpoint as ocp

        latest = manager.latest_step()
        if latest is None:
            raise TrainError(f"{output_dir}: nothing to resume (no complete checkpoint in checkpoints/)")
        restored_meta = manager.restore(latest, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        differences = _config_differences(restored_meta["config"], comparable)
        if restored_meta["data"] != fingerprint:
            differences.append(f"the data set in {data_dir} differs (file names or captions)")
        if differences:
            raise TrainError(f"{output_dir}: cannot resume, the checkpoint at step {latest} was made with another "
                             f"config: {'; '.join(differences)}")

    if any(True for _ in adapters(pipe.transformer)):
        raise TrainError("the transformer already has LoRA adapters; remove_lora(pipe.transformer) first")
    from tqdm import tqdm

    output_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(cache_dir) if cache_dir is not None else output_dir / "cache"
    with tqdm(total=len(examples), desc="cache", unit="image", disable=not progress) as bar:
        cached = data_lib.build_cache(pipe, examples, buckets, cache_dir, max_sequence_length=config.max_sequence_length,
                                      tag=_cache_tag(pipe, model_tag), progress=bar)
    # One text length for all steps: one program. Krea 2's real tokens are padded (masked) to a multiple of 8;
    # FLUX.1 attends to its padding as trained, so its cached T5 states keep their full, equal length.
    text_len = cached[0].text_tokens if cached[0].pooled else max(8, -(-max(c.text_tokens for c in cached) // 8) * 8)
    buckets_of = [c.bucket for c in cached]
    per_step = config.batch_size * config.grad_accum

    # Model: adapters, remat, the split into (static graph, trainable LoRA, frozen rest).
    model = pipe.transformer
    add_lora(model, lora_config, seed=config.seed)
    model.remat_policy = REMAT_POLICIES[config.remat]
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    lora = jax.tree.map(jnp.copy, lora)  # the step donates its LoRA buffers; the model keeps its own until the end
    opt_state = make_optimizer(config).init(lora)
    # Committed to the device(s), as restored arrays are: the step then compiles once for a run and its resumption.
    place = _Placement(mesh)
    frozen = place.frozen(frozen)
    lora, opt_state = jax.device_put((lora, opt_state), place.replicated)
    base_key = jax.random.key(config.seed)
    step, epoch, batch_index = 0, 0, 0
    if resume:
        import orbax.checkpoint as ocp

        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, (lora, opt_state))
        restored = manager.restore(latest, args=ocp.args.Composite(
            lora=ocp.args.StandardRestore(abstract[0]), opt_state=ocp.args.StandardRestore(abstract[1]),
            meta=ocp.args.JsonRestore()))
        lora, opt_state = restored["lora"], restored["opt_state"]
        step, epoch, batch_index = restored_meta["step"], restored_meta["epoch"], restored_meta["batch_index"]
        base_key = jax.random.wrap_key_data(jnp.asarray(restored_meta["rng"], jnp.uint32))
    else:
        manager = _manager(output_dir, config.keep_checkpoints)
        _write_json(output_dir / "train_config.json", {**comparable, "train_all": dataclasses.asdict(config),
                                                       "data": fingerprint})

    def save(at_step: int) -> None:
        import orbax.checkpoint as ocp

        if manager.latest_step() == at_step:
            return
        meta = {"step": at_step, "epoch": epoch, "batch_index": batch_index, "config": comparable, "data": fingerprint,
                "rng": np.asarray(jax.random.key_data(base_key)).tolist(), "model": model_tag}
        manager.save(at_step, args=ocp.args.Composite(
            lora=ocp.args.StandardSave(lora), opt_state=ocp.args.StandardSave(opt_state), meta=ocp.args.JsonSave(meta)))
        manager.wait_until_finished()

    validator = _Validator(pipe if validation_pipe is None else validation_pipe, lora_config, config,
                           output_dir / "validation", buckets_of, separate=validation_pipe is not None)
    schedule = learning_rate_schedule(config)
    losses = []
    end = config.steps if stop_at is None else min(stop_at, config.steps)
    log = open(output_dir / "train_log.jsonl", "a", encoding="utf-8")
    if resume:
        log.write(json.dumps({"event": "resume", "step": step}) + "\n")
    plan = data_lib.epoch_batches(buckets_of, per_step, config.seed, epoch)
    static_config = step_config(config)
    move_encoders(pipe, "pinned_host")
    try:
        with tqdm(total=config.steps, initial=step, desc="train", unit="step", disable=not progress) as bar:
            while step < end:
                if batch_index >= len(plan):
                    epoch, batch_index = epoch + 1, 0
                    plan = data_lib.epoch_batches(buckets_of, per_step, config.seed, epoch)
                t0 = time.perf_counter()
                members = [cached[i] for i in plan[batch_index]]
                batch = place.batch(make_batch(members, config, text_len))
                with place.context():
                    lora, opt_state, metrics = jit_train_step(graphdef, static_config, frozen, lora, opt_state, batch,
                                                              jax.random.fold_in(base_key, step))
                loss = float(metrics["loss"])  # waits for the device: the bar's it/s is real
                step, batch_index = step + 1, batch_index + 1
                row = {"step": step, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                       "lr": float(schedule(step - 1)), "epoch": epoch, "bucket": list(members[0].bucket),
                       "seconds": time.perf_counter() - t0}
                log.write(json.dumps(row) + "\n")
                log.flush()
                losses.append((step, loss))
                bar.set_postfix(loss=f"{loss:.4f}")
                bar.update(1)
                if step % config.save_every == 0:
                    save(step)
                if config.validate_every and config.validation_prompts and step % config.validate_every == 0:
                    if validation_pipe is None:  # the images need the training pipeline's encoders
                        move_encoders(pipe, "device")
                    validator(lora, step)
                    move_encoders(pipe, "pinned_host")
        save(step)
    finally:
        log.close()
        move_encoders(pipe, "device")
    nnx.update(model, lora)
    if step >= config.steps:
        save_lora(model, output_dir / "lora.safetensors", lora_config,
                  extra={"mxdit.train": json.dumps(comparable["train"]), "mxdit.step": str(step)})
    return TrainResult(step, losses, lora, output_dir)


ENCODERS = ("text_encoder", "text_encoder_2", "vae")  # the pipelines' modules that only the data cache needs


def move_encoders(pipe, memory_kind: str) -> None:
    """The pipeline's text encoders and VAE (`ENCODERS`) to `memory_kind` of their own devices, each array keeping
    its sharding: "pinned_host" while the transformer trains (they have encoded the data already, and on a 24 GB
    card Krea 2's text encoder, 7.5 GiB in bf16, would sit beside the base and the step's activations), "device"
    for validation images and when training ends. Arrays there already stay."""
    for name in ENCODERS:
        module = getattr(pipe, name, None)
        if module is None:
            continue

        def move(x):
            if not isinstance(x, jax.Array) or x.sharding.memory_kind == memory_kind:
                return x
            return jax.device_put(x, x.sharding.with_memory_kind(memory_kind))

        nnx.update(module, jax.tree.map(move, nnx.state(module)))


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where the step's arguments live: one device, or a mesh (frozen weights FSDP-split, batch split over data and
    fsdp, LoRA and optimizer state replicated), and the context the step is traced in."""

    mesh: object | None

    @property
    def replicated(self):
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.devices()[0] if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())

    def frozen(self, frozen):
        if self.mesh is None:
            return frozen
        from mxdit.sharding.mesh import param_shardings

        return jax.device_put(frozen, param_shardings(frozen, self.mesh, ("fsdp",)))

    def batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        if self.mesh is None:
            return batch
        from jax.sharding import NamedSharding, PartitionSpec

        # (k micro-batches, b examples, ...): the examples of each micro-batch split over data x fsdp
        def split(x):
            return NamedSharding(self.mesh, PartitionSpec(None, ("data", "fsdp"), *([None] * (np.ndim(x) - 2))))

        return {name: jax.device_put(x, split(x) if name in PER_EXAMPLE else self.replicated)
                for name, x in batch.items()}

    def context(self):
        if self.mesh is None:
            return contextlib.nullcontext()
        from mxdit.sharding.mesh import activation_rules

        return activation_rules(self.mesh)


class _Validator:
    """Validation images with the current adapters: PNGs `validation/step_000100_0.png`, one per prompt."""

    def __init__(self, pipe, lora_config: LoraConfig, config: TrainConfig, folder: Path, buckets_of, separate: bool):
        self.pipe, self.config, self.folder = pipe, config, folder
        self.size = config.validation_size or max(sorted(set(buckets_of)), key=buckets_of.count)  # the commonest
        if separate and config.validate_every and config.validation_prompts:
            add_lora(pipe.transformer, lora_config)  # the same module paths as on the trained model

    def __call__(self, lora: nnx.State, step: int) -> None:
        # A copy: the training step donates (frees) the buffers of `lora` on its next call.
        nnx.update(self.pipe.transformer, jax.tree.map(jnp.copy, lora))
        self.folder.mkdir(parents=True, exist_ok=True)
        for i, prompt in enumerate(self.config.validation_prompts):
            out = self.pipe(prompt, height=self.size[0], width=self.size[1], seed=self.config.seed,
                            num_inference_steps=self.config.validation_steps)
            path = self.folder / f"step_{step:06d}_{i}.png"
            write_atomically(path, lambda tmp: out.images[0].save(tmp, format="PNG"))


def _write_json(path: Path, value) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(value, indent=1)))

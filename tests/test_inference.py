"""model/inference.py: `build_pipeline` assembles the pipeline generate.py runs (the same image as generate.py, and as
the parts put together by hand), and options that do not go together are refused with generate.py's messages."""

import importlib.util
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mxdit.model.inference import InferenceOptions, build_pipeline
from mxdit.ops.names import AttentionKernel, Precision

PROMPT, SIDE, STEPS = "a red fox", 64, 1


def load_generate():
    spec = importlib.util.spec_from_file_location("generate", Path(__file__).parent.parent / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_built_from_options_draws_generate_pys_image(tmp_path):
    """FP8 blocks and XLA attention on the demo: generate.py's PNG, build_pipeline's image and the demo prepared by
    hand (attention set, blocks quantized and projections stacked) are the same pixels."""
    from mxdit.model.pipeline_krea2 import demo_pipeline
    from mxdit.model.pipelines import prepare_transformer

    out = tmp_path / "generate.png"
    assert load_generate().main(["--demo", "--prompt", PROMPT, "--height", str(SIDE), "--width", str(SIDE), "--steps",
                                 str(STEPS), "--precision", "fp8", "--attention", "xla",
                                 "--output", str(out)]) == 0
    options = InferenceOptions(precision=Precision.FP8, attention=AttentionKernel.XLA, dtype="float32")
    built = build_pipeline(None, options)
    with tempfile.TemporaryDirectory() as folder:
        by_hand = demo_pipeline(Path(folder), seed=0)
    by_hand.transformer.attention = AttentionKernel.XLA
    prepare_transformer(by_hand.transformer, Precision.FP8)
    images = [np.asarray(pipe([PROMPT], height=SIDE, width=SIDE, num_inference_steps=STEPS, seed=0).images[0])
              for pipe in (built, by_hand)]
    with Image.open(out) as png:
        np.testing.assert_array_equal(images[0], np.asarray(png))
    np.testing.assert_array_equal(images[1], images[0])


@pytest.mark.parametrize("options, message", [
    (dict(quantized="q.safetensors", precision="fp8"), "--quantized with --precision: the file's formats are the "
                                                        "precision"),
    (dict(quantized="q.safetensors", fuse_loras=True), "--quantized with --fuse-lora"),
    (dict(mesh=object(), precision="mxfp4"), "--precision mxfp4 with --mesh: sharded runs take bf16 weights"),
    (dict(offload=-1), "--offload -1: the number of resident blocks must be >= 0"),
    (dict(offload=1, prefetch=0), "--prefetch 0: must be >= 1"),
    (dict(offload=1, fuse_loras=True), "--offload with --fuse-lora: not supported together yet"),
])
def test_options_that_do_not_go_together_are_refused(options, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        InferenceOptions(**options)


def test_a_quantized_checkpoint_needs_a_model_folder():
    with pytest.raises(ValueError, match="--quantized needs --model"):
        build_pipeline(None, InferenceOptions(quantized=Path("q.safetensors")))

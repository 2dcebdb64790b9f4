"""model/clip.py against transformers' CLIPModel on a tiny random checkpoint (scripts/fixtures/clip.py): image and
text embeddings, logits and the CLIP score; `clip_pixels` against CLIPImageProcessor."""

import jax.numpy as jnp
import numpy as np
from PIL import Image

from conftest import FIXTURES, relative_l2
from mxdit.model.clip import CLIPModel, clip_pixels

REFERENCE = FIXTURES / "clip" / "reference.npz"


def test_embeddings_logits_and_score_match_transformers():
    reference = np.load(REFERENCE)
    model = CLIPModel.from_pretrained(FIXTURES / "clip" / "tiny", jnp.float32)
    pixels, ids = jnp.asarray(reference["pixel_values"]), jnp.asarray(reference["input_ids"])
    image, text = model.image_embeds(pixels), model.text_embeds(ids)
    # float32 throughout: measured 2.2e-7 and 1.7e-7 (embeddings), 1.7e-6 (logits, exp(scale) ~ 10 times cosines)
    assert relative_l2(image, reference["image_embeds"]) <= 2e-6
    assert relative_l2(text, reference["text_embeds"]) <= 2e-6
    assert relative_l2(model.logits(pixels, ids), reference["logits_per_image"]) <= 1e-5
    # the score of each image with its own text: 100 times the cosine, at least 0
    expected = np.maximum(100 * np.sum(reference["image_embeds"][:2] * reference["text_embeds"], axis=-1), 0)
    np.testing.assert_allclose(model.clip_score(pixels[:2], ids), expected, rtol=1e-5, atol=1e-4)


def test_clip_pixels_are_the_image_processors():
    reference = np.load(REFERENCE)
    for name in ("image_300x451", "image_97x64"):
        pixels = clip_pixels([Image.fromarray(reference[name])])[0]
        np.testing.assert_allclose(pixels, reference[f"pixels_{name}"], rtol=0, atol=1e-6)  # measured: equal


def test_the_clip_score_tokenizes_and_preprocesses_as_transformers_does():
    """`load_clip` reads the folder's tokenizer too: its ids are transformers' CLIPTokenizer's (padded to 77 with the
    end token); `clip_scores` of images and prompts is 100 times the cosine of the towers' embeddings, at least 0."""
    from mxdit.model.clip import clip_scores, load_clip

    reference = np.load(REFERENCE)
    model, tokenizer = load_clip(FIXTURES / "clip" / "tiny")
    prompts = [str(p) for p in reference["prompts"]]
    ids, _ = tokenizer(prompts, max_length=77)
    np.testing.assert_array_equal(ids, reference["input_ids"])
    images = [reference["image_300x451"], reference["image_97x64"]]
    scores = clip_scores(model, tokenizer, images, prompts)
    pixels = clip_pixels([Image.fromarray(image) for image in images], 32)
    cosine = np.sum(np.asarray(model.image_embeds(jnp.asarray(pixels))) * np.asarray(model.text_embeds(ids)), -1)
    np.testing.assert_allclose(scores, np.maximum(100 * cosine, 0), rtol=1e-5, atol=1e-4)

"""Images: preprocessing, the vision tower and prompts that hold images, against transformers
(fixtures/references/media, recorded by fixtures/record_references.py record-media from the tiny Gemma 3
with a SigLIP tower)."""

import functools
import gzip
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from spinf_jax.loader import load_model
from spinf_jax.media import MediaError, decode_data_url, open_image
from spinf_jax.models.layers import TreeBatch

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MEDIA = FIXTURES / "media"
REFERENCE = FIXTURES / "references" / "media" / "tiny-gemma3-vision.json.gz"
IMAGES = FIXTURES / "references" / "media" / "tiny-gemma3-vision.images.json.gz"


@functools.cache
def model():
    return load_model(str(FIXTURES / "tiny" / "gemma3-vision"), "fp32")


@functools.cache
def recorded_images() -> dict:
    return json.loads(gzip.decompress(IMAGES.read_bytes()))


def test_pixels_are_transformers_pil_preprocessor_bits():
    """Resize, rescale and normalise as Gemma3ImageProcessorPil does: RGB, greyscale and RGBA inputs, up-
    and down-sized."""
    for name, recorded in recorded_images().items():
        got = model().image_format.pixels(Image.open(MEDIA / name))
        np.testing.assert_array_equal(got, np.asarray(recorded["pixels"], np.float32), err_msg=name)


def test_soft_tokens_match_transformers():
    for name, recorded in recorded_images().items():
        got = model().soft_tokens(np.asarray(recorded["pixels"], np.float32))
        want = np.asarray(recorded["soft_tokens"])
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), err_msg=name)


def test_prompts_with_images_match_transformers():
    """Every next-token log-prob of prompts holding one or two images (their rows attend to each other both
    ways) within the tiny text fixtures' bound of transformers fp32; and not close without the images."""
    m, fmt = model(), model().image_format
    reference = json.loads(gzip.decompress(REFERENCE.read_bytes()))
    for prompt in reference["prompts"]:
        ids = prompt["token_ids"]
        starts = [i + 1 for i, t in enumerate(ids) if t == fmt.start_id]
        images = [
            (row, m.soft_tokens(fmt.pixels(Image.open(MEDIA / name))))
            for row, name in zip(starts, prompt["images"], strict=True)
        ]
        batch = TreeBatch.sequence(ids).with_images(images)
        hidden = m.hidden(batch)[: len(ids) - 1]
        ours, _ = m.logprobs(hidden, jnp.asarray(ids[1:])[:, None])
        gap = np.abs(np.asarray(ours)[:, 0] - np.asarray(prompt["logprobs"])).max()
        assert gap < 1e-4, (prompt["images"], gap)
        blind, _ = m.logprobs(
            m.hidden(TreeBatch.sequence(ids))[: len(ids) - 1], jnp.asarray(ids[1:])[:, None]
        )
        assert np.abs(np.asarray(blind)[:, 0] - np.asarray(prompt["logprobs"])).max() > 1.0


def test_image_rows_see_the_whole_image():
    """Without the image's two-way attention (the causal mask alone) the prompt's scores move: the test
    above would fail if `reach` were dropped."""
    m, fmt = model(), model().image_format
    prompt = json.loads(gzip.decompress(REFERENCE.read_bytes()))["prompts"][0]
    ids = prompt["token_ids"]
    row = ids.index(fmt.start_id) + 1
    soft = m.soft_tokens(fmt.pixels(Image.open(MEDIA / prompt["images"][0])))
    batch = TreeBatch.sequence(ids).with_images([(row, soft)])
    causal = batch.__class__(**{**batch.__dict__, "reach": None})
    targets = jnp.asarray(ids[1:])[:, None]
    both = np.asarray(m.logprobs(m.hidden(batch)[: len(ids) - 1], targets)[0])
    one_way = np.asarray(m.logprobs(m.hidden(causal)[: len(ids) - 1], targets)[0])
    assert np.abs(both - one_way).max() > 1e-2


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("https://example.com/cat.png", "invalid_media"),
        ("data:image/png;base64,not base64!", "invalid_media"),
        ("data:audio/wav;base64,AAAA", "unsupported_media"),
    ],
)
def test_bad_data_urls_say_why(url, code):
    with pytest.raises(MediaError) as e:
        decode_data_url(url, "messages[0].content[1]")
    assert e.value.code == code and "messages[0].content[1]" in str(e.value)


def test_corrupt_image_says_why():
    data = (MEDIA / "gradient.png").read_bytes()
    with pytest.raises(MediaError, match="not an image") as e:
        open_image(data[: len(data) // 2], "inputs[2].messages[0].content[0]")
    assert e.value.code == "invalid_media"

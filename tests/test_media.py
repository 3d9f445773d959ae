"""Images: preprocessing, the vision tower and prompts that hold images, against transformers
(fixtures/references/media, recorded by fixtures/record_references.py record-media from the tiny Gemma 3
with a SigLIP tower)."""

import base64
import dataclasses
import functools
import gzip
import json
from pathlib import Path

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from spinf_jax.compiler import Limits
from spinf_jax.errors import ScoringError
from spinf_jax.media import MediaError, decode_data_url, open_image
from spinf_jax.models.layers import TreeBatch
from spinf_jax.scoring import Scorer
from tests import engines
from tests.serving import serving

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MEDIA = FIXTURES / "media"
REFERENCE = FIXTURES / "references" / "media" / "tiny-gemma3-vision.json.gz"
IMAGES = FIXTURES / "references" / "media" / "tiny-gemma3-vision.images.json.gz"


def model():
    return engines.model("gemma3-vision")


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


def test_image_rows_see_the_whole_image():
    """Parity with transformers (fixtures/manifest.json's tiny-gemma3-vision entry, through the engine) holds
    only with the images read and their rows attending both ways: without the image, or with the causal mask
    alone, the recorded prompt's scores move."""
    m, fmt = model(), model().image_format
    prompt = json.loads(gzip.decompress(REFERENCE.read_bytes()))["prompts"][0]
    ids = prompt["token_ids"]
    row = ids.index(fmt.start_id) + 1
    soft = m.soft_tokens(fmt.pixels(Image.open(MEDIA / prompt["images"][0])))
    batch = TreeBatch.sequence(ids).with_images([(row, soft)])
    causal = dataclasses.replace(batch, reach=None)
    targets = jnp.asarray(ids[1:])[:, None]
    both = np.asarray(m.logprobs(m.hidden(batch)[: len(ids) - 1], targets)[0])[:, 0]
    one_way = np.asarray(m.logprobs(m.hidden(causal)[: len(ids) - 1], targets)[0])[:, 0]
    blind = np.asarray(m.logprobs(m.hidden(TreeBatch.sequence(ids))[: len(ids) - 1], targets)[0])[:, 0]
    np.testing.assert_allclose(both, prompt["logprobs"], atol=1e-4)
    assert np.abs(one_way - both).max() > 1e-2 and np.abs(blind - both).max() > 1.0


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


# ---------------------------------------------------------------------------------------------------------
# Through the scorer and the server


def data_url(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode((MEDIA / name).read_bytes()).decode()


def image_input(input_id: str, text: str, *names: str) -> dict:
    parts = [
        {"type": "text", "text": text},
        *({"type": "image_url", "image_url": {"url": data_url(n)}} for n in names),
    ]
    return {"id": input_id, "messages": [{"role": "user", "content": parts}]}


QUERY = {"id": "colour", "template": "\nQ: red or blue?\nA:{?}", "options": [" red", " blue"]}


def _logprobs(response: dict, input_id: str) -> list[float]:
    [result] = [r for r in response["results"] if r["input_id"] == input_id]
    return [o["logprob"] for o in result["queries"][0]["combinations"][0]["options"]]


def test_an_images_scores_do_not_depend_on_what_else_is_asked():
    """A content with images scores the same bits alone, packed after a long text content (another bucket),
    beside other images, and asked again (its soft tokens then come from the engine's cache)."""
    scorer = Scorer(engines.engine("gemma3-vision"), packs={})
    target = image_input("target", "Look:", "gradient.png", "grey.png")
    alone = scorer.score({"inputs": [target], "scoring": {"queries": [QUERY]}})
    assert alone["usage"]["prompt_tokens_details"]["image_tokens"] == 32
    long_text = {"id": "text", "messages": [{"role": "user", "content": "words " * 300}]}
    others = [long_text, image_input("other", "And:", "alpha.png", "stripes.png")]
    packed = scorer.score({"inputs": [*others, target], "scoring": {"queries": [QUERY]}})
    assert _logprobs(packed, "target") == _logprobs(alone, "target")
    assert _logprobs(packed, "other") != _logprobs(packed, "target")
    swapped = image_input("target", "Look:", "grey.png", "gradient.png")  # the images' order matters
    assert _logprobs(scorer.score({"inputs": [swapped], "scoring": {"queries": [QUERY]}}), "target") != (
        _logprobs(alone, "target")
    )


def test_the_server_reads_images_and_says_what_is_wrong_with_them():
    from spinf_jax.server.app import Settings, create_app

    settings = Settings(str(FIXTURES / "tiny" / "gemma3-vision"), "fp32", buckets=(256, 512, 1024), packs={})
    with serving(create_app(settings, engines.engine("gemma3-vision"))) as url:

        def post(*inputs):
            return httpx.post(
                f"{url}/v1/score", json={"inputs": list(inputs), "scoring": {"queries": [QUERY]}}
            )

        ok = post(image_input("a", "Look:", "gradient.png"))
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens_details"]["image_tokens"] == 16
        corrupt = image_input("a", "Look:", "gradient.png")
        url_field = corrupt["messages"][0]["content"][1]["image_url"]
        head, body = url_field["url"].split(",")
        url_field["url"] = f"{head},{body[:40]}"  # a truncated PNG, still valid base64
        remote = image_input("b", "Look:", "gradient.png")
        remote["messages"][0]["content"][1]["image_url"]["url"] = "https://example.com/cat.png"
        many = image_input("c", "Look:", *["grey.png"] * 17)
        for body, code, param in [
            (corrupt, "invalid_media", "inputs[0].messages[0].content[1].image_url.url"),
            (remote, "invalid_media", "inputs[0].messages[0].content[1].image_url.url"),
            (many, "too_many_images", "inputs[0].messages"),
        ]:
            answer = post(body)
            assert answer.status_code == 400 and answer.json()["error"]["code"] == code, answer.text
            assert answer.json()["error"]["param"] == param
        again = post(image_input("a", "Look:", "gradient.png")).json()
        assert _logprobs(again, "a") == _logprobs(ok.json(), "a")
        limits = httpx.get(f"{url}/health").json()["limits"]
        assert limits["max_images_per_content"] == 16 and limits["max_image_bytes"] == 1_500_000


def test_image_limits_at_their_edges():
    """As tests/test_limits.py does for the text limits: at the limit it scores, one past it is refused."""
    size = len((MEDIA / "grey.png").read_bytes())
    scorer = Scorer(
        engines.engine("gemma3-vision"), Limits(max_images_per_content=3, max_image_bytes=size), {}
    )
    for images, code in [(3, None), (4, "too_many_images")]:
        body = {
            "inputs": [image_input("a", "Look:", *["grey.png"] * images)],
            "scoring": {"queries": [QUERY]},
        }
        if code is None:
            assert scorer.score(body)["usage"]["prompt_tokens_details"]["image_tokens"] == 16 * images
        else:
            with pytest.raises(ScoringError, match="4 images") as e:
                scorer.score(body)
            assert e.value.code == code
    larger = len((MEDIA / "gradient.png").read_bytes())
    with pytest.raises(ScoringError, match=f"{larger:,} bytes") as e:
        scorer.score({"inputs": [image_input("a", "Look:", "gradient.png")], "scoring": {"queries": [QUERY]}})
    assert e.value.code == "invalid_media" and e.value.param == "inputs[0].messages[0].content[1]"

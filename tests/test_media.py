"""Images: preprocessing, the vision towers and prompts that hold images, against transformers
(fixtures/references/media, recorded by fixtures/record_references.py record-media from the tiny Gemma 3
with a SigLIP tower and the tiny Gemma 4 with its vision tower)."""

import base64
import dataclasses
import functools
import gzip
import http.server
import json
import threading
import time
from pathlib import Path

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from spinf_jax import media
from spinf_jax.client import Client
from spinf_jax.compiler import Limits
from spinf_jax.errors import ScoringError
from spinf_jax.media import MediaError, decode_data_url, open_image
from spinf_jax.models.layers import TreeBatch
from spinf_jax.scoring import Scorer
from tests import engines
from tests.serving import serving

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MEDIA = FIXTURES / "media"
REFERENCES = FIXTURES / "references" / "media"
FAMILIES = ("gemma3-vision", "gemma4-vision")


def model(family: str = "gemma3-vision"):
    return engines.model(family)


@functools.cache
def recorded_images(family: str = "gemma3-vision") -> dict:
    return json.loads(gzip.decompress((REFERENCES / f"tiny-{family}.images.json.gz").read_bytes()))


@functools.cache
def recorded_prompts(family: str) -> list[dict]:
    return json.loads(gzip.decompress((REFERENCES / f"tiny-{family}.json.gz").read_bytes()))["prompts"]


def test_pixels_are_transformers_pil_preprocessor_bits():
    """Gemma 3: resize, rescale and normalise as Gemma3ImageProcessorPil does: RGB, greyscale and RGBA
    inputs, up- and down-sized."""
    for name, recorded in recorded_images().items():
        [got] = model().image_format.tower_inputs(Image.open(MEDIA / name), name)
        np.testing.assert_array_equal(got, np.asarray(recorded["pixels"], np.float32), err_msg=name)


def test_gemma4_patches_are_transformers_pil_preprocessor_bits():
    """Gemma 4: each image resized keeping its aspect ratio (grey.png already fits and is not resized),
    cut into patches, padded to the budget, with the patches' grid positions, as Gemma4ImageProcessorPil
    does (recorded as the k of each value k / 255)."""
    fmt = model("gemma4-vision").image_format
    for name, recorded in recorded_images("gemma4-vision").items():
        patches, positions = fmt.tower_inputs(Image.open(MEDIA / name), name)
        want = (np.asarray(recorded["patches"], np.float64) * (1 / 255)).astype(np.float32)
        np.testing.assert_array_equal(patches, want, err_msg=name)
        np.testing.assert_array_equal(positions, np.asarray(recorded["positions"]), err_msg=name)


def test_gemma4_soft_token_counts_are_the_processors():
    """An image's soft-token count follows from its size as in transformers' processor (its function, which
    runs without torch), for ordinary and extreme aspect ratios; one too small for a single square is
    refused."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    fmt = model("gemma4-vision").image_format
    rng = np.random.default_rng(0)
    sizes = [tuple(s) for s in rng.integers(1, 400, size=(200, 2))] + [(1, 1000), (1000, 1), (3, 5), (8, 8)]
    for width, height in sizes:
        try:
            h, w = get_aspect_ratio_preserving_size(height, width, fmt.patch, fmt.max_patches, fmt.pool)
        except ValueError:
            with pytest.raises(MediaError, match="too small") as e:
                fmt.soft_count((width, height), "x")
            assert e.value.code == "invalid_media"
            continue
        want = (h // fmt.patch) * (w // fmt.patch) // fmt.pool**2
        assert fmt.soft_count((width, height), "x") == want, (width, height)


@pytest.mark.parametrize("family", FAMILIES)
def test_soft_tokens_match_transformers(family):
    m = model(family)
    for name, recorded in recorded_images(family).items():
        inputs = m.image_format.tower_inputs(Image.open(MEDIA / name), name)
        want = np.asarray(recorded["soft_tokens"])
        got = m.soft_tokens(*inputs)[: m.image_format.soft_count(Image.open(MEDIA / name).size, name)]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), err_msg=name)


def _prompt_logprobs(m, prompt: dict, both_ways: bool = True) -> np.ndarray:
    """A recorded prompt's log-probabilities through the model, its images read (both_ways=False: with the
    causal mask alone; no images: none read)."""
    fmt, ids = m.image_format, prompt["token_ids"]
    rows = [i + 1 for i, token in enumerate(ids) if token == fmt.start_id]
    images = []
    for row, name in zip(rows, prompt["images"], strict=False):  # none: the images not read
        image = Image.open(MEDIA / name)
        soft = m.soft_tokens(*fmt.tower_inputs(image, name))[: fmt.soft_count(image.size, name)]
        images.append((row, soft))
    batch = TreeBatch.sequence(ids)
    if images:
        batch = batch.with_media(images)
    if not both_ways:
        batch = dataclasses.replace(batch, reach=None)
    targets = jnp.asarray(ids[1:])[:, None]
    return np.asarray(m.logprobs(m.hidden(batch)[: len(ids) - 1], targets)[0])[:, 0]


def test_image_rows_see_the_whole_image():
    """Gemma 3: parity with transformers (fixtures/manifest.json's tiny-gemma3-vision entry, through the
    engine) holds only with the images read and their rows attending both ways: without the image, or with
    the causal mask alone, the recorded prompt's scores move."""
    m = model()
    prompt = recorded_prompts("gemma3-vision")[0]
    both = _prompt_logprobs(m, prompt)
    one_way = _prompt_logprobs(m, prompt, both_ways=False)
    blind = _prompt_logprobs(m, {**prompt, "images": []})
    np.testing.assert_allclose(both, prompt["logprobs"], atol=1e-4)
    assert np.abs(one_way - both).max() > 1e-2 and np.abs(blind - both).max() > 1.0


def test_gemma4_image_rows_see_each_other_on_sliding_layers_only(monkeypatch):
    """Gemma 4 (use_bidirectional_attention "vision"): parity holds with an image's rows seeing the whole
    image on the sliding layers and attending causally on the global one; causal everywhere, or both ways on
    every layer as Gemma 3 does, moves the scores by more than a nat. (The manifest's parity also fails,
    by 4.8 to 10.6, if an image row's per-layer input is its own token's rather than the pad token's.)"""
    from spinf_jax.models import gemma4

    m, prompt = model("gemma4-vision"), recorded_prompts("gemma4-vision")[1]  # two images
    np.testing.assert_allclose(_prompt_logprobs(m, prompt), prompt["logprobs"], atol=1e-4)
    assert np.abs(_prompt_logprobs(m, prompt, both_ways=False) - prompt["logprobs"]).max() > 1.0
    attention = gemma4.attention
    monkeypatch.setattr(gemma4, "attention", lambda *a, **k: attention(*a, **{**k, "media_both_ways": True}))
    everywhere = dataclasses.replace(m, _jitted={})  # traced again, with the patched attention
    assert np.abs(_prompt_logprobs(everywhere, prompt) - prompt["logprobs"]).max() > 1.0


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


def _soft_count(family: str, *names: str) -> int:
    fmt = model(family).image_format
    return sum(fmt.soft_count(Image.open(MEDIA / name).size, name) for name in names)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_images_scores_do_not_depend_on_what_else_is_asked(family):
    """A content with images scores the same bits alone, packed after a long text content (another bucket),
    beside other images (of other sizes, for Gemma 4), and asked again (its soft tokens then come from the
    engine's cache)."""
    scorer = Scorer(engines.engine(family), packs={})
    target = image_input("target", "Look:", "gradient.png", "grey.png")
    alone = scorer.score({"inputs": [target], "scoring": {"queries": [QUERY]}})
    counted = alone["usage"]["prompt_tokens_details"]["image_tokens"]
    assert counted == _soft_count(family, "gradient.png", "grey.png")
    assert counted == {"gemma3-vision": 16 + 16, "gemma4-vision": 63 + 64}[family]
    long_text = {"id": "text", "messages": [{"role": "user", "content": "words " * 300}]}
    others = [long_text, image_input("other", "And:", "alpha.png", "stripes.png")]
    packed = scorer.score({"inputs": [*others, target], "scoring": {"queries": [QUERY]}})
    assert _logprobs(packed, "target") == _logprobs(alone, "target")
    assert _logprobs(packed, "other") != _logprobs(packed, "target")
    swapped = image_input("target", "Look:", "grey.png", "gradient.png")  # the images' order matters
    assert _logprobs(scorer.score({"inputs": [swapped], "scoring": {"queries": [QUERY]}}), "target") != (
        _logprobs(alone, "target")
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_the_server_reads_images_and_says_what_is_wrong_with_them(family):
    from spinf_jax.server.app import Settings, create_app

    settings = Settings(str(FIXTURES / "tiny" / family), "fp32", buckets=(256, 512, 1024), packs={})
    with serving(create_app(settings, engines.engine(family))) as url:

        def post(*inputs):
            return httpx.post(
                f"{url}/v1/score", json={"inputs": list(inputs), "scoring": {"queries": [QUERY]}}
            )

        ok = post(image_input("a", "Look:", "gradient.png"))
        assert ok.status_code == 200, ok.text
        image_tokens = ok.json()["usage"]["prompt_tokens_details"]["image_tokens"]
        assert image_tokens == _soft_count(family, "gradient.png")
        corrupt = image_input("a", "Look:", "gradient.png")
        url_field = corrupt["messages"][0]["content"][1]["image_url"]
        head, body = url_field["url"].split(",")
        url_field["url"] = f"{head},{body[:40]}"  # a truncated PNG, still valid base64
        remote = image_input("b", "Look:", "gradient.png")
        remote["messages"][0]["content"][1]["image_url"]["url"] = "https://example.com/cat.png"
        many = image_input("c", "Look:", *["grey.png"] * 17)
        for body, code, param in [
            (corrupt, "invalid_media", "inputs[0].messages[0].content[1].image_url.url"),
            (remote, "remote_media_disabled", "inputs[0].messages[0].content[1].image_url.url"),
            (many, "too_many_images", "inputs[0].messages"),
        ]:
            answer = post(body)
            assert answer.status_code == 400 and answer.json()["error"]["code"] == code, answer.text
            assert answer.json()["error"]["param"] == param
        again = post(image_input("a", "Look:", "gradient.png")).json()
        assert _logprobs(again, "a") == _logprobs(ok.json(), "a")
        limits = httpx.get(f"{url}/health").json()["limits"]
        assert limits["max_images_per_content"] == 16 and limits["max_image_bytes"] == 1_500_000
        # Gemma 4 reads video as frames, Gemma 3 does not; neither of these hears audio.
        assert ("max_video_frames_per_content" in limits) == (family == "gemma4-vision")
        assert "max_audio_seconds_per_content" not in limits
        assert limits["allow_remote_media"] is False and limits["remote_media_timeout_s"] == 10
        with Client(url) as client:  # the typed client reads the flag and the seconds among the numbers
            assert client.health().limits["allow_remote_media"] is False


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


# ---------------------------------------------------------------------------------------------------------
# Remote images (--allow-remote-media)


class _Files(http.server.BaseHTTPRequestHandler):
    """A local web server's answers: an image, a page, a large image, a slow one, a redirect, a 404."""

    def do_GET(self):
        grey = (MEDIA / "grey.png").read_bytes()
        answers = {
            "/grey.png": (200, "image/png", grey),
            "/page.html": (200, "text/html", b"<html></html>"),
            "/large.png": (200, "image/png", grey * 50),
            "/slow.png": (200, "image/png", None),
        }
        if self.path == "/elsewhere.png":
            self.send_response(302)
            self.send_header("Location", "ftp://example.com/grey.png")
            self.end_headers()
            return
        status, kind, body = answers.get(self.path, (404, "text/plain", b"no such file"))
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.end_headers()
        if body is None:  # a byte at a time, slower than any timeout the test sets
            for byte in grey[:40]:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.05)
            return
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def web(request):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    request.addfinalizer(server.shutdown)
    return f"http://127.0.0.1:{server.server_port}"


def test_remote_images_are_fetched_within_their_limits(web, monkeypatch):
    """media.fetch on a local server (http allowed for the test; the product allows https only): the file's
    bytes, or the error each failure gets, the size and time limits included."""
    where = "messages[0].content[1].image_url.url"
    fetch = functools.partial(media.fetch, param=where, max_bytes=100_000, timeout_s=1.0)
    with pytest.raises(MediaError, match="https://") as e:
        fetch(f"{web}/grey.png")  # plain http is refused before anything is fetched
    assert e.value.code == "invalid_media"
    monkeypatch.setattr(media, "REMOTE_SCHEMES", ("http",))
    assert fetch(f"{web}/grey.png") == (MEDIA / "grey.png").read_bytes()
    large = len((MEDIA / "grey.png").read_bytes()) * 50
    for path, code, says in [
        ("/page.html", "unsupported_media", "'text/html', not an image"),
        ("/missing.png", "media_unreachable", "answered 404"),
        ("/elsewhere.png", "media_unreachable", "redirected to 'ftp://"),
    ]:
        with pytest.raises(MediaError, match=says) as e:
            fetch(web + path)
        assert e.value.code == code and where in str(e.value)
    with pytest.raises(MediaError, match="more than") as e:
        media.fetch(f"{web}/large.png", where, max_bytes=large - 1, timeout_s=1.0)
    assert e.value.code == "invalid_media"
    assert len(media.fetch(f"{web}/large.png", where, max_bytes=large, timeout_s=1.0)) == large
    start = time.monotonic()
    with pytest.raises(MediaError, match="not read whole within 0.5 s") as e:
        media.fetch(f"{web}/slow.png", where, max_bytes=100_000, timeout_s=0.5)
    assert e.value.code == "media_unreachable" and time.monotonic() - start < 1.5


def test_a_fetched_image_scores_as_its_data_url(web, monkeypatch):
    """Through the scorer: refused unless the limits allow remote media; allowed, the image fetched from its
    URL scores the same bits as the same file sent as a data URL."""
    monkeypatch.setattr(media, "REMOTE_SCHEMES", ("http",))
    engine = engines.engine("gemma3-vision")
    sent = image_input("a", "Look:", "grey.png")
    fetched = image_input("a", "Look:", "grey.png")
    fetched["messages"][0]["content"][1]["image_url"]["url"] = f"{web}/grey.png"
    body = {"inputs": [fetched], "scoring": {"queries": [QUERY]}}
    with pytest.raises(ScoringError, match="--allow-remote-media") as e:
        Scorer(engine, Limits(), {}).score(body)
    assert e.value.code == "remote_media_disabled"
    scorer = Scorer(engine, Limits(allow_remote_media=True, remote_media_timeout_s=2.0), {})
    want = scorer.score({"inputs": [sent], "scoring": {"queries": [QUERY]}})
    assert _logprobs(scorer.score(body), "a") == _logprobs(want, "a")
    fetched["messages"][0]["content"][1]["image_url"]["url"] = f"{web}/page.html"
    with pytest.raises(ScoringError, match="not an image type") as e:
        scorer.score(body)
    assert e.value.code == "unsupported_media"
    assert e.value.param == "inputs[0].messages[0].content[1].image_url.url"


# ---------------------------------------------------------------------------------------------------------
# Video, as frames (Gemma 4; the manifest's tiny-gemma4-video entry checks parity through the engine)


def video_input(input_id: str, text: str, *names: str, fps: float | None = None) -> dict:
    video = {"frames": [data_url(n) for n in names], **({} if fps is None else {"fps": fps})}
    parts = [{"type": "text", "text": text}, {"type": "video_url", "video_url": video}]
    return {"id": input_id, "messages": [{"role": "user", "content": parts}]}


def test_a_videos_scores_do_not_depend_on_what_else_is_asked():
    """A video's frames are read at the video budget (their tokens counted as video tokens), its time stamps
    written as Gemma 4's processor writes them; it scores the same bits alone and packed with an image
    content; its frames' order and rate matter."""
    scorer = Scorer(engines.engine("gemma4-vision"), packs={})
    frames = model("gemma4-vision").image_format.frames()
    target = video_input("target", "Clip:", "gradient.png", "grey.png", "stripes.png")
    alone = scorer.score({"inputs": [target], "scoring": {"queries": [QUERY]}})
    details = alone["usage"]["prompt_tokens_details"]
    want = sum(
        frames.soft_count(Image.open(MEDIA / n).size, n) for n in ("gradient.png", "grey.png", "stripes.png")
    )
    assert details["video_tokens"] == want and details["image_tokens"] == 0
    other = image_input("other", "Look:", "alpha.png")
    packed = scorer.score({"inputs": [other, target], "scoring": {"queries": [QUERY]}})
    assert _logprobs(packed, "target") == _logprobs(alone, "target")
    assert packed["usage"]["prompt_tokens_details"]["image_tokens"] == _soft_count(
        "gemma4-vision", "alpha.png"
    )
    reordered = video_input("target", "Clip:", "grey.png", "gradient.png", "stripes.png")
    faster = video_input("target", "Clip:", "gradient.png", "grey.png", "stripes.png", fps=0.1)
    for changed in (reordered, faster):
        scored = scorer.score({"inputs": [changed], "scoring": {"queries": [QUERY]}})
        assert _logprobs(scored, "target") != _logprobs(alone, "target")


def test_the_frames_budget_is_the_video_processors(tmp_path):
    """A checkpoint's video_preprocessor_config.json sets its frames' budget (70 soft tokens by default, as
    Gemma4VideoProcessor's), apart from its images'."""
    from spinf_jax.media import ImageFormat

    folder = FIXTURES / "tiny" / "gemma4-vision"
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text((folder / "preprocessor_config.json").read_text())
    assert ImageFormat.from_checkpoint(config, tmp_path).frames().max_soft_tokens == 70
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 140}))
    fmt = ImageFormat.from_checkpoint(config, tmp_path)
    assert (fmt.max_soft_tokens, fmt.frames().max_soft_tokens) == (70, 140)
    assert fmt.frames().soft_count((400, 300), "x") > fmt.soft_count((400, 300), "x")


@pytest.mark.parametrize(
    ("video", "code", "where"),
    [
        ({"url": "data:video/mp4;base64,AAAA"}, "unsupported_media", ".video_url.url"),
        ({"frames": []}, "invalid_request", ".video_url.frames"),
        ({"frames": ["data:image/png;base64,AAAA"], "fps": 0}, "invalid_request", ".video_url.fps"),
        ({"frames": ["data:image/png;base64,AAAA"]}, "invalid_media", ".video_url.frames[0]"),
        ({"frames": ["data:image/png;base64,AAAA"] * 33}, "too_many_frames", ""),
    ],
)
def test_bad_videos_say_why(video, code, where):
    scorer = Scorer(engines.engine("gemma4-vision"), packs={})
    part = {"type": "video_url", "video_url": video}
    body = {"inputs": [{"id": "a", "messages": [{"content": [part]}]}], "scoring": {"queries": [QUERY]}}
    with pytest.raises(ScoringError) as e:
        scorer.score(body)
    param = "inputs[0].messages" if code == "too_many_frames" else "inputs[0].messages[0].content[0]" + where
    assert (e.value.code, e.value.param) == (code, param), e.value


def test_gemma3_reads_no_video():
    scorer = Scorer(engines.engine("gemma3-vision"), packs={})
    with pytest.raises(ScoringError, match="reads text and images") as e:
        scorer.score({"inputs": [video_input("a", "Clip:", "grey.png")], "scoring": {"queries": [QUERY]}})
    assert e.value.code == "unsupported_content"

"""Audio: decoding, Gemma 4's log-mel features and soft-token counts, and its audio tower, against
transformers (fixtures/references/media/tiny-gemma4-audio.audio.json.gz, recorded by fixtures/record_audio.py
from the tiny Gemma 4 with an audio tower in fixtures/tiny/gemma4-audio and the clips in fixtures/media)."""

import base64
import functools
import gzip
import io
import json
import struct
import wave
from pathlib import Path

import httpx
import jax
import numpy as np
import openai
import pytest
from flax import nnx

from spinf_jax import audio
from spinf_jax.compiler import Limits
from spinf_jax.errors import ScoringError
from spinf_jax.loader import load_weights, open_checkpoint
from spinf_jax.media import MediaError
from spinf_jax.models import gemma4_audio
from spinf_jax.quant import Precision
from spinf_jax.scoring import Scorer
from tests import engines
from tests.serving import serving

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MEDIA = FIXTURES / "media"
FOLDER = FIXTURES / "tiny" / "gemma4-audio"
CLIPS_16K = ("tone.wav", "click-8bit.wav", "voice.mp3")  # at the extractor's rate: features recorded
# Measured max |our soft token - transformers'| in f32 over the three clips: 1.6e-5 (values up to 12.6).
FP32_ATOL = 5e-5


@functools.cache
def recorded() -> dict:
    return json.loads(
        gzip.decompress((FIXTURES / "references/media/tiny-gemma4-audio.audio.json.gz").read_bytes())
    )


def clip(name: str) -> dict:
    return recorded()["clips"][name]


@functools.cache
def feature_config() -> audio.FeatureConfig:
    return audio.FeatureConfig.from_preprocessor(
        json.loads((FOLDER / "preprocessor_config.json").read_text())
    )


def decoded(name: str) -> tuple[np.ndarray, int]:
    return audio.decode((MEDIA / name).read_bytes(), name.rsplit(".", 1)[1], name)


@functools.cache
def tower(precision: Precision = Precision.FP32):
    """The tiny checkpoint's tower, and its program for one clip padded to MAX_FRAMES (split-state jit: the
    weights are an argument, not constants folded into the program)."""
    cfg = gemma4_audio.Config.from_hf(json.loads((FOLDER / "config.json").read_text()))
    module = nnx.eval_shape(lambda: gemma4_audio.AudioTower(cfg, precision))
    load_weights(module, open_checkpoint(FOLDER))
    graph, state = nnx.split(module)
    run = jax.jit(lambda state, f, m: nnx.merge(graph, state)(f, m))
    return lambda features, mask: run(state, *gemma4_audio.pad_frames(features, mask))


def soft_tokens(name: str, precision: Precision = Precision.FP32) -> tuple[np.ndarray, np.ndarray]:
    """A fixture clip's soft tokens and their mask, from its recorded features (the first rows: as many as
    transformers' output has)."""
    c = clip(name)
    out, mask = tower(precision)(np.asarray(c["features"], np.float32), np.asarray(c["features_mask"]))
    rows = len(c["soft_tokens"])
    return np.asarray(out, np.float32)[:rows], np.asarray(mask)[:rows]


# ---------------------------------------------------------------------------------------------------------
# Features and counts
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CLIPS_16K)
def test_features_are_transformers_bits(name):
    """Decoded, then features: the same bits as Gemma4AudioFeatureExtractor's (measured max |Δ| 0.0; numpy
    2.4.4 here, 2.4.6 where recorded), the same mask, padded frames zero."""
    samples, rate = decoded(name)
    assert rate == clip(name)["sample_rate"] == feature_config().sampling_rate
    features, mask = audio.features(samples, feature_config())
    want = np.asarray(clip(name)["features"], np.float32)
    assert features.dtype == np.float32 and features.shape == want.shape
    np.testing.assert_array_equal(mask, clip(name)["features_mask"])
    np.testing.assert_allclose(features, want, rtol=0, atol=1e-6)
    assert not features[~mask].any()


def test_soft_token_counts_are_the_processors():
    """soft_token_count equals Gemma4Processor's for clips from none to 60 s (capped at 750 past 30 s), and
    the valid rows of the tower's output mask for the fixture clips."""
    for samples, want in recorded()["soft_token_counts"]:
        assert audio.soft_token_count(samples, feature_config()) == want, samples
        if 0 < samples <= 480_000:  # the features' mask, halved twice as the tower halves it
            _, mask = audio.features(np.zeros(samples, np.float32), feature_config())
            assert int(mask[::2][::2].sum()) == want, samples
    for name in CLIPS_16K:
        assert audio.soft_token_count(decoded(name)[0].size) == sum(clip(name)["soft_tokens_mask"])


def test_feature_settings_are_read_from_the_preprocessor():
    cfg = audio.FeatureConfig.from_preprocessor(
        {"feature_extractor": {"preemphasis": 0.97, "per_bin_mean": [0.0]}}
    )
    assert cfg.preemphasis == 0.97 and cfg.per_bin_mean == (0.0,) and cfg.feature_size == 128
    assert (cfg.frame_length, cfg.hop_length, cfg.fft_length) == (320, 160, 512)
    with pytest.raises(ValueError, match="dither"):
        audio.FeatureConfig.from_preprocessor({"dither": 1e-4})


# ---------------------------------------------------------------------------------------------------------
# The tower
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CLIPS_16K)
def test_soft_tokens_match_transformers(name):
    """f32: within FP32_ATOL of get_audio_features' pooler_output on every row transformers returns, and the
    same output mask. click-8bit.wav's last row is padding: it matches too, as its attention window still
    reaches valid frames (a padded row whose window holds none averages whatever padding follows, which
    differs between our MAX_FRAMES and transformers' own length)."""
    got, mask = soft_tokens(name)
    want = np.asarray(clip(name)["soft_tokens"], np.float32)
    np.testing.assert_array_equal(mask, clip(name)["soft_tokens_mask"])
    np.testing.assert_allclose(got, want, rtol=0, atol=FP32_ATOL)


def test_bf16_soft_tokens_are_close():
    """bf16 runs and stays near transformers' f32 tokens: measured max |Δ| 0.30 and mean |Δ| ~0.05 on values
    up to 12.6, as transformers' own bf16 tower (max 0.25 to 0.29 from its f32)."""
    for name in CLIPS_16K:
        got, mask = soft_tokens(name, Precision.BF16)
        want = np.asarray(clip(name)["soft_tokens"], np.float32)[mask]
        gap = np.abs(got[mask] - want)
        assert gap.max() < 0.6 and gap.mean() < 0.1, (name, gap.max(), gap.mean())


def test_a_clips_soft_tokens_do_not_depend_on_the_clip_before():
    """One program (features padded to MAX_FRAMES = 3000, the frames of the longest clip the extractor keeps,
    30 s, rounded to a multiple of 4): a clip's soft tokens are the same bits alone and after another clip,
    and its padded frames (zeros, mask False) leave the valid rows as transformers computes them."""
    alone, _ = soft_tokens("voice.mp3")
    soft_tokens("tone.wav")
    after, _ = soft_tokens("voice.mp3")
    np.testing.assert_array_equal(alone, after)


def test_config_refuses_what_transformers_would_not_load():
    config = json.loads((FOLDER / "config.json").read_text())
    config["audio_config"]["subsampling_conv_channels"] = [8, 4]  # (8 // 4) · 4 != 32 mel rows · 4
    with pytest.raises(ValueError, match="mel bins"):
        gemma4_audio.Config.from_hf(config)


# ---------------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tone.wav", "click-8bit.wav", "noise-8k.wav", "voice.mp3"])
def test_fixture_clips_decode_as_recorded(name):
    """16-bit and 8-bit (unsigned) PCM, two channels averaged, mp3: the samples the fixture script read."""
    samples, rate = decoded(name)
    assert samples.dtype == np.float32 and rate == clip(name)["sample_rate"]
    np.testing.assert_array_equal(samples, np.asarray(clip(name)["samples"], np.float32))


def _wav(pcm: bytes, width: int, channels: int = 1, rate: int = 16_000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(pcm)
    return out.getvalue()


def test_wav_sample_widths():
    """Each width's full scale maps to [-1, 1): 8-bit unsigned around 128, the others signed."""
    cases = {
        1: (np.array([0, 128, 255], np.uint8).tobytes(), [-1.0, 0.0, 127 / 128]),
        2: (np.array([-32768, 0, 16384], "<i2").tobytes(), [-1.0, 0.0, 0.5]),
        3: (bytes([0, 0, 0x80, 0, 0, 0, 0, 0, 0x40, 0xFF, 0xFF, 0xFF]), [-1.0, 0.0, 0.5, -(2.0**-23)]),
        4: (np.array([-(2**31), 0, 2**30], "<i4").tobytes(), [-1.0, 0.0, 0.5]),
    }
    for width, (pcm, want) in cases.items():
        samples, rate = audio.decode(_wav(pcm, width), "wav", "audio")
        assert rate == 16_000
        np.testing.assert_array_equal(samples, np.asarray(want, np.float32), err_msg=f"{8 * width}-bit")
    stereo = np.array([[1000, 3000], [-2000, 0]], "<i2").tobytes()
    samples, _ = audio.decode(_wav(stereo, 2, channels=2), "wav", "audio")
    np.testing.assert_array_equal(samples, np.array([2000, -1000], np.float32) / 32768)


@pytest.mark.parametrize(
    ("data", "fmt"),
    [
        (b"", "wav"),
        (b"RIFF\x00\x00\x00\x00WAVEjunk", "wav"),
        (b"not audio at all" * 20, "wav"),
        (_wav(b"", 2), "wav"),  # a valid header, no samples
        ((MEDIA / "tone.wav").read_bytes()[:30], "wav"),  # cut inside the header
        (b"\x00\x01" * 500, "mp3"),
        (b"", "mp3"),
        ((MEDIA / "tone.wav").read_bytes(), "ogg"),
    ],
)
def test_corrupt_audio_is_invalid_media(data, fmt):
    with pytest.raises(MediaError, match="^clip: ") as raised:
        audio.decode(data, fmt, "clip")
    assert raised.value.code == "invalid_media"


def _float_wav(values: np.ndarray, extensible: bool = False, channels: int = 1) -> bytes:
    """A 32-bit IEEE float WAV file written by hand (stdlib wave writes PCM only): format tag 3, or 0xFFFE
    with the float sub-format."""
    data = values.astype("<f4").tobytes()
    rate, block = 16_000, 4 * channels
    fmt = struct.pack("<HHIIHH", 0xFFFE if extensible else 3, channels, rate, rate * block, block, 32)
    if extensible:  # cbSize, valid bits, channel mask, the sub-format GUID (KSDATAFORMAT_SUBTYPE_IEEE_FLOAT)
        guid = bytes.fromhex("0300000000001000800000aa00389b71")
        fmt += struct.pack("<HHI", 22, 32, 0) + guid
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


@pytest.mark.parametrize("extensible", [False, True])
def test_float_wav_is_read_as_it_is(extensible):
    """IEEE-float WAV (format 3, or extensible with the float sub-format), which stdlib wave refuses: its
    values come back unchanged, channels averaged."""
    values = np.array([-1.0, -0.25, 0.0, 0.123456789, 0.75], np.float32)
    samples, rate = audio.decode(_float_wav(values, extensible), "wav", "clip")
    assert rate == 16_000
    np.testing.assert_array_equal(samples, values)
    stereo = np.array([[0.5, -0.5], [0.25, 0.75]], np.float32)
    samples, _ = audio.decode(_float_wav(stereo.ravel(), channels=2), "wav", "clip")
    np.testing.assert_array_equal(samples, stereo.mean(axis=1))


# ---------------------------------------------------------------------------------------------------------
# Resampling
# ---------------------------------------------------------------------------------------------------------


def test_resampling_keeps_what_is_below_both_nyquists():
    """8 kHz → 16 kHz and 44.1 kHz → 16 kHz: a sine below both Nyquist frequencies comes out as the same sine
    at the new rate (away from the clip's edges, where the signal is taken as zero outside), a constant stays
    constant, and a tone above the new Nyquist is filtered out."""
    for rate, hz in ((8000, 440.0), (44_100, 1000.0), (22_050, 3000.0)):
        t = np.arange(rate // 2) / rate
        samples = (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
        out = audio.resample(samples, rate, 16_000)
        assert out.dtype == np.float32 and out.size == -(-samples.size * 16_000 // rate)
        want = 0.5 * np.sin(2 * np.pi * hz * np.arange(out.size) / 16_000)
        np.testing.assert_allclose(out[200:-200], want[200:-200], atol=2e-3, err_msg=f"{rate} Hz")
    flat = audio.resample(np.full(4410, 0.25, np.float32), 44_100, 16_000)
    np.testing.assert_allclose(flat[100:-100], 0.25, atol=1e-6)
    t = np.arange(44_100 // 2) / 44_100
    alias = audio.resample(np.sin(2 * np.pi * 12_000 * t).astype(np.float32), 44_100, 16_000)
    # 12 kHz has no place at 16 kHz: removed, not aliased to 4 kHz.
    assert np.abs(alias[200:-200]).max() < 1e-3
    same = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(audio.resample(same, 16_000, 16_000), same)


def test_read_resamples_the_8k_clip():
    samples = audio.read((MEDIA / "noise-8k.wav").read_bytes(), "wav", "clip", feature_config())
    recorded_8k = np.asarray(clip("noise-8k.wav")["samples"], np.float32)
    assert samples.size == 2 * recorded_8k.size
    np.testing.assert_allclose(samples[100:-100:2], recorded_8k[50:-50], atol=1e-6)  # the original samples


# ---------------------------------------------------------------------------------------------------------
# Through the scorer and the server (the manifest's tiny-gemma4-audio entry checks parity through the engine)
# ---------------------------------------------------------------------------------------------------------

QUERY = {"id": "heard", "template": "\nQ: speech or noise?\nA:{?}", "options": [" speech", " noise"]}


def audio_part(name: str, kind: str | None = None) -> dict:
    data = base64.b64encode((MEDIA / name).read_bytes()).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": kind or name.rsplit(".", 1)[1]}}


def audio_input(input_id: str, text: str, *parts: dict) -> dict:
    return {
        "id": input_id,
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}],
    }


def _logprobs(response: dict, input_id: str) -> list[float]:
    [result] = [r for r in response["results"] if r["input_id"] == input_id]
    return [o["logprob"] for o in result["queries"][0]["combinations"][0]["options"]]


def _count(name: str) -> int:
    return audio.soft_token_count(
        len(audio.read((MEDIA / name).read_bytes(), name[-3:], name, feature_config()))
    )


def test_a_clips_scores_do_not_depend_on_what_else_is_asked():
    """A content with audio (a wav and an mp3 at 16 kHz, an 8 kHz stereo wav resampled) scores the same bits
    alone, after other contents, and asked again (its soft tokens then come from the engine's cache); its
    soft tokens are counted in usage; another clip gives other scores."""
    scorer = Scorer(engines.engine("gemma4-audio"), packs={})
    target = audio_input("target", "Listen:", audio_part("voice.mp3"), audio_part("noise-8k.wav"))
    alone = scorer.score({"inputs": [target], "scoring": {"queries": [QUERY]}})
    details = alone["usage"]["prompt_tokens_details"]
    assert (
        details["audio_tokens"] == _count("voice.mp3") + _count("noise-8k.wav")
        and details["image_tokens"] == 0
    )
    other = audio_input("other", "And:", audio_part("tone.wav"))
    long_text = {"id": "text", "messages": [{"role": "user", "content": "words " * 300}]}
    packed = scorer.score({"inputs": [long_text, other, target], "scoring": {"queries": [QUERY]}})
    assert _logprobs(packed, "target") == _logprobs(alone, "target")
    assert _logprobs(packed, "other") != _logprobs(packed, "target")


@pytest.mark.parametrize(
    ("part", "code", "where"),
    [
        (
            {"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}},
            "invalid_media",
            ".input_audio.data",
        ),
        ({"type": "input_audio", "input_audio": {"format": "wav"}}, "invalid_request", ".input_audio.data"),
        (audio_part("tone.wav", "flac"), "unsupported_media", ".input_audio.format"),
        (audio_part("voice.mp3", "wav"), "invalid_media", ".input_audio.data"),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            "unsupported_content",
            "",
        ),
    ],
)
def test_bad_audio_parts_say_why(part, code, where):
    """Each bad part is a ScoringError with its own code and field: not base64, no data, a format we do not
    decode, a file that is not what its format says, and an image sent to a model that hears but does not
    see."""
    scorer = Scorer(engines.engine("gemma4-audio"), packs={})
    with pytest.raises(ScoringError) as e:
        scorer.score({"inputs": [audio_input("a", "Listen:", part)], "scoring": {"queries": [QUERY]}})
    assert e.value.code == code and e.value.param == "inputs[0].messages[0].content[1]" + where, e.value


def test_audio_limits_at_their_edges():
    """A clip longer than the 30 s the model reads is refused (never cut short); the clips of a content
    together within max_audio_seconds_per_content, and each file within max_audio_bytes."""
    engine = engines.engine("gemma4-audio")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000)
        w.writeframes(np.zeros(8000 * 31, np.int16).tobytes())
    long_clip = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(buffer.getvalue()).decode(), "format": "wav"},
    }
    scorer = Scorer(engine, packs={})
    with pytest.raises(ScoringError, match="31.0 s") as e:
        scorer.score({"inputs": [audio_input("a", "Listen:", long_clip)], "scoring": {"queries": [QUERY]}})
    assert e.value.code == "invalid_media"
    seconds = len(audio.read((MEDIA / "tone.wav").read_bytes(), "wav", "x", feature_config())) / 16_000
    tight = Scorer(engine, Limits(max_audio_seconds_per_content=2 * seconds + 1e-3), {})
    for clips, code in [(2, None), (3, "too_much_audio")]:
        body = {
            "inputs": [audio_input("a", "Listen:", *[audio_part("tone.wav")] * clips)],
            "scoring": {"queries": [QUERY]},
        }
        if code is None:
            tight.score(body)
        else:
            with pytest.raises(ScoringError) as e:
                tight.score(body)
            assert e.value.code == code and e.value.param == "inputs[0].messages"
    small = Scorer(engine, Limits(max_audio_bytes=len((MEDIA / "tone.wav").read_bytes()) - 1), {})
    with pytest.raises(ScoringError, match="bytes") as e:
        small.score(
            {"inputs": [audio_input("a", "Listen:", audio_part("tone.wav"))], "scoring": {"queries": [QUERY]}}
        )
    assert e.value.code == "invalid_media"


def test_audio_to_a_model_that_does_not_hear_says_so():
    scorer = Scorer(engines.engine("gemma4-vision"), packs={})
    with pytest.raises(ScoringError, match="reads text and images") as e:
        scorer.score(
            {"inputs": [audio_input("a", "Listen:", audio_part("tone.wav"))], "scoring": {"queries": [QUERY]}}
        )
    assert e.value.code == "unsupported_content"


def test_the_server_hears_audio():
    """Over HTTP: a clip scores as in the library, usage counts its tokens, /health reports the audio limits
    (and no image limits: this model does not see), and a bad clip is a 400 in the error envelope."""
    from spinf_jax.server.app import Settings, create_app

    engine = engines.engine("gemma4-audio")
    settings = Settings(str(FOLDER), "fp32", buckets=(256, 512, 1024), packs={})
    body = {"inputs": [audio_input("a", "Listen:", audio_part("tone.wav"))], "scoring": {"queries": [QUERY]}}
    with serving(create_app(settings, engine)) as url:
        ok = httpx.post(f"{url}/v1/score", json=body)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens_details"]["audio_tokens"] == _count("tone.wav")
        assert _logprobs(ok.json(), "a") == _logprobs(Scorer(engine, packs={}).score(body), "a")
        bad = {**body, "inputs": [audio_input("a", "Listen:", audio_part("tone.wav", "ogg"))]}
        answer = httpx.post(f"{url}/v1/score", json=bad)
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "unsupported_media"
        # The OpenAI SDK sends the same clip as an input_audio part of a chat message.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        messages = body["inputs"][0]["messages"]
        scoring = {"scoring": body["scoring"]}
        reply = client.chat.completions.create(model=str(FOLDER), messages=messages, extra_body=scoring)
        assert reply.model_extra["results"][0]["queries"] == ok.json()["results"][0]["queries"]
        limits = httpx.get(f"{url}/health").json()["limits"]
        assert limits["max_audio_seconds_per_content"] == 120 and limits["max_audio_bytes"] == 1_500_000
        assert "max_images_per_content" not in limits

"""Audio in the content: decoding, the log-mel features Gemma 4's audio tower reads, and how many soft tokens
a clip becomes. The tower itself is spinf_jax.models.gemma4_audio; this layer is numpy only.

`features` reproduces transformers' `Gemma4AudioFeatureExtractor` (5.17) on one clip: the clip cut to 30 s
and zero-padded to a multiple of 128 samples, semicausal framing (half a frame of zeros in front; 20 ms
frames, 10 ms hop at 16 kHz), a periodic Hann window, |rfft| over 512 bins, an HTK mel filter bank without
normalisation, log(mel + 1e-3), then frames that reach into the padding are marked invalid and zeroed. Every
step is done in the dtype transformers uses (float32 frames and FFT, float64 filter bank and log, float32
out).

A clip is resampled to the extractor's rate (16 kHz) when its file says another rate; see `resample`.
"""

import functools
import io
import json
import math
import wave
from dataclasses import dataclass

import numpy as np

from spinf_jax.media import MediaError

# The transformers processor's cap on one clip's soft tokens (Gemma4Processor.audio_seq_length): 30 s of
# audio, the length its feature extractor truncates a clip to (max_length 480_000 samples).
MAX_SOFT_TOKENS = 750


@dataclass(frozen=True)
class FeatureConfig:
    """Gemma4AudioFeatureExtractor's settings (a checkpoint's preprocessor_config.json), with its defaults."""

    feature_size: int = 128  # mel bins
    sampling_rate: int = 16_000
    frame_length_ms: float = 20.0
    hop_length_ms: float = 10.0
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    preemphasis: float = 0.0
    preemphasis_htk_flavor: bool = True
    fft_overdrive: bool = False
    input_scale_factor: float = 1.0
    mel_floor: float = 1e-3
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None
    max_samples: int = 480_000  # the extractor's __call__ default max_length (truncation on)
    pad_to_multiple_of: int = 128  # likewise
    padding_value: float = 0.0

    @staticmethod
    def from_preprocessor(p: dict) -> "FeatureConfig":
        """From a preprocessor_config.json (its keys at the top, or under "feature_extractor")."""
        p = p.get("feature_extractor", p)
        if p.get("dither", 0.0):
            raise ValueError("dither adds random noise to every clip: features would not be reproducible")
        if p.get("padding_side", "right") != "right":
            raise ValueError("only right padding (the extractor's default) is supported")
        names = FeatureConfig.__dataclass_fields__
        settings = {k: v for k, v in p.items() if k in names}
        for k in ("per_bin_mean", "per_bin_stddev"):
            if settings.get(k) is not None:
                settings[k] = tuple(settings[k])
        return FeatureConfig(**settings)

    @property
    def frame_length(self) -> int:
        return int(round(self.sampling_rate * self.frame_length_ms / 1000.0))

    @property
    def hop_length(self) -> int:
        return int(round(self.sampling_rate * self.hop_length_ms / 1000.0))

    @property
    def fft_length(self) -> int:
        n = 2 ** math.ceil(math.log2(self.frame_length))
        return 2 * n if self.fft_overdrive else n

    def mel_filters(self) -> np.ndarray:
        """[fft_length // 2 + 1, feature_size] float64: triangular filters with centres evenly spaced on the
        HTK mel scale, peak 1, no area normalisation (transformers' mel_filter_bank(norm=None, "htk"))."""
        return _mel_filters(self)


def _hz_to_mel(f):
    return 2595.0 * np.log10(1.0 + (f / 700.0))


def _mel_to_hz(m):
    return 700.0 * (np.power(10, m / 2595.0) - 1.0)


@functools.cache  # one bank per configuration
def _mel_filters(cfg: FeatureConfig) -> np.ndarray:
    bins = cfg.fft_length // 2 + 1
    mels = np.linspace(_hz_to_mel(cfg.min_frequency), _hz_to_mel(cfg.max_frequency), cfg.feature_size + 2)
    edges = _mel_to_hz(mels)  # [mel + 2] Hz: filter i rises from edges[i], peaks at [i + 1], ends at [i + 2]
    bin_hz = np.linspace(0, cfg.sampling_rate // 2, bins)
    gaps = np.diff(edges)
    slopes = edges[None, :] - bin_hz[:, None]  # [bins, mel + 2]
    falling = -slopes[:, :-2] / gaps[:-1]
    rising = slopes[:, 2:] / gaps[1:]
    return np.maximum(np.zeros(1), np.minimum(falling, rising))


def features(samples: np.ndarray, cfg: FeatureConfig) -> tuple[np.ndarray, np.ndarray]:
    """samples [n] float32 mono at cfg.sampling_rate → (features [frames, feature_size] float32, mask [frames]
    bool). Frames past the clip's end (the padding to a multiple of 128 samples) are False and all zero."""
    x = np.asarray(samples, np.float32)[: cfg.max_samples]  # transformers pads in float32 (float64 is cast)
    n, multiple = x.size, cfg.pad_to_multiple_of
    padded = -(-n // multiple) * multiple if multiple else n
    x = np.concatenate([x, np.full(padded - n, cfg.padding_value, np.float32)])
    if cfg.input_scale_factor != 1.0:
        x = x * cfg.input_scale_factor
    # Semicausal framing: half a frame of zeros in front, so that frame i is centred on sample i * hop.
    left, size, hop = cfg.frame_length // 2, cfg.frame_length + 1, cfg.hop_length
    x = np.concatenate([np.zeros(left, x.dtype), x])
    real = np.concatenate([np.zeros(left, bool), np.arange(padded) < n])
    count = max((x.size - size) // hop + 1, 0)
    # Each frame is frame_length + 1 samples: the extra one feeds the preemphasis of the first.
    windows = x[np.arange(count)[:, None] * hop + np.arange(size)]  # [frames, frame_length + 1]
    if cfg.preemphasis > 0.0 and cfg.preemphasis_htk_flavor:
        first = windows[:, :1] * (1.0 - cfg.preemphasis)
        frames = np.concatenate([first, windows[:, 1:-1] - cfg.preemphasis * windows[:, :-2]], axis=-1)
    elif cfg.preemphasis > 0.0:
        frames = windows[:, 1:] - cfg.preemphasis * windows[:, :-1]
    else:
        frames = windows[:, :-1]
    window = np.hanning(cfg.frame_length + 1)[:-1].astype(np.float32)  # periodic Hann
    magnitude = np.abs(np.fft.rfft(frames * window, n=cfg.fft_length, axis=-1))  # float32
    log_mel = np.log(magnitude @ cfg.mel_filters() + np.float64(cfg.mel_floor))  # float64
    if cfg.per_bin_mean is not None:
        log_mel = log_mel - np.asarray(cfg.per_bin_mean)
    if cfg.per_bin_stddev is not None:
        log_mel = log_mel / np.asarray(cfg.per_bin_stddev)
    # A frame is valid when its last sample is real audio (so is every sample before it).
    mask = real[np.arange(count) * hop + size - 1]
    return log_mel.astype(np.float32) * mask[:, None], mask


def soft_token_count(num_samples: int, cfg: FeatureConfig | None = None, cap: int = MAX_SOFT_TOKENS) -> int:
    """How many soft tokens a clip of `num_samples` (at cfg.sampling_rate) becomes: its valid mel frames,
    halved (rounding up) by each of the tower's two stride-2 convolutions, at most `cap` (transformers'
    Gemma4Processor._compute_audio_num_tokens; the count of the tower's valid outputs)."""
    cfg = cfg or FeatureConfig()
    frames = (num_samples + cfg.frame_length // 2 - (cfg.frame_length + 1)) // cfg.hop_length + 1
    if frames <= 0:
        return 0
    for _ in range(2):  # kernel 3, stride 2, padding 1
        frames = (frames + 2 - 3) // 2 + 1
    return min(frames, cap)


# ----------------------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------------------


def decode(data: bytes, fmt: str, param: str) -> tuple[np.ndarray, int]:
    """A clip's bytes → (samples [n] float32 mono in [-1, 1), its sample rate). fmt: "wav" (PCM of 8, 16, 24
    or 32 bits; 8-bit is unsigned, centred on 128; the others signed, scaled by 2^(bits - 1); or IEEE float of
    32 or 64 bits) or "mp3"
    (decoded by miniaudio's dr_mp3 at the file's own rate). Channels are averaged. MediaError("invalid_media")
    if the data is not such a clip or holds no samples."""
    if fmt == "wav":
        samples, rate = _decode_wav(data, param)
    elif fmt == "mp3":
        samples, rate = _decode_mp3(data, param)
    else:
        raise MediaError("invalid_media", f"{param}: audio format {fmt!r} is not supported (wav, mp3)")
    if samples.size == 0:
        raise MediaError("invalid_media", f"{param}: the {fmt} clip holds no samples")
    if not np.isfinite(samples).all():
        raise MediaError("invalid_media", f"{param}: the {fmt} clip decodes to non-finite samples")
    return samples, rate


def _decode_wav(data: bytes, param: str) -> tuple[np.ndarray, int]:
    if _wav_format(data) in (WAVE_FLOAT, (WAVE_EXTENSIBLE, WAVE_FLOAT)):
        return _decode_float_wav(data, param)
    try:
        with wave.open(io.BytesIO(data)) as f:
            width, channels, rate = f.getsampwidth(), f.getnchannels(), f.getframerate()
            raw = f.readframes(f.getnframes())
    except (wave.Error, EOFError, ValueError) as e:  # wave raises all three on malformed headers
        raise MediaError("invalid_media", f"{param}: not a PCM or float WAV file ({e})") from None
    if channels < 1 or rate < 1:
        raise MediaError("invalid_media", f"{param}: a WAV file of {channels} channels at {rate} Hz")
    raw = raw[: len(raw) // (width * channels) * width * channels]  # a truncated last frame is dropped
    if width == 1:
        values = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128) / 128
    elif width == 2:
        values = np.frombuffer(raw, "<i2").astype(np.float32) / 2**15
    elif width == 3:  # little-endian 3-byte integers, sign-extended through the top of an int32
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        values = ((b[:, 0] << 8 | b[:, 1] << 16 | b[:, 2] << 24) >> 8).astype(np.float32) / 2**23
    elif width == 4:
        values = (np.frombuffer(raw, "<i4").astype(np.float64) / 2**31).astype(np.float32)
    else:
        raise MediaError("invalid_media", f"{param}: {8 * width}-bit WAV samples are not supported")
    return _mono(values.reshape(-1, channels)), rate


# WAV format tags (the fmt chunk's first field; an extensible file names its own in its sub-format's first two
# bytes). Python's `wave` reads PCM only; float WAV, as numpy and most audio tools write it, goes to dr_wav.
WAVE_FLOAT, WAVE_EXTENSIBLE = 3, 0xFFFE


def _wav_format(data: bytes):
    """A RIFF/WAVE file's format tag (for an extensible file: (0xFFFE, its sub-format's tag)); None if the
    bytes are not such a file or have no fmt chunk."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    at = 12
    while at + 8 <= len(data):
        kind, size = data[at : at + 4], int.from_bytes(data[at + 4 : at + 8], "little")
        body = data[at + 8 : at + 8 + size]
        if kind == b"fmt " and len(body) >= 2:
            tag = int.from_bytes(body[:2], "little")
            if tag == WAVE_EXTENSIBLE and len(body) >= 26:
                return tag, int.from_bytes(body[24:26], "little")
            return tag
        at += 8 + size + size % 2  # chunks are padded to an even size
    return None


def _decode_float_wav(data: bytes, param: str) -> tuple[np.ndarray, int]:
    """A WAV file of 32- or 64-bit IEEE float samples, decoded by miniaudio's dr_wav (32-bit values as they
    are, 64-bit rounded to float32)."""
    import miniaudio

    try:
        sound = miniaudio.wav_read_f32(data)
    except miniaudio.DecodeError as e:
        raise MediaError("invalid_media", f"{param}: not a float WAV file miniaudio can read ({e})") from None
    samples = np.asarray(sound.samples, np.float32).reshape(-1, max(sound.nchannels, 1))
    return _mono(samples), sound.sample_rate


def _decode_mp3(data: bytes, param: str) -> tuple[np.ndarray, int]:
    import miniaudio  # only where an mp3 is read

    try:
        sound = miniaudio.mp3_read_f32(data)
    except miniaudio.DecodeError as e:
        raise MediaError("invalid_media", f"{param}: not an MP3 file miniaudio can read ({e})") from None
    if sound.nchannels < 1 or sound.sample_rate < 1:
        layout = f"{sound.nchannels} channels at {sound.sample_rate} Hz"
        raise MediaError("invalid_media", f"{param}: an MP3 of {layout}")
    samples = np.asarray(sound.samples, np.float32).reshape(-1, sound.nchannels)
    return _mono(samples), sound.sample_rate


def _mono(samples: np.ndarray) -> np.ndarray:
    """[n, channels] → [n] float32, the channels' mean (one channel is returned as it is)."""
    if samples.shape[1] == 1:
        return np.ascontiguousarray(samples[:, 0])
    return samples.mean(axis=1, dtype=np.float32)


# ----------------------------------------------------------------------------------------------------------
# Resampling
# ----------------------------------------------------------------------------------------------------------

# The resampler's low-pass: a Kaiser-windowed sinc reaching ZERO_CROSSINGS zero crossings of the lower rate's
# sinc on each side; beta 8.6 keeps the stop band ~80 dB down, well under 16-bit quantisation noise.
ZERO_CROSSINGS = 16
KAISER_BETA = 8.6


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """samples [n] at `rate` → [ceil(n · target / rate)] at `target` (the input itself when the rates agree).

    Band-limited interpolation by a polyphase windowed-sinc filter: output sample m is the input read at time
    m · rate / target (in input samples) through a low-pass at the lower of the two Nyquist frequencies (a
    sinc under a Kaiser window, ZERO_CROSSINGS zero crossings a side, each phase's taps normalised to sum to
    one so that a constant stays constant); the signal is taken as zero outside the clip. Computed in float64,
    returned as float32.

    How this differs from transformers: Gemma4AudioFeatureExtractor takes samples at its own rate (16 kHz)
    and resamples nothing (the Gemma 4 processor expects 16 kHz input; the usual way to get it,
    librosa.load(sr=16000), resamples with soxr's "high quality" filter). A clip at another rate is resampled
    here rather than refused; its features are close to those of a soxr-resampled clip but not the same bits
    (the two filters differ near the band edge, which for 16 kHz output is 8 kHz, the top of the mel bank).
    """
    x = np.asarray(samples, np.float64)
    if rate == target:
        return np.asarray(samples, np.float32)
    g = math.gcd(rate, target)
    up, down = target // g, rate // g  # output m sits at input time m · down / up
    n_out = -(-x.size * up // down)
    cutoff = min(1.0, up / down)  # of the input's Nyquist frequency
    half = ZERO_CROSSINGS / cutoff  # the filter's half-width, in input samples
    taps = np.arange(-math.ceil(half), math.ceil(half) + 1)  # offsets from floor(input time)
    # table[p, j]: the weight of input sample floor(t) + taps[j] for an output at fractional position p / up.
    distance = taps[None, :] - np.arange(up)[:, None] / up  # [up, taps]
    inside = np.abs(distance) <= half
    window = np.i0(KAISER_BETA * np.sqrt(np.clip(1 - (distance / half) ** 2, 0, None))) / np.i0(KAISER_BETA)
    table = np.where(inside, cutoff * np.sinc(cutoff * distance) * window, 0.0)
    table /= table.sum(axis=1, keepdims=True)
    position = np.arange(n_out) * down  # input time × up, exact in integers
    base, phase = position // up, position % up
    padded = np.concatenate([np.zeros(len(taps)), x, np.zeros(len(taps))])
    out = np.zeros(n_out)
    for j, offset in enumerate(taps):
        out += padded[base + offset + len(taps)] * table[phase, j]
    return out.astype(np.float32)


def read(data: bytes, fmt: str, param: str, cfg: FeatureConfig) -> np.ndarray:
    """A clip's bytes → its samples [n] float32 mono at the feature extractor's rate."""
    samples, rate = decode(data, fmt, param)
    return resample(samples, rate, cfg.sampling_rate)


@dataclass(frozen=True)
class AudioFormat:
    """How a model reads audio: its feature extractor (the checkpoint's preprocessor_config.json) and the
    tokens a clip stands as in the content (Gemma 4's processor writes "<|audio>", one audio token per soft
    token, "<audio|>", with nothing around them)."""

    features: FeatureConfig
    start_id: int
    end_id: int
    audio_id: int
    formats: tuple[str, ...] = ("wav", "mp3")  # input_audio.format values we decode

    @property
    def max_seconds(self) -> float:
        """The longest clip the model reads (the extractor keeps 30 s and drops the rest: we refuse it)."""
        return self.features.max_samples / self.features.sampling_rate

    @staticmethod
    def from_checkpoint(config: dict, folder) -> "AudioFormat | None":
        """The format of a checkpoint with an audio tower (config.json's audio_config; its folder's
        preprocessor_config.json); None for a model that reads no audio."""
        if config.get("audio_config") is None:
            return None
        pre = folder / "preprocessor_config.json" if folder is not None else None
        p = json.loads(pre.read_text()) if pre is not None and pre.is_file() else {}
        return AudioFormat(
            features=FeatureConfig.from_preprocessor(p),
            start_id=config.get("boa_token_id", 256_000),
            end_id=config.get("eoa_token_index", config.get("eoa_token_id", 258_883)),
            audio_id=config.get("audio_token_id", 258_881),
        )

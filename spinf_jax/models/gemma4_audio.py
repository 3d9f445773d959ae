"""Gemma 4's audio tower: a conformer over a clip's log-mel frames (spinf_jax.audio makes them) and the
projection of its outputs into the text decoder's width (transformers' Gemma4AudioModel and the `embed_audio`
Gemma4MultimodalEmbedder; together what Gemma4Model.get_audio_features returns as pooler_output).

The pieces, in order:
- two 3×3 convolutions of stride 2 over (time, mel), each LayerNorm'd over its channels and ReLU'd: 4× fewer
  frames (40 ms a soft token) and 4× fewer mel rows, then one linear from (mel / 4 · channels) to hidden;
- conformer layers: a half-step feed-forward, chunked local self-attention, a light convolution block, another
  half-step feed-forward, a final RMSNorm;
- a linear with bias to output_proj_dims, an RMSNorm without scale and a linear to the text width.

The attention is local and causal: frames are cut into chunks of `attention_chunk_size`; each chunk's queries
see a window of keys from `attention_context_left - 1` frames before the chunk to `attention_context_right`
after it, with a relative-position term (Transformer-XL style: queries against projected sinusoids of the
distance, aligned by a "relative shift"), logits soft-capped by tanh. The mask transformers builds keeps a key
when 0 <= query - key < attention_context_left - 1 (or key - query < attention_context_right): one frame fewer
of the past than the window holds (a query sees itself and context_left - 2 predecessors; the window's first
column is always masked). We keep that mask as it is.

Frames past a clip's end (mask False) are zeroed before each convolution and never attended to, so a clip's
valid soft tokens do not depend on how much padding follows it: callers pad every clip's features to
MAX_FRAMES (`pad_frames`) so the tower has one program, and an audio clip's soft tokens are the same bits
whatever else a request holds.
"""

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spinf_jax.models.layers import rms_norm
from spinf_jax.models.params import Kind, weight
from spinf_jax.quant import Precision, linear, matmul_precision

_TOWER = "model.audio_tower."
_EMBED = "model.embed_audio."
_SUBSAMPLE = _TOWER + "subsample_conv_projection."
_CLIPS = ("input_min", "input_max", "output_min", "output_max")
# The features of the longest clip transformers' extractor keeps (30 s: 2999 frames), rounded up to a multiple
# of 4 so that the two stride-2 convolutions give exactly MAX_FRAMES / 4 = 750 rows, the processor's cap.
MAX_FRAMES = 3000


@dataclass(frozen=True)
class Config:
    hidden_size: int
    num_layers: int
    num_heads: int
    channels: tuple[int, int]  # subsampling_conv_channels
    mel_bins: int  # the features' width (the feature extractor's feature_size)
    conv_kernel: int  # the light convolution's (causal, depthwise) kernel
    chunk: int  # attention_chunk_size
    past: int  # attention_context_left - 1: frames before a chunk its window holds
    future: int  # attention_context_right
    logit_cap: float
    invalid_logit: float  # what a masked logit is set to (attention_invalid_logits_value)
    clipped: bool  # use_clipped_linears
    rms_norm_eps: float
    gradient_clipping: float
    residual_weight: float  # the feed-forward blocks' half step
    output_dims: int
    text_hidden: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def context(self) -> int:
        """The keys one chunk's queries see: the chunk, `past` frames before it, `future` after it."""
        return self.chunk + self.past + self.future

    @property
    def projected(self) -> int:
        """The input projection's width: the mel rows left after two stride-2 convolutions × channels[1]."""
        return _halved(_halved(self.mel_bins)) * self.channels[1]

    @staticmethod
    def from_hf(c: dict, mel_bins: int = 128) -> "Config":
        """c: the full config.json (its audio_config and text_config's hidden size). mel_bins: the feature
        extractor's feature_size (preprocessor_config.json; 128 for the released models)."""
        a = c["audio_config"]
        if a.get("hidden_act", "silu") != "silu":
            raise ValueError(f"audio tower activation {a['hidden_act']!r} is not supported (silu)")
        channels = tuple(a.get("subsampling_conv_channels", (128, 32)))
        # transformers sizes the input projection as (channels[0] // 4) * channels[1], the true width only
        # when the mel rows left after the convolutions number channels[0] // 4 (released models: 128 mels,
        # channels[0] 128): a checkpoint where they differ would not load in transformers either.
        if len(channels) != 2 or (channels[0] // 4) != _halved(_halved(mel_bins)):
            raise ValueError(f"subsampling_conv_channels {list(channels)} do not fit {mel_bins} mel bins")
        hidden, heads = a.get("hidden_size", 1024), a.get("num_attention_heads", 8)
        if hidden % heads:
            raise ValueError(f"audio hidden size {hidden} is not a multiple of its {heads} heads")
        return Config(
            hidden_size=hidden,
            num_layers=a.get("num_hidden_layers", 12),
            num_heads=heads,
            channels=channels,
            mel_bins=mel_bins,
            conv_kernel=a.get("conv_kernel_size", 5),
            chunk=a.get("attention_chunk_size", 12),
            past=a.get("attention_context_left", 13) - 1,
            future=a.get("attention_context_right", 0),
            logit_cap=a.get("attention_logit_cap", 50.0),
            invalid_logit=a.get("attention_invalid_logits_value", -1e9),
            clipped=bool(a.get("use_clipped_linears", True)),
            rms_norm_eps=a.get("rms_norm_eps", 1e-6),
            gradient_clipping=a.get("gradient_clipping", 1e10),
            residual_weight=a.get("residual_weight", 0.5),
            output_dims=a.get("output_proj_dims", 1536),
            text_hidden=c["text_config"]["hidden_size"],
        )


def _halved(n: int) -> int:
    """Length after a convolution of kernel 3, stride 2, padding 1: ceil(n / 2)."""
    return (n + 2 - 3) // 2 + 1


# The conformer layers' clipped linears: attribute name → (module under layers.{i}., [out, in] in hiddens).
_LINEARS = {
    "ff1_up": ("feed_forward1.ffw_layer_1", (4, 1)),
    "ff1_down": ("feed_forward1.ffw_layer_2", (1, 4)),
    "q": ("self_attn.q_proj", (1, 1)),
    "k": ("self_attn.k_proj", (1, 1)),
    "v": ("self_attn.v_proj", (1, 1)),
    "o": ("self_attn.post", (1, 1)),
    "conv_start": ("lconv1d.linear_start", (2, 1)),
    "conv_end": ("lconv1d.linear_end", (1, 1)),
    "ff2_up": ("feed_forward2.ffw_layer_1", (4, 1)),
    "ff2_down": ("feed_forward2.ffw_layer_2", (1, 4)),
}
# Their RMSNorm scales ([hidden] each).
_NORMS = {
    "ff1_pre": "feed_forward1.pre_layer_norm",
    "ff1_post": "feed_forward1.post_layer_norm",
    "attn_pre": "norm_pre_attn",
    "attn_post": "norm_post_attn",
    "conv_pre": "lconv1d.pre_layer_norm",
    "conv_norm": "lconv1d.conv_norm",
    "ff2_pre": "feed_forward2.pre_layer_norm",
    "ff2_post": "feed_forward2.post_layer_norm",
    "out": "norm_out",
}


class AudioTower(nnx.Module):
    """Log-mel features [frames, mel_bins] and their mask [frames] → (soft tokens [⌈⌈frames/2⌉/2⌉,
    text_hidden], mask of the valid ones). Rows where the mask is False are padding: callers keep the first
    spinf_jax.audio.soft_token_count rows (the valid ones are always a prefix for a clip's features)."""

    def __init__(self, cfg: Config, precision: Precision):
        h, c0, c1 = cfg.hidden_size, *cfg.channels
        self.config, self.precision = cfg, precision
        w = partial(weight, precision=precision)
        layers = tuple(range(cfg.num_layers))

        def layer(shape, name, kind=Kind.TOWER, present=True):  # layers.{i}.name, stacked [layers, *shape]
            return w(shape, tuple(f"{_TOWER}layers.{i}.{name}" for i in layers), kind, present=present)

        self.conv0 = w((c0, 1, 3, 3), _SUBSAMPLE + "layer0.conv.weight", Kind.TOWER)
        self.conv0_norm = w((c0,), _SUBSAMPLE + "layer0.norm.weight", Kind.NORM)
        self.conv1 = w((c1, c0, 3, 3), _SUBSAMPLE + "layer1.conv.weight", Kind.TOWER)
        self.conv1_norm = w((c1,), _SUBSAMPLE + "layer1.norm.weight", Kind.NORM)
        self.input_proj = w((h, cfg.projected), _SUBSAMPLE + "input_proj_linear.weight", Kind.TOWER)
        for name, (module, (out, inp)) in _LINEARS.items():
            setattr(self, name, layer((out * h, inp * h), f"{module}.linear.weight"))
            for bound in _CLIPS:  # scalars, [layers] stacked; absent without use_clipped_linears
                setattr(self, f"{name}_{bound}", layer((), f"{module}.{bound}", Kind.NORM, cfg.clipped))
        for name, module in _NORMS.items():
            setattr(self, f"{name}_norm", layer((h,), f"{module}.weight", Kind.NORM))
        self.rel_k = layer((h, h), "self_attn.relative_k_proj.weight")
        self.per_dim_scale = layer((cfg.head_dim,), "self_attn.per_dim_scale", Kind.NORM)
        self.depthwise = layer((h, 1, cfg.conv_kernel), "lconv1d.depthwise_conv1d.weight")
        self.output_proj = w((cfg.output_dims, h), _TOWER + "output_proj.weight", Kind.TOWER)
        self.output_bias = w((cfg.output_dims,), _TOWER + "output_proj.bias", Kind.BIAS)
        projection = _EMBED + "embedding_projection.weight"
        self.projection = w((cfg.text_hidden, cfg.output_dims), projection, Kind.TOWER)

    def __call__(self, features: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg, dtype = self.config, self.precision.activation_dtype
        with jax.named_scope("subsample"):
            x, mask = self._subsample(features.astype(dtype), mask)  # [frames / 4, hidden], [frames / 4]
        per_layer = {name: getattr(self, name).get_value() for name in self._layer_weights()}
        positions = self._relative_positions(dtype)  # [context // 2 + 1, hidden]
        x, _ = jax.lax.scan(lambda x, ws: (self._layer(x, ws, mask, positions), None), x, per_layer)
        with jax.named_scope("embed"):
            x = linear(x, self.output_proj.get_value()) + self.output_bias.get_value().astype(dtype)
            x = rms_norm(x, None, cfg.rms_norm_eps, style="gemma4")
            return linear(x, self.projection.get_value()), mask

    def _layer_weights(self) -> tuple[str, ...]:
        names = (*_LINEARS, *(f"{n}_norm" for n in _NORMS), "rel_k", "per_dim_scale", "depthwise")
        if self.config.clipped:
            names += tuple(f"{n}_{b}" for n in _LINEARS for b in _CLIPS)
        return names

    def _subsample(self, x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[frames, mel] → [⌈⌈frames/2⌉/2⌉, hidden] (and the mask, every other frame twice)."""
        cfg = self.config
        x = x[None]  # one channel: [1, frames, mel]
        for conv, norm in ((self.conv0, self.conv0_norm), (self.conv1, self.conv1_norm)):
            x = x * mask[None, :, None].astype(x.dtype)  # padded frames read as zeros
            x = jax.lax.conv_general_dilated(
                x[None],
                conv.get_value().astype(x.dtype),
                window_strides=(2, 2),
                padding=((1, 1), (1, 1)),
                dimension_numbers=("NCHW", "OIHW", "NCHW"),
                precision=matmul_precision(x.dtype),
                preferred_element_type=jnp.float32,
            )[0]  # [channels, ⌈frames/2⌉, ⌈mel/2⌉]
            x = jax.nn.relu(_layer_norm(x.transpose(1, 2, 0), norm.get_value(), cfg.rms_norm_eps))
            x = x.astype(self.precision.activation_dtype).transpose(2, 0, 1)
            mask = mask[::2]
        frames = x.shape[1]
        x = x.transpose(1, 2, 0).reshape(frames, -1)  # [frames, mel rows × channels], channels fastest
        return linear(x, self.input_proj.get_value()), mask

    def _relative_positions(self, dtype) -> jax.Array:
        """[context // 2 + 1, hidden]: [sin, cos] of distances context // 2, ..., 1, 0 at geometric timescales
        1 to 10⁴ (transformers' Gemma4AudioRelPositionalEncoding, computed in f32 as there)."""
        cfg = self.config
        n = cfg.hidden_size // 2
        inv = np.exp(np.arange(n, dtype=np.float32) * np.float32(-math.log(1e4) / max(n - 1, 1)))
        scaled = np.arange(cfg.context // 2, -1, -1, dtype=np.float32)[:, None] * inv[None, :]
        return jnp.asarray(np.concatenate([np.sin(scaled), np.cos(scaled)], -1), dtype)

    def _layer(self, x: jax.Array, ws: dict, mask: jax.Array, positions: jax.Array) -> jax.Array:
        """One conformer layer over [frames, hidden]."""
        cfg = self.config
        limit = min(cfg.gradient_clipping, float(jnp.finfo(x.dtype).max))
        x = self._feed_forward(x, ws, "ff1")
        with jax.named_scope("attention"):
            h = _norm(jnp.clip(x, -limit, limit), ws["attn_pre_norm"])
            h = self._attention(h, ws, mask, positions)
            x = x + _norm(jnp.clip(h, -limit, limit), ws["attn_post_norm"])
        with jax.named_scope("light_conv"):
            x = self._light_conv(x, ws)
        x = self._feed_forward(x, ws, "ff2")
        return _norm(jnp.clip(x, -limit, limit), ws["out_norm"])

    def _feed_forward(self, x: jax.Array, ws: dict, name: str) -> jax.Array:
        """x + residual_weight · post_norm(down(silu(up(pre_norm(x)))))."""
        cfg = self.config
        limit = min(cfg.gradient_clipping, float(jnp.finfo(x.dtype).max))
        with jax.named_scope(name):
            h = _norm(jnp.clip(x, -limit, limit), ws[f"{name}_pre_norm"])
            h = jax.nn.silu(_clipped_linear(h, ws, f"{name}_up"))
            h = jnp.clip(_clipped_linear(h, ws, f"{name}_down"), -limit, limit)
            return x + _norm(h, ws[f"{name}_post_norm"]) * jnp.asarray(cfg.residual_weight, x.dtype)

    def _light_conv(self, x: jax.Array, ws: dict) -> jax.Array:
        """x + end(silu(norm(causal depthwise conv(GLU(start(norm(x))))))): each channel mixes its last
        conv_kernel frames (zeros before the clip's start)."""
        cfg = self.config
        h = _norm(x, ws["conv_pre_norm"], cfg.rms_norm_eps)
        h = _clipped_linear(h, ws, "conv_start")  # [frames, 2 hidden]
        a, gate = jnp.split(h, 2, axis=-1)
        h = a * jax.nn.sigmoid(gate)
        k = cfg.conv_kernel
        taps = ws["depthwise"][:, 0, :].astype(jnp.float32)  # [hidden, kernel]
        padded = jnp.pad(h.astype(jnp.float32), ((k - 1, 0), (0, 0)))
        frames = x.shape[0]
        h = sum(padded[i : i + frames] * taps[:, i] for i in range(k)).astype(x.dtype)
        limit = min(cfg.gradient_clipping, float(jnp.finfo(x.dtype).max))
        h = jax.nn.silu(_norm(jnp.clip(h, -limit, limit), ws["conv_norm_norm"], cfg.rms_norm_eps))
        return x + _clipped_linear(h, ws, "conv_end")

    def _attention(self, x: jax.Array, ws: dict, mask: jax.Array, positions: jax.Array) -> jax.Array:
        """Chunked local attention with relative positions over [frames, hidden] (module docstring); scores,
        softmax and the weighted sum in f32, as transformers computes them in any dtype."""
        cfg = self.config
        frames, heads, d = x.shape[0], cfg.num_heads, cfg.head_dim
        c, past, width = cfg.chunk, cfg.past, cfg.context
        blocks = -(-frames // c)

        def project(name):  # [frames, heads, head_dim] f32
            return _clipped_linear(x, ws, name).astype(jnp.float32).reshape(frames, heads, d)

        # Queries: 1/sqrt(d) and a learned per-dimension softplus scale, both over ln 2; keys by log2(1 + e).
        q_scale = d**-0.5 / math.log(2) * jax.nn.softplus(ws["per_dim_scale"].astype(jnp.float32))
        q = project("q") * q_scale
        k = project("k") * (math.log(1 + math.e) / math.log(2))
        v = project("v")
        q = jnp.pad(q, ((0, blocks * c - frames), (0, 0), (0, 0))).reshape(blocks, c, heads, d)
        # Each block's keys and values: frames b·c - past ... b·c + c + future - 1 (zeros outside the clip).
        window = np.arange(blocks)[:, None] * c + np.arange(width)[None, :]  # [blocks, width], padded index

        def context(t):  # [blocks, width, heads, head_dim]
            return jnp.pad(t, ((past, cfg.future + c - 1), (0, 0), (0, 0)))[window]

        k, v = context(k), context(v)
        exact = jax.lax.Precision.HIGHEST
        content = jnp.einsum("bqhd,bkhd->hbqk", q, k, precision=exact)  # [heads, blocks, chunk, width]
        # Relative term: each query against the projected sinusoid of each distance (rows: context // 2 .. 0),
        # then shifted so that column j of query i reads distance row j - i (Transformer-XL's shift: pad to
        # width + 1 columns, flatten, drop the last `chunk` values, fold back to width).
        rel = (
            linear(positions, ws["rel_k"]).astype(jnp.float32).reshape(-1, heads, d)
        )  # [distances, heads, hd]
        relative = jnp.einsum("bqhd,rhd->hbqr", q, rel, precision=exact)  # [heads, blocks, chunk, distances]
        relative = jnp.pad(relative, ((0, 0), (0, 0), (0, 0), (0, width + 1 - relative.shape[-1])))
        relative = relative.reshape(heads, blocks, c * (width + 1))[..., : c * width]
        logits = content + relative.reshape(heads, blocks, c, width)
        logits = jnp.tanh(logits / cfg.logit_cap) * cfg.logit_cap
        # The mask transformers builds: a key inside the clip and valid, and 0 <= query - key < past (or the
        # key at most future - 1 frames ahead).
        query = np.arange(blocks)[:, None, None] * c + np.arange(c)[None, :, None]  # [blocks, chunk, 1]
        key = window[:, None, :] - past  # [blocks, 1, width], clip index
        distance = query - key
        near = ((distance >= 0) & (distance < past)) | ((distance < 0) & (-distance < cfg.future))
        inside = (key >= 0) & (key < frames)
        valid = jnp.pad(mask, (0, max(int(key.max()) + 1 - frames, 0)))[np.clip(key, 0, None)]
        allowed = jnp.asarray(near & inside) & valid  # [blocks, chunk, width]
        logits = jnp.where(allowed[None], logits, cfg.invalid_logit)
        probs = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("hbqk,bkhd->bqhd", probs, v, precision=exact).reshape(blocks * c, heads * d)
        return _clipped_linear(out[:frames].astype(x.dtype), ws, "o")


def _clipped_linear(x: jax.Array, ws: dict, name: str) -> jax.Array:
    """linear ws[name], its input and output clamped to the checkpoint's bounds where it has them (bounds in
    x's dtype: torch.clamp of a bf16 tensor by f32 scalars clamps in bf16)."""
    if f"{name}_input_min" not in ws:
        return linear(x, ws[name])
    lo, hi, out_lo, out_hi = (ws[f"{name}_{b}"].astype(x.dtype) for b in _CLIPS)
    return jnp.clip(linear(jnp.clip(x, lo, hi), ws[name]), out_lo, out_hi)


def _norm(x: jax.Array, w: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Gemma 4's RMSNorm (scale w, not 1 + w). transformers builds the feed-forward blocks' and the layer's
    own norms with the default eps 1e-6, only the light convolution's with the config's rms_norm_eps."""
    return rms_norm(x, w, eps, style="gemma4")


def _layer_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis without bias, in f32."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    return (xf - mean) * jax.lax.rsqrt(var + eps) * w


def pad_frames(
    features: np.ndarray, mask: np.ndarray, frames: int = MAX_FRAMES
) -> tuple[np.ndarray, np.ndarray]:
    """A clip's features [n, mel] and mask [n] padded (zeros, False) to [frames, mel] and [frames]: the one
    shape the tower is compiled for."""
    n = features.shape[0]
    if n > frames:
        raise ValueError(f"{n} feature frames; the tower takes at most {frames}")
    return np.pad(features, ((0, frames - n), (0, 0))), np.pad(mask, (0, frames - n))

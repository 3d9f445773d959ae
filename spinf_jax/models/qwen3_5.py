"""Qwen3.5 (transformers `qwen3_5`), dense, as NNX modules over a packed tree batch.

Layers of two kinds, three Gated DeltaNet layers to one gated attention layer in the published models:
- Gated DeltaNet (linear attention): one projection gives q, k and v, which go through a depthwise causal
  convolution over the last 4 tokens of the row's path and SiLU; q and k are L2-normalised (q scaled by
  1 / sqrt(key dim)), each key head serving several value heads; the gated delta rule (pallas_kernels.
  gated_delta) with β = sigmoid(b) and log decay g = -exp(A_log) · softplus(a + dt_bias); its output
  RMS-normalised per head, scaled by w, gated by SiLU(z), projected back.
- Gated attention: q_proj gives each head's query and an output gate side by side; q/k RMSNorm per head;
  rope on the first quarter of head_dim only, with frequencies over that quarter; the attention output
  times sigmoid(gate) before o_proj.
RMSNorms scale by (1 + w) in f32 (the gated one by w); SwiGLU MLP; no embedding scale; untied head.

The MoE variants (`qwen3_5_moe`) replace every layer's MLP by a mixture of SwiGLU experts (each token's top
`num_experts_per_tok` of `num_experts`, renormalised) plus a shared expert gated by
sigmoid(shared_expert_gate) (spinf_jax.models.moe).

Multimodal checkpoints (Qwen3_5ForConditionalGeneration) keep the text weights under model.language_model.;
the loader reads them there (checkpoint.py).
"""

import itertools
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.gated_delta import token, tree_chunked, wave_width
from spinf_jax.models.decoder import Decoder
from spinf_jax.models.layers import (
    Batch,
    DecodeBatch,
    RecurrentState,
    Rope,
    apply_rope,
    attention,
    by_rows,
    gated_mlp,
    rms_norm,
    split_heads,
)
from spinf_jax.models.moe import Experts, route
from spinf_jax.models.params import Kind, layer_weight
from spinf_jax.quant import Precision, linear, stacked_outputs

LINEAR, FULL = "linear_attention", "full_attention"
MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # the leading dims of each head that rope rotates
    rope: Rope
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    conv_kernel: int
    tie_embeddings: bool
    rms_norm_eps: float = 1e-6
    experts: int = 0  # the MoE variants: experts in every layer's MLP (0: a dense MLP)
    top_k: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @staticmethod
    def from_hf(c: dict) -> "Config":
        c = c.get("text_config", c)
        if c.get("model_type") not in MODEL_TYPES:
            raise ValueError(f"model_type {c.get('model_type')!r} is not one of {MODEL_TYPES}")
        if c.get("attention_bias"):
            raise ValueError("Qwen3.5 attention biases are not supported")
        rope = dict(c.get("rope_parameters") or {})
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        partial_rotary = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
        moe = c["model_type"].startswith("qwen3_5_moe")
        layers = c.get("layer_types") or [
            FULL if (i + 1) % c.get("full_attention_interval", 4) == 0 else LINEAR
            for i in range(c["num_hidden_layers"])
        ]
        return Config(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c.get("intermediate_size", 0),  # MoE variants have no dense MLP
            layer_types=tuple(layers[: c["num_hidden_layers"]]),
            num_heads=c["num_attention_heads"],
            num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial_rotary),
            # Text positions are the same on mrope's three axes, where it is plain rope.
            rope=Rope(float(rope.get("rope_theta", c.get("rope_theta", 1e7)))),
            linear_key_heads=c["linear_num_key_heads"],
            linear_value_heads=c["linear_num_value_heads"],
            linear_key_dim=c["linear_key_head_dim"],
            linear_value_dim=c["linear_value_head_dim"],
            conv_kernel=c.get("linear_conv_kernel_dim", 4),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            experts=c.get("num_experts", c.get("num_local_experts", 0)) if moe else 0,
            top_k=c["num_experts_per_tok"] if moe else 0,
            moe_intermediate_size=c["moe_intermediate_size"] if moe else 0,
            shared_intermediate_size=c["shared_expert_intermediate_size"] if moe else 0,
        )


class _Layer(nnx.Module):
    """What both kinds of layer hold: the two norms and the feed-forward, a dense MLP or (MoE) experts beside
    a gated shared expert (layers `ids`, stacked)."""

    def __init__(self, cfg: Config, ids: tuple[int, ...], precision: Precision):
        d, e = cfg.hidden_size, cfg.experts
        w = partial(layer_weight, ids, precision)
        self.cfg = cfg
        self.input_norm = w((d,), "input_layernorm.weight", Kind.NORM)
        self.post_attn_norm = w((d,), "post_attention_layernorm.weight", Kind.NORM)
        f = cfg.shared_intermediate_size if e else cfg.intermediate_size
        mlp = "mlp.shared_expert" if e else "mlp"
        self.gate = w((f, d), f"{mlp}.gate_proj.weight", Kind.LINEAR)
        self.up = w((f, d), f"{mlp}.up_proj.weight", Kind.LINEAR)
        self.down = w((d, f), f"{mlp}.down_proj.weight", Kind.LINEAR)
        self.shared_gate = w((1, d), "mlp.shared_expert_gate.weight", Kind.ROUTER, e > 0)
        self.router = w((e, d), "mlp.gate.weight", Kind.ROUTER, e > 0)
        inner = cfg.moe_intermediate_size
        self.experts = (
            Experts(
                ids, precision, "mlp.experts", e, cfg.top_k, d, inner, fused=False, activation=jax.nn.silu
            )
            if e
            else None
        )

    def _feed_forward(self, row_tile, mixed, *rows):
        """The layer's output from `rows` [T, ...]: mixed(*rows) (row-local) is the stream after the token
        mixer and its residual; then the MLP, or the experts and the shared expert, and their residual."""
        if self.experts is None:
            return by_rows(lambda *r: self._mlp(mixed(*r)), row_tile, *rows)
        x, h, probs, shared = by_rows(lambda *r: self._before_experts(mixed(*r)), row_tile, *rows)
        index, weight = route(probs, self.cfg.top_k, normalize=True)
        return x + (self.experts(h, index, weight) + shared).astype(x.dtype)

    def _mlp(self, x):
        mlp = (self.gate.get_value(), self.up.get_value(), self.down.get_value())
        return x + gated_mlp(_norm(x, self.post_attn_norm, self.cfg), *mlp, jax.nn.silu)

    def _before_experts(self, x):
        """Row-local, MoE: the stream, the experts' input, the router's probabilities [T, experts] f32 and
        the gated shared expert's output [T, hidden] f32."""
        h = _norm(x, self.post_attn_norm, self.cfg)
        probs = jax.nn.softmax(linear(h, self.router.get_value(), jnp.float32), axis=-1)
        mlp = (self.gate.get_value(), self.up.get_value(), self.down.get_value())
        shared = gated_mlp(h, *mlp, jax.nn.silu).astype(jnp.float32)
        return x, h, probs, jax.nn.sigmoid(linear(h, self.shared_gate.get_value(), jnp.float32)) * shared


class GatedDeltaLayer(_Layer):
    def __init__(self, cfg: Config, ids: tuple[int, ...], precision: Precision):
        super().__init__(cfg, ids, precision)
        d, hv = cfg.hidden_size, cfg.linear_value_heads
        key, value = cfg.linear_key_heads * cfg.linear_key_dim, hv * cfg.linear_value_dim
        w = partial(layer_weight, ids, precision)
        self.qkv = w((2 * key + value, d), "linear_attn.in_proj_qkv.weight", Kind.LINEAR)
        self.z = w((value, d), "linear_attn.in_proj_z.weight", Kind.LINEAR)
        self.b = w((hv, d), "linear_attn.in_proj_b.weight", Kind.LINEAR)
        self.a = w((hv, d), "linear_attn.in_proj_a.weight", Kind.LINEAR)
        # [channels, 1, kernel]: kept in f32 like the other small per-channel weights
        self.conv = w((2 * key + value, 1, cfg.conv_kernel), "linear_attn.conv1d.weight", Kind.NORM)
        self.dt_bias = w((hv,), "linear_attn.dt_bias", Kind.NORM)
        self.a_log = w((hv,), "linear_attn.A_log", Kind.NORM)
        self.norm = w((cfg.linear_value_dim,), "linear_attn.norm.weight", Kind.NORM)
        self.out = w((d, value), "linear_attn.out_proj.weight", Kind.LINEAR)

    def __call__(self, x, batch: Batch, row_tile: int | None):
        """→ (the residual stream after this layer, and in a pass with extraction slots or a decode step the
        RecurrentState decoding continues from; else None)."""
        if isinstance(batch, DecodeBatch):
            return self._decode(x, batch, row_tile)
        mixed, z, b, a = by_rows(self._projector(), row_tile, x)
        # The convolution reads the rows before each row on its path: gathers, exact, so still row-local.
        earlier, row = [mixed], batch.parent
        for _ in range(self.cfg.conv_kernel - 1):
            earlier.append(jnp.where((row >= 0)[:, None], mixed[jnp.maximum(row, 0)], 0))
            row = jnp.where(row >= 0, batch.parent[jnp.maximum(row, 0)], -1)
        window = jnp.stack(earlier, axis=1)  # [T, kernel, channels]: the row, then the rows before it
        q, k, v, g, beta = by_rows(self._gate_inputs, row_tile, window, b, a)
        slots = batch.export_rows
        o, states = tree_chunked(
            q, k, v, g, beta, batch.span_end, batch.chunks, exports=slots.shape[0], width=wave_width()
        )
        out = self._feed_forward(row_tile, self._mixed, x, o, z)
        if not slots.shape[0]:
            return out, None
        return out, RecurrentState(states, window[jnp.maximum(slots, 0), :-1])

    def _decode(self, x, batch: DecodeBatch, row_tile: int | None):
        """One decode step: each hypothesis's token from the state and convolution inputs its path left (at
        the first step, its slot's, from the pass)."""
        pass_state, step_state = batch.cache, batch.history  # RecurrentState: [X, ...] and [G, W, ...]
        g, w = step_state.state.shape[:2]
        parent = batch.path[:, :, jnp.maximum(batch.step - 1, 0)]  # [G, W]: its row at the step before

        def before(of_pass, of_steps):  # [X, ...] and [G, W, ...] → [G × W, ...]
            from_slot = jnp.broadcast_to(of_pass[batch.export][:, None], of_steps.shape)
            from_path = of_steps[jnp.arange(g)[:, None], parent]
            return jnp.where(batch.step == 0, from_slot, from_path).reshape(g * w, *of_steps.shape[2:])

        state = before(pass_state.state, step_state.state)
        window = before(pass_state.window, step_state.window)
        mixed, z, b, a = by_rows(self._projector(), row_tile, x)
        window = jnp.concatenate([mixed[:, None], window], axis=1)  # [R, kernel, channels]
        q, k, v, gate, beta = by_rows(self._gate_inputs, row_tile, window, b, a)
        state, o = by_rows(jax.vmap(token), row_tile, state, q, k, v, gate, beta)
        out = self._feed_forward(row_tile, self._mixed, x, o, z)
        after = RecurrentState(
            state.reshape(g, w, *state.shape[1:]), window[:, :-1].reshape(g, w, -1, window.shape[-1])
        )
        return out, after

    def _projector(self):
        """The row-local input projections (q, k, v before the convolution [T, 2·key + value], z [T, value],
        b and a [T, value heads]) as one GEMM: their weights stacked here, outside the loop over row tiles."""
        weights = [w.get_value() for w in (self.qkv, self.z, self.b, self.a)]
        ends = list(itertools.accumulate(w.shape[0] for w in weights))[:-1]
        stacked = stacked_outputs(*weights)

        def project(x):
            return tuple(jnp.split(linear(_norm(x, self.input_norm, self.cfg), stacked), ends, axis=-1))

        return project

    def _gate_inputs(self, window, b, a):
        """Row-local: window [T, kernel, channels] (the row, then the rows before it on its path) → the gated
        delta rule's q, k [T, value heads, key dim], v [T, value heads, value dim], g and β [T, heads]."""
        cfg, t, dtype = self.cfg, window.shape[0], window.dtype
        taps = self.conv.get_value()[:, 0, ::-1]  # [channels, kernel], the row's own tap first
        mixed = jax.nn.silu(jnp.einsum("tkc,ck->tc", window.astype(jnp.float32), taps)).astype(dtype)
        key = cfg.linear_key_heads * cfg.linear_key_dim
        q, k, v = jnp.split(mixed, [key, 2 * key], axis=-1)
        repeat = (
            cfg.linear_value_heads // cfg.linear_key_heads
        )  # key head i serves value heads i·r .. i·r+r-1
        q, k = (jnp.repeat(_l2norm(x.reshape(t, cfg.linear_key_heads, -1)), repeat, axis=1) for x in (q, k))
        v = v.reshape(t, cfg.linear_value_heads, cfg.linear_value_dim)
        beta = jax.nn.sigmoid(b).astype(jnp.float32)
        rate = jnp.exp(self.a_log.get_value()) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias.get_value()
        )
        return q * cfg.linear_key_dim**-0.5, k, v, -rate, beta

    def _mixed(self, x, o, z):
        """Row-local: the gated norm of the rule's output [T, heads, value dim], out_proj, the residual."""
        cfg, dtype = self.cfg, x.dtype
        normed = rms_norm(o.astype(dtype), self.norm.get_value(), cfg.rms_norm_eps, style="llama")
        gated = normed.astype(jnp.float32) * jax.nn.silu(z.reshape(o.shape).astype(jnp.float32))
        return x + linear(gated.astype(dtype).reshape(x.shape[0], -1), self.out.get_value())


class AttentionLayer(_Layer):
    def __init__(self, cfg: Config, ids: tuple[int, ...], precision: Precision):
        super().__init__(cfg, ids, precision)
        d, hd = cfg.hidden_size, cfg.head_dim
        q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
        w = partial(layer_weight, ids, precision)
        self.q = w((2 * q_out, d), "self_attn.q_proj.weight", Kind.LINEAR)  # per head: query, then gate
        self.k = w((kv_out, d), "self_attn.k_proj.weight", Kind.LINEAR)
        self.v = w((kv_out, d), "self_attn.v_proj.weight", Kind.LINEAR)
        self.o = w((d, q_out), "self_attn.o_proj.weight", Kind.LINEAR)
        self.q_norm = w((hd,), "self_attn.q_norm.weight", Kind.NORM)
        self.k_norm = w((hd,), "self_attn.k_norm.weight", Kind.NORM)

    def __call__(self, x, batch: Batch, row_tile: int | None):
        """→ (the residual stream after this layer, the keys and values it attended with)."""
        qkv = stacked_outputs(self.q.get_value(), self.k.get_value(), self.v.get_value())
        q, gate, k, v = by_rows(partial(self._qkv, qkv), row_tile, x, batch.positions)
        attn = attention(q, k, v, batch, scale=self.cfg.head_dim**-0.5)
        return self._feed_forward(row_tile, self._mixed, x, attn, gate), (k, v)

    def _qkv(self, qkv, x, positions):
        """Row-local: queries [T, heads, head_dim], their output gates, keys and values, through the q (with
        its gates), k and v weights stacked (qkv)."""
        cfg, t, hd = self.cfg, x.shape[0], self.cfg.head_dim
        h = _norm(x, self.input_norm, cfg)
        heads = (2 * cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)
        q_gate, k, v = split_heads(linear(h, qkv), heads, hd)  # per head: query, then gate
        q, gate = jnp.split(q_gate.reshape(t, cfg.num_heads, 2 * hd), 2, axis=-1)
        q, k = (self._rope(_norm(y, w, cfg), positions) for y, w in ((q, self.q_norm), (k, self.k_norm)))
        return q, gate, k, v

    def _rope(self, x, positions):
        r = self.cfg.rotary_dim
        return jnp.concatenate([apply_rope(x[..., :r], positions, self.cfg.rope), x[..., r:]], axis=-1)

    def _mixed(self, x, attn, gate):
        """Row-local: the gated output projection and the residual."""
        gated = attn * jax.nn.sigmoid(gate)
        return x + linear(gated.reshape(x.shape[0], -1), self.o.get_value())


class Qwen3_5(Decoder):
    Config = Config
    recurrent = True

    def __init__(self, cfg: Config, precision: Precision):
        def make_layer(ids):
            kind = GatedDeltaLayer if cfg.layer_types[ids[0]] == LINEAR else AttentionLayer
            return kind(cfg, ids, precision)

        signatures = list(cfg.layer_types)
        super().__init__(cfg, precision, make_layer, signatures, tied=cfg.tie_embeddings, softcap=None)

    def _final_norm(self, x):
        return _norm(x, self.final_norm, self.config)


def _norm(x, w: nnx.Param, cfg: Config):
    return rms_norm(x, w.get_value(), cfg.rms_norm_eps, style="gemma3")


def _l2norm(x):
    """x / |x| over the last axis in f32, as the reference's (eps 1e-6 under the root)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)

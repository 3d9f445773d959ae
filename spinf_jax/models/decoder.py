"""What every family's model shares: the LM head, and the opt-in capture of hidden states for research."""

import jax
import jax.numpy as jnp
from flax import nnx

from spinf_jax.models.layers import Batch, TreeBatch, by_rows, head_logits, head_token_logits
from spinf_jax.models.params import Kind, weight
from spinf_jax.quant import Precision


class Decoder(nnx.Module):
    """A decoder-only language model over a packed tree batch: the input embedding (`embed`), the LM head
    (`lm_head`, or None when tied to `embed`), the layers (each called as layer(x, batch, row_tile) and
    returning the new residual stream and the keys and values it attended with), the final norm and the
    final-logit softcap (or None). A family's subclass builds its layers and defines the row-local
    `_embed(tokens)` and `_final_norm(x)`."""

    def __init__(self, config, precision: Precision, layers: list, *, tied: bool, softcap: float | None):
        vocab, d = config.vocab_size, config.hidden_size
        self.config, self.precision, self.softcap = config, precision, softcap
        self.embed = weight((vocab, d), "model.embed_tokens.weight", Kind.EMBED, precision)
        self.lm_head = None if tied else weight((vocab, d), "lm_head.weight", Kind.EMBED, precision)
        self.layers = nnx.List(layers)
        self.final_norm = weight((d,), "model.norm.weight", Kind.NORM, precision)

    def __call__(self, batch: Batch, row_tile: int | None = None, capture=None) -> jax.Array:
        """Final hidden states [T, hidden] for every token of the pass (logits come from `logits`).

        capture: optional row indices [N] whose hidden states to keep (see `hidden_states`)."""
        return self.forward(batch, row_tile, capture)[0]

    def forward(self, batch: Batch, row_tile: int | None = None, capture=None):
        """(final hidden states [T, hidden], per layer the (keys, values) [T, kv_heads, head_dim] it attended
        with). A layer that reads another layer's keys (kv_source) lists that layer's."""
        x = by_rows(self._embed, row_tile, batch.tokens)
        kv = []
        for layer in self.layers:
            self._record(x, capture)
            x, layer_kv = layer(x, batch, row_tile)
            kv.append(layer_kv)
        return self._finish(x, row_tile, capture), kv

    def kv_source(self, i: int) -> int:
        """The layer whose keys and values layer i attends with (itself, except in Gemma 4's shared
        layers)."""
        return i

    def _finish(self, x: jax.Array, row_tile: int | None, capture) -> jax.Array:
        x = by_rows(self._final_norm, row_tile, x)
        self._record(x, capture)
        return x

    def _head(self):
        return (self.embed if self.lm_head is None else self.lm_head).get_value()

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[N, hidden] → [N, vocab] f32 logits, only for the rows asked for."""
        return head_logits(hidden, self._head(), self.softcap)

    def token_logits(self, hidden: jax.Array, tokens: jax.Array) -> jax.Array:
        """[N, hidden], [N] token ids → [N] f32: each row's logit for its one token."""
        return head_token_logits(hidden, self._head(), tokens, self.softcap)

    def _record(self, x: jax.Array, capture: jax.Array | None) -> None:
        """Keep the residual stream at rows `capture` as an nnx.Intermediate (only when asked: the engine
        never captures, so its programs hold no extra outputs)."""
        if capture is not None:
            self.sow(nnx.Intermediate, "hidden", x[capture])


def split(decoder: Decoder) -> tuple[nnx.GraphDef, dict]:
    """The decoder as (its static structure, its weights as a plain nested dict of arrays), for a plain
    jax.jit over the weights with `nnx.merge(graphdef, weights)` inside. A dict rather than the nnx.State:
    jit flattens its arguments at every call, and a State of Variables flattens in Python (1.8 ms a call for
    Gemma 3 12B's 962 arrays on the development machine) where a dict flattens in C++ (0.09 ms)."""
    graphdef, state = nnx.split(decoder)
    return graphdef, nnx.to_pure_dict(state)


def hidden_states(decoder: Decoder, batch: TreeBatch, rows: jax.Array, row_tile: int | None) -> jax.Array:
    """[layers + 1, N, hidden]: the residual stream at `rows` entering each layer, then the final normed
    output (the same entries as transformers' `output_hidden_states`)."""
    _, captured = nnx.capture(decoder, nnx.Intermediate)(batch, row_tile, capture=rows)
    return jnp.stack(captured["hidden"].get_value())

"""What every family's model shares: its layers as scanned stacks, the LM head, and the opt-in capture of
hidden states for research."""

import dataclasses
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spinf_jax.models.layers import Batch, TreeBatch, by_rows, head_logits, head_token_logits
from spinf_jax.models.params import Kind, weight
from spinf_jax.quant import Precision, embed


def runs(signatures: list[Hashable]) -> list[tuple[int, int, int]]:
    """Split a model's layers into (first layer, period, repeats) runs: `repeats` copies of `period`
    consecutive layers whose signatures (what makes a layer's program differ: its type, shapes, the layer it
    reads keys from) repeat. Each run takes the longest stretch it can cover from where the last one ended,
    with the shortest period that covers it (Gemma 3 270M: 3 × [5 sliding, 1 global])."""
    out, start, n = [], 0, len(signatures)
    while start < n:
        best = (1, 1)  # period, repeats
        for period in range(1, (n - start) // 2 + 1):
            block = signatures[start : start + period]
            repeats = 1
            while signatures[start + repeats * period : start + (repeats + 1) * period] == block:
                repeats += 1
            if repeats > 1 and repeats * period > best[0] * best[1]:
                best = (period, repeats)
        out.append((start, *best))
        start += best[0] * best[1]
    return out


class Stack(nnx.Module):
    """`repeats` copies of `period` consecutive layers, run as one lax.scan over the repeats: the program
    holds each of the period's layers once (a 30-layer model's program is ~15x smaller and compiles ~5x
    faster than with every layer unrolled). Each of `layers` is one module whose weights are stacked over the
    repeats ([repeats, ...], params.weight with a tuple of sources); `ids[k][m]` is the model's layer index
    of position k in repeat m."""

    def __init__(self, make_layer: Callable[[tuple], nnx.Module], start: int, period: int, repeats: int):
        self.ids = tuple(tuple(start + m * period + k for m in range(repeats)) for k in range(period))
        self.layers = nnx.List([make_layer(ids) for ids in self.ids])

    def scan(self, body, x, xs):
        """body(the period's layers with one repeat's weights, x, that repeat's slice of xs) → (x, ys);
        returns (x after the last repeat, ys stacked [repeats, ...])."""
        # Layer by layer (nnx.List's int keys do not sort with the str keys nnx.capture adds); `rests` are
        # the layers' other state, not scanned over.
        parts = [nnx.split(layer, nnx.Param, ...) for layer in self.layers]
        graphdefs, weights, rests = zip(*parts, strict=True)

        def step(x, inputs):
            layers = [nnx.merge(*parts) for parts in zip(graphdefs, inputs[0], rests, strict=True)]
            return body(layers, x, inputs[1])

        return jax.lax.scan(step, x, (weights, xs))


class Decoder(nnx.Module):
    """A decoder-only language model over a packed tree batch: the input embedding (`embed`), the LM head
    (`lm_head`, or None when tied to `embed`), the layers in stacks (`make_layer(layer indices)` builds one
    module holding those layers' weights stacked; `signatures[i]` is what layer i's program depends on, so
    layers with equal signatures can share one), the final norm and the final-logit softcap (or None). Each
    layer is called through `_call_layer` (layer(x, batch, row_tile) unless a family says otherwise) and
    returns the new residual stream and the keys and values it computed (None when it reads another
    layer's, or keeps none). A family's subclass defines the row-local `_final_norm(x)` (and `_embed(tokens)`
    where the embedding is not used as it is).
    A family with recurrent layers (`recurrent`) reads the batch's parents and recurrent chunks."""

    recurrent = False

    def __init__(self, config, precision: Precision, make_layer, signatures: list, *, tied: bool,
                 softcap: float | None):  # fmt: skip
        vocab, d = config.vocab_size, config.hidden_size
        self.config, self.precision, self.softcap = config, precision, softcap
        self.embed = weight((vocab, d), "model.embed_tokens.weight", Kind.EMBED, precision)
        self.lm_head = None if tied else weight((vocab, d), "lm_head.weight", Kind.EMBED, precision)
        self.stacks = nnx.List([Stack(make_layer, *run) for run in runs(signatures)])
        self.final_norm = weight((d,), "model.norm.weight", Kind.NORM, precision)

    def __call__(self, batch: Batch, row_tile: int | None = None, capture=None) -> jax.Array:
        """Final hidden states [T, hidden] for every token of the pass (logits come from `logits`).

        capture: optional row indices [N] whose hidden states to keep (see `hidden_states`)."""
        return self.forward(batch, row_tile, capture, keep_kv=False)[0]

    def forward(self, batch: Batch, row_tile: int | None = None, capture=None, keep_kv: bool = True):
        """(final hidden states [T, hidden], the keys and values the layers attended with: per stack, per
        position in its period, (keys, values) [repeats, T, kv_heads, head_dim], or None where the layers
        read another layer's (kv_source)). A decode step's `batch.cache` and `batch.history` come in that
        structure.

        keep_kv=False keeps only those another layer reads (a scan's outputs stay alive to its end, where XLA
        would free an unrolled layer's keys as soon as nothing reads them)."""
        inputs = (batch.tokens,)
        if isinstance(batch, TreeBatch) and batch.media is not None:
            # Each row's soft token [T, hidden] (media's row 0 where it has none) and which rows have one.
            inputs += (batch.media[jnp.maximum(batch.media_row, 0)], batch.media_row >= 0)
        x, per_layer = by_rows(self._inputs, row_tile, *inputs)
        read = {j for i in range(self.num_layers) if (j := self.kv_source(i)) != i}  # layers others read
        kv, entering = [], []
        for s, stack in enumerate(self.stacks):
            keep = [keep_kv or not read.isdisjoint(ids) for ids in stack.ids]
            ids = np.array(stack.ids)  # [period, repeats]
            memory = None if isinstance(batch, TreeBatch) else (batch.cache[s], batch.history[s])
            # A layer that reads another's keys reads the same layer in every repeat (its signature says so).
            sources = [self._source(kv, batch, row[0]) for row in stack.ids]
            # per-layer inputs [T, layers, P] → [repeats, period, T, P]
            inputs = None if per_layer is None else jnp.moveaxis(per_layer[:, ids.T], 0, 2)

            def body(layers, x, xs, sources=sources, keep=keep):
                inputs, memory = xs
                out, seen = [], []
                for k, layer in enumerate(layers):
                    seen.append(None if capture is None else x[capture])
                    # The keys this layer reads besides its own: another layer's, or in a decode step its own
                    # slice of the pass's keys and of the history.
                    own = None if memory is None else (memory[0][k], memory[1][k])
                    shared_kv, layer_memory = sources[k] or (None, own)
                    layer_batch = batch
                    if layer_memory is not None:
                        cache, history = layer_memory
                        layer_batch = dataclasses.replace(batch, cache=cache, history=history)
                    layer_input = None if inputs is None else inputs[k]
                    x, layer_kv = self._call_layer(layer, x, layer_batch, row_tile, layer_input, shared_kv)
                    out.append(layer_kv if keep[k] else None)
                return x, (tuple(out), tuple(seen))

            x, (stack_kv, seen) = stack.scan(body, x, (inputs, memory))
            kv.append(stack_kv)
            if capture is not None:  # in layer order: repeat by repeat, each repeat's period in order
                entering += [seen[k][m] for m in range(ids.shape[1]) for k in range(ids.shape[0])]
        for rows in entering:
            self.sow(nnx.Intermediate, "hidden", rows)
        return self._finish(x, row_tile, capture), kv

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def layer(self, i: int) -> tuple[nnx.Module, int]:
        """Layer i as (the module holding its weights, stacked with others of its kind; its index along their
        leading axis): `module.q.get_value()[m]` is layer i's q projection."""
        s, k, m = self._where(i)
        return self.stacks[s].layers[k], m

    def _where(self, i: int) -> tuple[int, int, int]:
        """Layer i as (stack, position in the period, repeat)."""
        for s, stack in enumerate(self.stacks):
            for k, ids in enumerate(stack.ids):
                if i in ids:
                    return s, k, ids.index(i)
        raise IndexError(f"layer {i} of a {self.num_layers}-layer model")

    def _source(self, kv: list, batch: Batch, i: int):
        """For layer i when it reads another layer's keys and values: (those of this pass or step, and in a
        decode step that layer's slice of the pass's keys and of the history); else None."""
        j = self.kv_source(i)
        if j == i:
            return None
        s, k, m = self._where(j)

        def take(tree):
            return jax.tree.map(lambda a: a[m], tree)

        memory = None
        if not isinstance(batch, TreeBatch):
            memory = take(batch.cache[s][k]), take(batch.history[s][k])
        return take(kv[s][k]), memory

    def _inputs(self, tokens, soft=None, is_media=None):
        """Row-local: the input embedding [T, hidden] and the layers' own inputs [T, layers, P] (or None).
        In a pass with images, the rows `is_media` [T] take their soft tokens `soft` [T, hidden] instead of
        their token's embedding (with_media)."""
        return with_media(self._embed(tokens), soft, is_media), None

    def _embed(self, tokens):
        """Row-local: the input embedding [T, hidden] in the activation dtype (Gemma scales it)."""
        return embed(tokens, self.embed.get_value(), self.precision.activation_dtype)

    @staticmethod
    def _call_layer(layer, x, batch, row_tile, per_layer, shared_kv):
        """One layer: a family whose layers take per-layer inputs or another layer's keys says how."""
        return layer(x, batch, row_tile)

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


def with_media(x: jax.Array, soft: jax.Array | None, is_media: jax.Array | None) -> jax.Array:
    """The input embeddings x [T, hidden] with the media rows' replaced by their soft tokens (as transformers
    scatters an image's features over its placeholder tokens)."""
    if soft is None:
        return x
    return jnp.where(is_media[:, None], soft.astype(x.dtype), x)


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

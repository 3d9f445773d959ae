"""Building blocks shared by the model families: the packed tree batch, norms, rotary embeddings, MLP."""

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import decode_attention
from pallas_kernels.late_map import late_map
from pallas_kernels.tree_attention import blockwise, kernel
from spinf_jax.layout import Tree
from spinf_jax.packer import empty_chunks
from spinf_jax.quant import Weight, embed, linear

# Hugging Face's names for the two kinds of attention layer (Gemma 3 and 4 alternate them).
SLIDING, GLOBAL = "sliding_attention", "full_attention"


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TreeBatch:
    """A packed pass: many token trees laid out one after another, each in depth-first order.

    Token j is visible to token i exactly when j <= i < span_end[j]: a token's span is itself plus its
    subtree (everything laid out after it up to span_end). A content's trunk tokens span the whole tree,
    so every branch sees the trunk; a branch's tokens span only their own sub-branches, so siblings never
    see each other; and nothing spans past its own tree, so packed contents never see their neighbours.
    A plain sequence is the special case span_end[j] = T for all j. Padding spans only itself.

    Recurrent layers (Qwen3.5's Gated DeltaNet) read `parent`, the row before each row on its path, for their
    short convolution, and run the gated delta rule over `chunks` (spinf_jax.layout.Tree.recurrent_chunks);
    in a pass with extraction slots they hand the states at `export_rows` to decoding. All three are empty
    for models without such layers.

    An image's soft tokens (spinf_jax.models.siglip) enter as the input embeddings of its rows in the trunk
    (`media`, `media_row`), and those rows also see the rest of their image (`reach`).

    Attention reads a row's keys in two parts (pallas_kernels.tree_attention): the trunk of its tree, in key
    blocks counted from the tree's first row (`tree_start`), then the row's own branch (one question: its
    template and option trie), in key blocks counted from the branch's first row. Each reduction then sees
    the same keys at the same offsets however the tree is packed and whatever other questions it holds,
    which is what makes a (content, question) score the same bits in any pass.
    """

    tokens: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32: depth in the tree, i.e. position in the equivalent linear sequence
    span_end: jax.Array  # [T] int32
    trunk_end: jax.Array  # [T] int32: end of the trunk of the row's tree (i + 1 for padding)
    branch_start: jax.Array  # [T] int32: first row of the row's branch (i + 1 for trunk rows and padding)
    tree_start: jax.Array  # [T] int32: first row of the row's tree (packer.tree_starts)
    parent: jax.Array  # [T] int32, -1 where a row has none (or [0])
    chunks: jax.Array  # [N, 4] int32: first row, rows, start, keep (or [0, 4])
    export_rows: jax.Array  # [X] int32: the extraction slots' rows, whose recurrent states decoding reads
    block: int = field(metadata=dict(static=True))  # T's multiple; the CPU attention's block (default_block)
    # Passes with media only (None in the others, whose programs stay as they were):
    reach: jax.Array | None = None  # [T] int32: a row sees keys j < reach (i + 1; an image's rows: its end)
    media: jax.Array | None = None  # [M, hidden]: soft tokens, the input embeddings of rows `media_row`
    media_row: jax.Array | None = None  # [T] int32: each row's row of `media`, -1 for its token's embedding

    @staticmethod
    def chains(sequences: list[list[int]], block: int = 128) -> tuple["TreeBatch", list[int]]:
        """Plain sequences side by side in one pass, padded to whole blocks; returns each one's first row.

        They share one tree start (row 0): every block reads keys from row 0 and the mask keeps them apart,
        which is exact but not batch-invariant (the engine's packer gives each tree its own start). Recurrent
        chunks are laid out for every model (each sequence is a trunk); models without recurrent layers
        ignore them."""
        starts = np.cumsum([0] + [len(s) for s in sequences[:-1]]).tolist()
        n = sum(len(s) for s in sequences)
        total = -(-n // block) * block
        tokens = np.zeros(total, np.int32)
        positions = np.zeros(total, np.int32)
        span_end = np.arange(1, total + 1, dtype=np.int32)  # a padding token sees only itself
        trunk_end = span_end.copy()
        parent = np.full(total, -1, np.int32)
        chunks = []
        for start, seq in zip(starts, sequences, strict=True):
            end = start + len(seq)
            tokens[start:end] = seq
            positions[start:end] = np.arange(len(seq))
            span_end[start:end] = end
            trunk_end[start:end] = end  # a plain sequence is all trunk
            parent[start + 1 : end] = np.arange(start, end - 1)
            chunks += [(a + start, *rest) for a, *rest in Tree.trunk(list(seq)).recurrent_chunks()]
        table = empty_chunks(max(2, len(chunks)), total)
        table[: len(chunks)] = chunks
        arrays = (tokens, positions, span_end, trunk_end, np.arange(1, total + 1, dtype=np.int32))
        recurrent = (parent, table, np.zeros(0, np.int32))  # no extraction slots
        batch = TreeBatch(
            *map(jnp.asarray, arrays), jnp.zeros(total, jnp.int32), *map(jnp.asarray, recurrent), block
        )
        return batch, starts

    def with_media(self, media: list[tuple], capacity: int | None = None) -> "TreeBatch":
        """This pass with media in it: (the row of an image's or clip's first soft token, its soft tokens
        [n, hidden][, "audio" for a clip, "video" for a video's frame]) each. An image's (or frame's) rows see
        the whole image; a clip's attend causally (as transformers masks Gemma 4's audio). `capacity`: rows of
        the batch's `media` (their count by default)."""
        t = self.tokens.shape[0]
        reach = np.arange(1, t + 1, dtype=np.int32)
        media_row = np.full(t, -1, np.int32)
        taken = 0
        for row, soft, *kind in media:
            n = soft.shape[0]
            if kind != ["audio"]:
                reach[row : row + n] = row + n
            media_row[row : row + n] = np.arange(taken, taken + n)
            taken += n
        rows = jnp.concatenate([soft for _, soft, *_ in media])
        rows = jnp.pad(rows, ((0, (capacity or taken) - taken), (0, 0)))
        return dataclasses.replace(
            self, reach=jnp.asarray(reach), media=rows, media_row=jnp.asarray(media_row)
        )

    @staticmethod
    def sequence(tokens, block: int = 128) -> "TreeBatch":
        """One plain sequence, padded to a whole number of blocks (the padding rows are not meaningful)."""
        return TreeBatch.chains([list(tokens)], block)[0]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DecodeBatch:
    """One decode step: a token per beam hypothesis of G extraction slots, W hypotheses each (rows [G × W],
    group-major), continuing from a tree pass's keys and values (pallas_kernels.decode_attention).

    `cache` holds the pass's (keys, values) [T, kv_heads, head_dim] and `history` those of the earlier decode
    steps [G, S, W, kv_heads, head_dim]: for the whole model in the structure of Decoder.forward's keys and
    values (per stack, per position, stacked over the repeats; None for layers that read another layer's),
    and as one layer sees them, that layer's (or its source's) own.
    """

    tokens: jax.Array  # [R] int32: the token each hypothesis feeds now
    positions: jax.Array  # [R] int32: its position along its tree path
    tree_start: jax.Array  # [G] int32: each slot's tree, trunk and template as rows of the pass
    trunk_end: jax.Array  # [G]
    branch_start: jax.Array  # [G]
    slot_end: jax.Array  # [G]: the slot row + 1
    export: jax.Array  # [G]: which of the pass's exported recurrent states is the slot's
    path: jax.Array  # [G, W, S] int32: which history row holds each hypothesis's key at each step
    step: jax.Array  # [] int32: this step's history column
    cache: tuple
    history: tuple
    block: int = field(metadata=dict(static=True))  # the pass's trunk block
    group_tile: int = field(metadata=dict(static=True))  # groups per attention loop body


Batch = TreeBatch | DecodeBatch


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RecurrentState:
    """What a recurrent layer carries where an attention layer has keys and values: from a pass, the states
    at its extraction slots ([X, heads, key dim, value dim] f32) and the inputs its convolution reads there
    besides the next token's ([X, kernel - 1, channels]: the slot row first, then the rows before it); in a
    decode step, the same per hypothesis ([G, W, ...]), after the token it fed. A step replaces it whole
    (where keys and values are written at the step's column)."""

    state: jax.Array
    window: jax.Array


def attention(
    q, k, v, batch: Batch, *, scale: float, window: int | None = None, media_both_ways: bool = True
) -> jax.Array:
    """q [T, H, D], k/v [T, K, D] → [T, H, D]. In a tree pass: the tree mask of `batch`, by the Pallas kernel
    on GPUs and its pure-JAX twin (the same visiting order) elsewhere; an image's rows see the whole image
    where the model's layer does (media_both_ways: Gemma 3 every layer, Gemma 4 its sliding ones), else
    only what precedes them. In a decode step: the pass's keys in `batch.cache`, then the step's history
    (Pallas on GPUs, pure JAX elsewhere)."""
    b = batch
    with jax.named_scope("attention"):  # names the ops in device profiles (here and below)
        if isinstance(b, DecodeBatch):
            groups = (b.tree_start, b.trunk_end, b.branch_start, b.slot_end, b.path, b.step)
            decode = decode_attention.kernel if jax.default_backend() == "gpu" else decode_attention.blockwise
            return decode(
                q, k, v, *b.cache, *b.history, b.positions, *groups,
                scale=scale, window=window, block=b.block, group_tile=b.group_tile,
            )  # fmt: skip
        args = (q, k, v, b.positions, b.span_end, b.trunk_end, b.branch_start, b.tree_start)
        attend = kernel if jax.default_backend() == "gpu" else blockwise
        reach = b.reach if media_both_ways else None
        return attend(*args, scale=scale, window=window, block=batch.block, reach=reach)


def by_rows(fn, tile: int | None, *arrays):
    """Apply a row-local fn to arrays with a leading [T] axis, `tile` rows at a time.

    With a tile, every tile runs the same compiled loop body, so a row's bits never depend on how many rows
    the pass has. XLA's code generation does not promise that on its own: a fused RMSNorm gave different
    bits for the same row in passes of 256 and 1024 tokens on the CPU, and f32 GEMMs did on the GPU. Without
    a tile (None), fn sees all rows at once.
    """
    if tile is None:
        return fn(*arrays)
    t = arrays[0].shape[0]
    tiles = [a.reshape(t // tile, tile, *a.shape[1:]) for a in arrays]
    out = late_map(lambda xs: fn(*xs), tiles)
    return jax.tree.map(lambda o: o.reshape(t, *o.shape[2:]), out)


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float, *, style: str) -> jax.Array:
    """RMSNorm computed in f32; where the weight is applied and cast back follows the reference, which is
    what keeps bf16 parity: "gemma3" scales by (1 + w) in f32, "gemma4" by w in f32 (or not at all where
    weight is None: Gemma 4's v-norm), "llama" (Llama/Qwen) casts back first and then scales by w."""
    with jax.named_scope("norm"):
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        if style == "llama":
            return weight.astype(x.dtype) * normed.astype(x.dtype)
        if weight is not None:
            normed = normed * ((1.0 if style == "gemma3" else 0.0) + weight.astype(jnp.float32))
        return normed.astype(x.dtype)


@dataclass(frozen=True)
class Rope:
    theta: float
    linear_factor: float = 1.0  # "linear" rope scaling divides every frequency by this factor
    # Gemma 4's "proportional" rope rotates only the first fraction of the frequency pairs (with exponents
    # still over the whole head_dim) and leaves the rest unrotated (frequency zero).
    rotated_fraction: float = 1.0

    @staticmethod
    def from_hf(params: dict | None, default_theta: float) -> "Rope":
        params = params or {}
        kind = params.get("rope_type", params.get("type", "default"))
        theta = float(params.get("rope_theta", default_theta))
        if kind == "default":
            return Rope(theta)
        if kind == "linear":
            return Rope(theta, float(params["factor"]))
        if kind == "proportional":
            return Rope(
                theta, float(params.get("factor", 1.0)), float(params.get("partial_rotary_factor", 1.0))
            )
        raise ValueError(f"unsupported rope scaling {kind!r}")

    def inv_freq(self, head_dim: int) -> jax.Array:
        """[head_dim / 2] f32 angular frequencies."""
        exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
        freq = 1.0 / (self.theta**exponents) / self.linear_factor
        rotated = int(self.rotated_fraction * head_dim // 2)
        return jnp.where(jnp.arange(head_dim // 2) < rotated, freq, 0.0)


def split_heads(y: jax.Array, counts: tuple[int, ...], head_dim: int) -> tuple[jax.Array, ...]:
    """A stacked projection's output (quant.stacked_outputs: q, k and v, or fewer) [T, Σ counts · head_dim]
    → one [T, count, head_dim] array per count."""
    y = y.reshape(y.shape[0], sum(counts), head_dim)
    return tuple(jnp.split(y, list(itertools.accumulate(counts))[:-1], axis=1))


def apply_rope(x: jax.Array, positions: jax.Array, rope: Rope) -> jax.Array:
    """Rotate-half rotary embedding. x [T, heads, head_dim], positions [T].

    The halves (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin) are written as one elementwise expression over
    the whole head, x·[cos, cos] + [x2, x1]·[−sin, sin], with the halves swapped by a reverse: split halves
    joined by a concatenate made XLA's GPU fusions compute each half (and the q/k norm before it) in a
    kernel of its own and copy them together (benchmarks/results, 2026-12-06, rope as one expression)."""
    with jax.named_scope("rope"):
        angles = positions.astype(jnp.float32)[:, None] * rope.inv_freq(x.shape[-1])[None, :]  # [T, D/2]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        cos = jnp.concatenate([cos, cos], axis=-1)[:, None, :]  # [T, 1, D]
        sin = jnp.concatenate([-sin, sin], axis=-1)[:, None, :]
        xf = x.astype(jnp.float32)
        swapped = jnp.flip(xf.reshape(*x.shape[:-1], 2, -1), axis=-2).reshape(x.shape)  # [x2, x1]
        return (xf * cos + swapped * sin).astype(x.dtype)


def gated_mlp(x: jax.Array, gate: Weight, up: Weight, down: Weight, activation) -> jax.Array:
    with jax.named_scope("mlp"):
        return linear(activation(linear(x, gate)) * linear(x, up), down)


def gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def head_logits(hidden: jax.Array, head: Weight, softcap: float | None) -> jax.Array:
    """[N, hidden] → [N, vocab] f32 logits through the LM head [vocab, hidden]."""
    with jax.named_scope("lm_head"):
        return _softcap(linear(hidden, head, jnp.float32), softcap)


def head_token_logits(hidden: jax.Array, head: Weight, tokens: jax.Array, softcap: float | None) -> jax.Array:
    """The logit of one chosen token per row: hidden [N, hidden], tokens [N] → [N] f32, without the
    [N, vocab] matrix (a row-wise dot with the gathered head rows)."""
    rows = embed(tokens, head, jnp.float32)
    return _softcap(jnp.sum(hidden.astype(jnp.float32) * rows, axis=-1), softcap)


def _softcap(logits, softcap):
    return logits if not softcap else jnp.tanh(logits / softcap) * softcap


def embedding_scale(hidden: int, dtype) -> jax.Array:
    """Gemma multiplies embeddings by sqrt(hidden) rounded to the activation dtype (as the reference does)."""
    return jnp.asarray(math.sqrt(hidden), dtype)

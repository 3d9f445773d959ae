"""Token trees for the tests: a pool of questions of every shape, and laying trees out as the packer does at
any block size (the packer's own buckets are multiples of 128 tokens)."""

import jax.numpy as jnp
import numpy as np

from spinf_jax.layout import QuestionKey, Tree
from spinf_jax.packer import tree_starts


def _pool() -> list[QuestionKey]:
    """Questions as requests make them: a template filled from a grid of placeholder values (shared prefix,
    one differing token), multi-token options sharing prefixes, long and empty templates."""
    rng = np.random.default_rng(7)
    pool = []
    for filler in (101, 102, 103):  # "Is the message {tone} about the product?"
        pool.append(QuestionKey((20, 21, filler, 22, 23), ((40,), (41,))))
    for subject in (110, 111):
        for tone in (120, 121):  # a 2 × 2 grid: two placeholders
            pool.append(
                QuestionKey((24, subject, 25, tone, 26), ((50, 51, 52), (50, 51, 53), (50, 60), (70,)))
            )
    pool.append(QuestionKey(tuple(rng.integers(5, 500, 45).tolist()), ((80, 81), (82, 83, 84, 85, 86))))
    pool.append(QuestionKey((), ((90, 91), (92,))))  # the options read straight after the content
    pool.append(QuestionKey((27,), tuple((200 + i,) for i in range(12))))  # many one-token options
    return pool


POOL = _pool()


def lay_out(trees: list[Tree], block: int, total_blocks: int, align: int | None = None, gap: int = 0):
    """Trees at `align`-row boundaries (the block's by default), `gap` more rows apart, as the packer lays
    them out: the attention arguments, tree offsets."""
    align = align or block
    t = total_blocks * block
    positions = np.zeros(t, np.int32)
    span_end = np.arange(1, t + 1, dtype=np.int32)
    trunk_end, branch_start = span_end.copy(), span_end.copy()
    offsets, cursor = [], 0
    for tree in trees:
        n = len(tree)
        positions[cursor : cursor + n] = tree.positions
        span_end[cursor : cursor + n] = np.asarray(tree.span_end) + cursor
        trunk_end[cursor : cursor + n] = cursor + tree.trunk_tokens
        branch_start[cursor : cursor + n] = np.asarray(tree.branch_start) + cursor
        offsets.append(cursor)
        assert cursor + n <= t
        cursor += -(-(n + gap) // align) * align
    starts = tree_starts(t, [(o, len(tree)) for o, tree in zip(offsets, trees, strict=True)], align, block)
    arrays = (positions, span_end, trunk_end, branch_start, starts)
    return tuple(map(jnp.asarray, arrays)), offsets

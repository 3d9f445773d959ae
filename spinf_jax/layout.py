"""Token trees: one read of a content, a branch per question, a sub-branch per option prefix.

A tree is laid out depth-first: the trunk (BOS + content), then each question's branch: its filled template
followed by its option trie. Token positions continue from the parent (a branch token's position is its
depth), and each token's span covers its subtree, which is all the attention mask needs (TreeBatch).
Attention also needs to know where the trunk ends and where each row's branch starts: it reads the trunk
and the row's own branch separately, so that a question's scores do not depend on its companions.

A question with an extraction slot has no options: its branch is the template alone, read at its last row,
and its answers are decoded from there (spinf_jax.extraction) with the tree's keys and values.

Models with recurrent layers (Qwen3.5's Gated DeltaNet) also need each row's parent (the row before it on its
path) and the tree cut into chunks of at most RECURRENT_CHUNK rows, each run from one known state
(Tree.recurrent_chunks): the trunk from zeros, each template from the trunk's last state, each group of whole
option subtrees from the template's last state. A chunk's rows and where it starts depend on its own question
alone, which keeps those models' scores batch-invariant too.

An option's log-probability is the sum of reads: log P(o1) at the template's last token, then
log P(o_{j+1}) at the trie node of o_1..o_j. The trie holds each option's tokens except its last, shared
between options with a common prefix (" New York" and " New Jersey" share " New").
"""

import functools
from dataclasses import dataclass, field

from pallas_kernels.gated_delta import (
    KEEP_EXPORT,
    KEEP_NONE,
    KEEP_SLOT,
    KEEP_TRUNK,
    START_RUNNING,
    START_SLOT,
    START_TRUNK,
    START_ZERO,
)

SEARCH_WIDTH = 8  # hypotheses a searched slot keeps per step (so at most 8 answers)
MAX_ANSWER_TOKENS = 32  # a searched answer's tokens
MAX_GENERATED_TOKENS = 128  # a generated answer's tokens
MAX_CLOSING_TOKENS = 16
# Rows a recurrent layer computes at once from one state (the chunked gated delta rule's chunk).
RECURRENT_CHUNK = 64


@dataclass(frozen=True)
class Extract:
    """An extraction slot: what its answers may hold, how they end, how many are searched for."""

    kind: str = "text"  # "text" ({*}), "number" ({n}), "amount" ({$})
    closing_ids: tuple[int, ...] = ()  # the closing text that ends an answer; () ends at a newline
    max_answers: int = 5
    max_tokens: int = 16  # tokens of an answer, its closing text not counted
    generate: bool = False  # greedy: one answer, no search

    @property
    def width(self) -> int:
        return 1 if self.generate else SEARCH_WIDTH


@dataclass(frozen=True)
class QuestionKey:
    """What a question's scores depend on besides the content: the floor cache is keyed by it."""

    template_ids: tuple[int, ...]
    option_ids: tuple[tuple[int, ...], ...] = ()
    extract: Extract | None = None  # an extraction slot instead of options


@dataclass(frozen=True)
class SlotRow:
    """Where a tree reads an extraction slot."""

    question: int  # index among the tree's questions
    row: int  # the template's last row (the trunk's last row for an empty template)
    branch_start: int  # the template's first row (row + 1 for an empty template)
    read: int  # index into read_rows
    extract: Extract


@dataclass
class Tree:
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    span_end: list[int] = field(default_factory=list)  # relative to the tree's first token
    read_rows: list[int] = field(default_factory=list)  # rows whose next-token distribution is read
    targets: list[tuple[int, int]] = field(default_factory=list)  # (index into read_rows, token id)
    options: list[list[list[int]]] = field(default_factory=list)  # [question][option] → target indices
    # First row of the branch each row belongs to (row + 1 for trunk rows, which belong to none).
    branch_start: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)  # the row before each row on its path (-1: none)
    trunk_tokens: int = 0
    # Per question: (its first row, its option trie's first row, the row after it, its options, whether it
    # is an extraction slot).
    branches: list[tuple[int, int, int, tuple, bool]] = field(default_factory=list)
    slots: list[SlotRow] = field(default_factory=list)
    # Media in the trunk: (the row of its first soft token, its soft tokens [n, hidden] on the device[,
    # "audio" for an audio clip]) per image or clip (TreeBatch.with_media).
    media: list[tuple] = field(default_factory=list, compare=False)
    _chunks: list | None = field(default=None, repr=False, compare=False)  # recurrent_chunks, once worked out
    _reads: dict[int, int] = field(default_factory=dict, repr=False, compare=False)  # row → read index
    _target_index: dict[tuple[int, int], int] = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def trunk(token_ids: list[int]) -> "Tree":
        """A tree of trunk only: the tokens as one chain (spans are completed by whoever adds branches)."""
        tree = Tree()
        tree._push(token_ids, 0, -1)
        tree.trunk_tokens = len(tree.tokens)
        return tree

    def _push(self, tokens, position: int, parent: int) -> int:
        """Append a chain of tokens (each the next one's parent) from `position`, below row `parent`; returns
        its first row."""
        first, n = len(self.tokens), len(tokens)
        self.tokens += tokens
        self.positions += range(position, position + n)
        self.span_end += [0] * n  # set when a token's subtree is complete
        self.branch_start += range(first + 1, first + n + 1)
        self.parent += [parent, *range(first, first + n - 1)][:n]
        return first

    def recurrent_chunks(self) -> list[tuple[int, int, int, int]]:
        """The tree as recurrent layers run it: (first row, rows, where it starts: START_*, the state it
        keeps: KEEP_*) per chunk, in the order they run. An extraction slot's template keeps KEEP_EXPORT (the
        packer numbers the pass's slots); with an empty template, a chunk of no rows hands on the trunk's
        state. Raises ValueError where one option subtree is longer than a chunk. Worked out once per tree:
        packing asks for it to count a tree's chunks and again to lay them out."""
        if self._chunks is None:
            self._chunks = self._recurrent_chunks()
        return self._chunks

    def _recurrent_chunks(self) -> list[tuple[int, int, int, int]]:
        out = _chain(0, self.trunk_tokens, START_ZERO, KEEP_TRUNK)
        entry = START_TRUNK if self.trunk_tokens else START_ZERO
        for first, trie, end, option_ids, slot in self.branches:
            if slot:
                out += _chain(first, trie, entry, KEEP_EXPORT) or [(first, 0, entry, KEEP_EXPORT)]
                continue
            out += _chain(first, trie, entry, KEEP_SLOT if end > trie else KEEP_NONE)
            start = START_SLOT if trie > first else entry
            out += [(trie + a, n, start, KEEP_NONE) for a, n in _trie_groups(option_ids)]
        return out

    def _read_row(self, row: int) -> int:
        """The read index of a row, added the first time it is asked."""
        if row not in self._reads:
            self._reads[row] = len(self.read_rows)
            self.read_rows.append(row)
        return self._reads[row]

    def _read(self, row: int, token: int) -> int:
        """The target index of log P(token | row), added (with the row's read) the first time it is asked."""
        key = (self._read_row(row), token)
        if key not in self._target_index:
            self._target_index[key] = len(self.targets)
            self.targets.append(key)
        return self._target_index[key]


def build_tree(
    prefix: list[int], content_ids: list[int], questions: list[QuestionKey], media: tuple = ()
) -> Tree:
    """The tree of one content (or, with empty content, of the floor) with its questions, in order; `images`:
    the content's, as (the row of an image's first soft token among content_ids, its soft tokens)."""
    tree = Tree.trunk([*prefix, *content_ids])
    tree.media = [(len(prefix) + row, *rest) for row, *rest in media]
    for q in questions:
        start = len(tree.tokens)
        depth = tree.trunk_tokens + len(q.template_ids)
        tree._push(q.template_ids, tree.trunk_tokens, tree.trunk_tokens - 1)
        slot_row = len(tree.tokens) - 1 if q.template_ids else tree.trunk_tokens - 1
        if slot_row < 0:
            raise ValueError("nothing to read the slot after: empty content and template, and no BOS")
        if q.extract is not None:
            branch = start if q.template_ids else slot_row + 1
            tree.slots.append(
                SlotRow(len(tree.options), slot_row, branch, tree._read_row(slot_row), q.extract)
            )
            tree.options.append([])
        else:
            _add_option_trie(tree, q.option_ids, slot_row, depth)
        tree.branch_start[start:] = [start] * (len(tree.tokens) - start)
        slot = q.extract is not None
        tree.branches.append((start, start + len(q.template_ids), len(tree.tokens), q.option_ids, slot))
        # Template tokens are one chain; its span (and the trie below it) ends here.
        tree.span_end[start : start + len(q.template_ids)] = [len(tree.tokens)] * len(q.template_ids)
    tree.span_end[: tree.trunk_tokens] = [len(tree.tokens)] * tree.trunk_tokens
    return tree


def read_tree(token_ids: list[int], reads: dict[int, list[int]], media: tuple = ()) -> Tree:
    """A plain sequence (all trunk) read at some of its rows: `reads[row]` lists the tokens whose log-probs
    are wanted after that row. Each read is laid out as a question whose options are single tokens, so
    `Scored.option_logprobs(i)` gives the i-th read's log-probs in the order asked (parity uses this).
    `media`: as build_tree's, rows counted from the sequence's first."""
    tree = Tree.trunk(token_ids)
    tree.media = list(media)
    tree.span_end = [len(tree)] * len(tree)
    for row, tokens in reads.items():
        tree.options.append([[tree._read(row, token)] for token in tokens])
    return tree


def _add_option_trie(tree: Tree, option_ids, slot_row: int, depth: int) -> None:
    """Lay out the trie of option prefixes depth-first below slot_row and record every option's reads."""
    tokens, depths, spans, reads, parents = _trie(tuple(option_ids))
    first = len(tree.tokens)
    tree.tokens += tokens
    tree.positions += [depth + d for d in depths]
    tree.span_end += [first + end for end in spans]
    tree.branch_start += range(first + 1, first + len(tokens) + 1)
    tree.parent += [slot_row if node < 0 else first + node for node in parents]
    row = lambda node: slot_row if node < 0 else first + node  # noqa: E731 - node -1 is the slot itself
    tree.options.append([[tree._read(row(node), token) for node, token in option] for option in reads])


@functools.lru_cache(maxsize=4096)
def _trie(option_ids: tuple[tuple[int, ...], ...]) -> tuple[tuple, tuple, tuple, tuple, tuple]:
    """A question's option trie, the same below any slot (a pack or a job asks the same questions of every
    content, so its shape is worked out once): each node's token and depth below the slot's children, in
    depth-first order; the end of each node's subtree (the index after its last descendant); each option's
    reads as (the node read after, -1 for the slot; the token wanted); and each node's parent node (-1: the
    slot). Tuples: every tree shares them."""
    nodes: dict[tuple[int, ...], int] = {(): -1}  # option prefix → its node
    order: list[tuple[int, ...]] = []
    for ids in option_ids:
        for j in range(1, len(ids)):
            if ids[:j] not in nodes:
                nodes[ids[:j]] = -1
                order.append(ids[:j])
    # Depth-first: sort prefixes so each is followed by its extensions (ties keep first appearance).
    first_seen = {p: i for i, p in enumerate(order)}
    order.sort(key=lambda p: tuple(first_seen[p[:k]] for k in range(1, len(p) + 1)))
    nodes.update((prefix, i) for i, prefix in enumerate(order))
    # Spans: a node's subtree is every later node that extends it (contiguous thanks to the order).
    spans = []
    for i, prefix in enumerate(order):
        end = i + 1
        while end < len(order) and order[end][: len(prefix)] == prefix:
            end += 1
        spans.append(end)
    reads = tuple(tuple((nodes[ids[:j]], ids[j]) for j in range(len(ids))) for ids in option_ids)
    parents = tuple(nodes[p[:-1]] for p in order)
    return tuple(p[-1] for p in order), tuple(len(p) - 1 for p in order), tuple(spans), reads, parents


def question_chunks(q: QuestionKey) -> int:
    """The recurrent chunks a question adds to its tree (Tree.recurrent_chunks)."""
    template = -(-len(q.template_ids) // RECURRENT_CHUNK)
    return max(1, template) if q.extract is not None else template + len(_trie_groups(tuple(q.option_ids)))


def _chain(first: int, end: int, start: int, keep: int) -> list[tuple[int, int, int, int]]:
    """Recurrent chunks of the chain of rows [first, end): the first starts as `start` says, the others from
    the one before; the last keeps its state as `keep` says."""
    firsts = range(first, end, RECURRENT_CHUNK)
    return [
        (a, min(RECURRENT_CHUNK, end - a), start if a == first else START_RUNNING,
         keep if a + RECURRENT_CHUNK >= end else KEEP_NONE)
        for a in firsts
    ]  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _trie_groups(option_ids: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, int], ...]:
    """A question's option trie as recurrent chunks: runs of whole subtrees of the slot's children, as many
    as fit in a chunk, as (first node, nodes). Every chunk starts from the slot's state, and a chunk's rows
    are what its own options make them."""
    _, depths, spans, _, _ = _trie(option_ids)
    groups, node = [], 0
    while node < len(depths):
        end = node
        while end < len(depths) and spans[end] - node <= RECURRENT_CHUNK:
            end = spans[end]  # the next child of the slot starts where this one's subtree ends
        if end == node:
            raise ValueError(
                f"options sharing their first token make a subtree of {spans[node] - node} tokens; models "
                f"with recurrent layers read at most {RECURRENT_CHUNK} at once"
            )
        groups.append((node, end - node))
        node = end
    return tuple(groups)

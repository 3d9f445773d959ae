"""Packing token trees into passes of a few fixed bucket shapes.

One compiled program serves each bucket size. Attention reads every tree's keys in blocks counted from the
tree's own first row, so its results do not depend on where it lands or what shares its pass (see
TreeBatch); trees start on `Buckets.align`-row boundaries. Reads (rows whose
next-token distribution is needed) and targets (token log-probs) have fixed per-bucket capacities too.
"""

import math
from dataclasses import dataclass, field, replace

import jax
import numpy as np

from spinf_jax.layout import (
    KEEP_EXPORT,
    RECURRENT_CHUNK,
    QuestionKey,
    Tree,
    build_tree,
    question_chunks,
    read_tree,
)

READ_CHUNK = 128
# A pass's read capacity is two READ_CHUNKs at least, and its targets fill two of the engine's row tiles at
# least (a loop that runs once is inlined and rounds differently); the engine adds its own rule for its row
# tiles (Engine.__init__).
MIN_BUCKET = 2 * READ_CHUNK


def default_sizes() -> tuple[int, ...]:
    """The bucket sizes served by default. Each largest bucket holds a content at the 4,096-token limit (4,097
    rows with BOS, 4,224 aligned) with its questions. On the CPU a 16k-token pass takes minutes: 6,144 is the
    largest there, and small buckets keep single requests responsive: a decision request of Kev's shape (a
    ~100-token state, 6 questions: ~350 rows) fits 512 rows, a pass of 0.40 s on the default model in bf16
    against 0.68 s for 1,024, and over HTTP one client's p50 went from 894 to 627 ms with 512 added
    (benchmarks/results/decisions_http-cpu-2026-12-07-buckets-*, 2-core Intel Xeon).

    On GPUs every 2,048 rows from 4,096, two of the GPUs' row tiles (loader.default_row_tile): a pass's rows
    cost time whether trees fill them or not. With powers of two the seed job's 24 articles (28,583 tokens)
    took two passes of 16,384, 87% of their rows useful, and take 14,336 + 16,384 (93%); five one-article
    requests (5,935 tokens) took 8,192 rows and take 6,144 (benchmarks/results/bucket_rows-cpu-2026-12-05,
    counted from the plans). A lone small request's pass takes 0.110 s at 4,096 rows, where 2,048 rows in
    1,024-row tiles took 0.062 s (12B shape, H100, 2026-12-06): the bigger tiles buy bulk throughput with
    that latency. Each size is one more program to compile at start (8.2-9.3 s each cold at the 12B shape on
    the H200, start_time-h200-2026-12-04), behind the server once its smallest and largest are ready
    (Engine.warmup)."""
    if jax.default_backend() == "cpu":
        return (256, 512, 1024, 2048, 6144)
    return tuple(range(4096, 16384 + 1, 2048))


def default_block() -> int:
    """Pass sizes are multiples of the block, and it is the CPU twin's attention block (query rows and trunk
    keys per step): 128 rows on the CPU, 64 on GPUs (where the kernel's tiles are 64 or 32 rows, whatever
    the block). Trees do not align to it (Buckets.align)."""
    return 128 if jax.default_backend() == "cpu" else 64


@dataclass(frozen=True)
class Buckets:
    sizes: tuple[int, ...] = field(default_factory=default_sizes)
    block: int = field(default_factory=default_block)
    # Trees start on multiples of this many rows. Attention counts a tree's key blocks from its first row, so
    # any row would give the same bits; 16 keeps the Mosaic kernel's copies (whole 8-row units) aligned. The
    # moderation pack's trees took 80% useful rows in their passes aligned to 64-row blocks, 95% at 16
    # (benchmarks/results/bucket_rows-cpu-2026-12-06).
    align: int = 16
    # Reads and targets a pass holds: one read per `read_every` rows, `targets_per_row` targets per row. A
    # pass computes only the reads it holds (engine._read_chunk), so capacity costs index arrays, not work:
    # every row can be read. A read per 4 rows and a target per row cut the moderation pack's passes by reads
    # and targets (0.37 reads and 1.2 targets per aligned row): 7 passes where 4 hold it. Parity reads every
    # position with six targets each (parity.reference_buckets).
    read_every: int = 1
    targets_per_row: int = 2
    # What a pass costs beyond its rows, in rows (pack): launching it, its host work, and on the CPU the
    # full-vocabulary read tile every pass with a read computes. Measured: a 4,096-row pass at the Gemma 3
    # 12B shape took ~0.14 s on the H200 against ~0.58 s for 16,384 rows; Gemma 3 270M on the CPU 0.74 s
    # for 256 rows, 1.11 s for 512, 1.95 s for 1,024 (benchmarks/results, 2026-12-04).
    pass_overhead: int = 256
    # What a pass of each size costs, measured (seconds, one per size: Engine.warmup times each program), in
    # place of the rows-plus-overhead model above. None: the model.
    pass_costs: tuple[float, ...] | None = None
    # The model has recurrent layers (Qwen3.5): passes carry their trees' recurrent chunks (layout), one per
    # `rows_per_chunk` rows at most. Each chunk costs a step of the layers' chunk loop whether it holds rows
    # or not: the seed job's articles take one per ~45 rows, the moderation pack's trees one per ~16.
    recurrent: bool = False
    rows_per_chunk: int = 16
    # Extraction slots a pass of such a model holds: each hands its recurrent layers' states at its slot row
    # to decoding ([slots, heads, key dim, value dim] f32 per layer: 2 MiB a layer at the 4B shape).
    max_slots: int = 32

    def __post_init__(self):
        if any(s % self.block or s % READ_CHUNK for s in self.sizes) or list(self.sizes) != sorted(
            self.sizes
        ):
            raise ValueError(f"bucket sizes must be ascending multiples of the block size and {READ_CHUNK}")
        if self.sizes[0] < MIN_BUCKET:
            raise ValueError(f"the smallest bucket is {MIN_BUCKET} tokens")
        if self.pass_costs is not None and len(self.pass_costs) != len(self.sizes):
            raise ValueError("pass_costs needs one cost per bucket size")

    def with_sizes(self, sizes: tuple[int, ...]) -> "Buckets":
        """These buckets cut to `sizes`, costed by rows again (measured costs belong to the old sizes)."""
        return replace(self, sizes=tuple(sizes), pass_costs=None)

    def measured(self, seconds: list[float]) -> "Buckets":
        """These buckets, packing by the measured seconds of a pass of each size. A larger pass does at least
        a smaller one's work: a size that timed faster than a smaller one (noise) costs what that one did."""
        return replace(self, pass_costs=tuple(float(c) for c in np.maximum.accumulate(seconds)))

    def cost(self, size: int) -> float:
        """What a pass of this size costs: measured seconds, else its rows plus pass_overhead."""
        if self.pass_costs is None:
            return size + self.pass_overhead
        return self.pass_costs[self.sizes.index(size)]

    def check_row_tile(self, tile: int | None) -> None:
        """With row tiles (models.layers.by_rows), every bucket must hold at least two whole tiles: XLA
        inlines a loop that runs once, and inlined code rounds differently from the loop body."""
        if not all(self.holds_row_tiles(s, tile) for s in self.sizes):
            least = f"a multiple of {tile} and at least {2 * tile}"
            raise ValueError(f"rows run in tiles of {tile}: every bucket must be {least}")

    @staticmethod
    def holds_row_tiles(size: int, tile: int | None) -> bool:
        return not tile or (size % tile == 0 and size >= 2 * tile)

    def max_reads(self, size: int) -> int:
        # Each read costs a full-vocabulary log-softmax; typical trees read once per ~20 tokens. Reads run in
        # chunks of READ_CHUNK rows, the same GEMM shape in every bucket, so a row's result never depends on
        # the bucket (XLA's GEMM rows are not invariant across row counts below 128).
        return -(-max(2 * READ_CHUNK, size // self.read_every) // READ_CHUNK) * READ_CHUNK

    def max_targets(self, size: int) -> int:
        return size * self.targets_per_row

    def max_chunks(self, size: int) -> int:
        """Recurrent chunks a pass holds: none without recurrent layers, else one per `rows_per_chunk` rows
        and two at least (the smallest table TreeBatch.chains lays out too)."""
        return max(2, size // self.rows_per_chunk) if self.recurrent else 0

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def aligned(self, tokens: int) -> int:
        return -(-tokens // self.align) * self.align

    def max_exports(self, size: int) -> int:
        """Recurrent states a pass with extraction slots hands to decoding: one per slot."""
        return self.max_slots if self.recurrent else 0

    def fits(self, size: int, tokens: int, reads: int, targets: int, chunks: int = 0, slots: int = 0) -> bool:
        return (
            tokens <= size
            and reads <= self.max_reads(size)
            and targets <= self.max_targets(size)
            and chunks <= self.max_chunks(size)
            and (not self.recurrent or slots <= self.max_exports(size))
        )


@dataclass
class Pass:
    size: int
    tree_ids: list[int]  # which trees, in layout order
    tokens: np.ndarray  # [size]
    positions: np.ndarray  # [size]
    span_end: np.ndarray  # [size]
    trunk_end: np.ndarray  # [size]
    branch_start: np.ndarray  # [size]
    tree_start: np.ndarray  # [size] first row of each row's tree (tree_starts)
    parent: np.ndarray  # [size] each row's parent on its path (-1: none); empty without recurrent layers
    chunks: np.ndarray  # [max_chunks, 4] recurrent chunks (Tree.recurrent_chunks), padded with empty ones
    export_rows: np.ndarray  # [max_exports] each slot's row, in slot order (-1: none); empty without slots
    read_rows: np.ndarray  # [max_reads] rows of the pass (padding reads row 0)
    reads: int  # how many of read_rows are the trees' (the rest is padding)
    target_read: np.ndarray  # [max_targets] index into read_rows
    target_token: np.ndarray  # [max_targets]
    target_offset: list[int]  # per tree: where its targets start in target_read / target_token
    read_offset: list[int]  # per tree: where its reads start in read_rows
    row_offset: list[int]  # per tree: its first row
    media: list[tuple] = field(default_factory=list)  # (first row, soft tokens, ...), Tree.media


def _cost(tree: Tree, buckets: Buckets) -> tuple[int, int, int, int, int]:
    chunks = len(tree.recurrent_chunks()) if buckets.recurrent else 0
    return buckets.aligned(len(tree)), len(tree.read_rows), len(tree.targets), chunks, len(tree.slots)


def content_trees(
    prefix: list[int],
    content_ids: list[int],
    questions: list[QuestionKey],
    buckets: Buckets,
    media: tuple = (),
) -> list[tuple[Tree, int]]:
    """The trees of one content (with its images, build_tree's): usually one; more (each with the trunk) when
    its questions overflow the largest bucket. Returns (tree, index of its first question). Depends on the
    content alone."""
    trunk = buckets.aligned(len(prefix) + len(content_ids))
    trunk_chunks = -(-(len(prefix) + len(content_ids)) // RECURRENT_CHUNK) if buckets.recurrent else 0
    groups, current, tokens, reads, targets, chunks, slots = [], [], 0, 0, 0, trunk_chunks, 0
    for q in questions:
        nodes = len({ids[:j] for ids in q.option_ids for j in range(1, len(ids))})
        q_tokens, q_reads = len(q.template_ids) + nodes, 1 + nodes
        q_targets = sum(len(ids) for ids in q.option_ids)
        q_chunks = question_chunks(q) if buckets.recurrent else 0
        if current and not buckets.fits(
            buckets.largest,
            trunk + buckets.aligned(tokens + q_tokens),
            reads + q_reads,
            targets + q_targets,
            chunks + q_chunks,
            slots + (q.extract is not None),
        ):
            groups.append(current)
            current, tokens, reads, targets, chunks, slots = [], 0, 0, 0, trunk_chunks, 0
        current.append(q)
        tokens, reads, targets = tokens + q_tokens, reads + q_reads, targets + q_targets
        chunks, slots = chunks + q_chunks, slots + (q.extract is not None)
    groups.append(current)
    out, first = [], 0
    for group in groups:
        tree = build_tree(prefix, content_ids, group, media)
        if not buckets.fits(buckets.largest, *_cost(tree, buckets)):
            raise ValueError(
                f"a content with one question needs {len(tree)} tokens; largest bucket is {buckets.largest}"
            )
        out.append((tree, first))
        first += len(group)
    return out


def read_trees(
    token_ids: list[int], reads: dict[int, list[int]], buckets: Buckets, media: tuple = ()
) -> list[Tree]:
    """The trees that read one sequence (with its images, read_tree's) at the rows of `reads`: usually one;
    more (each the whole sequence, reading a run of the rows) when the reads overflow the largest bucket's
    capacities."""
    trees, group, targets = [], {}, 0
    size = buckets.largest
    if buckets.aligned(len(token_ids)) > size:
        raise ValueError(f"a sequence of {len(token_ids)} tokens; largest bucket is {size}")
    for row, tokens in reads.items():
        wanted = len(set(tokens))
        if group and not buckets.fits(size, len(token_ids), len(group) + 1, targets + wanted):
            trees.append(read_tree(token_ids, group, media))
            group, targets = {}, 0
        group[row] = tokens
        targets += wanted
    return [*trees, read_tree(token_ids, group, media)]


def pack(trees: list[Tree], buckets: Buckets) -> list[Pass]:
    """The trees in order, cut into passes where that costs least: a pass costs what its bucket costs
    (`Buckets.cost`: measured seconds, or its rows plus `pass_overhead`), and of two equal ways the one with
    fewer passes wins. Filling each pass to the largest bucket made a batch of four 1,200-token contents one
    16,384-row pass where two of 4,096 rows do. A tree's results do not depend on its pass
    (docs/batch-invariance.md), so this choice is free."""
    return cut(trees, buckets).passes()


@dataclass
class Cuts:
    """pack's search over a list of trees, for every prefix trees[:i] at once: what its cheapest passes
    cost (`cost[i]`, [0] is 0) and where the last of them starts. The server's runner weighs launching part
    of a batch by `cost`, then lays out the part it launches from the same search (`passes`)."""

    trees: list[Tree]
    buckets: Buckets
    tree_costs: list[tuple[int, ...]]  # _cost of each tree
    cost: list[float]
    start_of: list[int]

    def last_seconds(self, end: int) -> float:
        """The measured seconds of the last of trees[:end]'s cheapest passes; 0 where the buckets' passes were
        not measured (their costs are rows then)."""
        if self.buckets.pass_costs is None:
            return 0.0
        return self.cost[end] - self.cost[self.start_of[end]]

    def passes(self, end: int | None = None) -> list[Pass]:
        """The cheapest passes of trees[:end] (all: None), in order."""
        groups, end = [], len(self.trees) if end is None else end
        while end:
            groups.append(range(self.start_of[end], end))
            end = self.start_of[end]
        return [
            _lay_out(list(group), self.trees, _used(group, self.tree_costs), self.buckets)
            for group in reversed(groups)
        ]


def cut(trees: list[Tree], buckets: Buckets) -> Cuts:
    """pack's search (Cuts), not yet laid out."""
    costs = [_cost(tree, buckets) for tree in trees]
    return Cuts(trees, buckets, costs, *_cheapest(costs, buckets))


def _cheapest(costs: list[tuple[int, ...]], buckets: Buckets) -> tuple[list[float], list[int]]:
    """The search over the trees' costs (_cost): the cheapest passes' cost for each prefix, and where the last
    of those passes starts."""
    sizes = buckets.sizes
    best = [0] + [math.inf] * len(costs)  # best[i]: the cheapest passes for trees[:i]
    start_of = [0] * (len(costs) + 1)  # where the last pass of best[i] starts
    for end in range(1, len(costs) + 1):
        tokens = reads = targets = chunks = slots = bucket = 0
        for start in range(end - 1, -1, -1):  # the last pass holds trees[start:end]
            more_tokens, more_reads, more_targets, more_chunks, more_slots = costs[start]
            tokens, reads, targets = tokens + more_tokens, reads + more_reads, targets + more_targets
            chunks, slots = chunks + more_chunks, slots + more_slots
            while bucket < len(sizes) and not buckets.fits(
                sizes[bucket], tokens, reads, targets, chunks, slots
            ):
                bucket += 1  # the pass only grows as it starts earlier: its bucket never shrinks
            if bucket == len(sizes):
                break
            cost = best[start] + buckets.cost(sizes[bucket])
            if cost <= best[end]:  # <=: a longer last pass, so fewer passes, on a tie
                best[end], start_of[end] = cost, start
        if best[end] == math.inf:
            raise ValueError(f"a tree of {tokens} tokens does not fit the largest bucket ({buckets.largest})")
    return best, start_of


def _used(group: range, costs: list[tuple[int, ...]]) -> tuple[int, ...]:
    return tuple(sum(column) for column in zip(*(costs[i] for i in group), strict=True))


def _lay_out(tree_ids: list[int], trees: list[Tree], used: tuple[int, ...], buckets: Buckets) -> Pass:
    size = next(s for s in buckets.sizes if buckets.fits(s, *used))
    tokens = np.zeros(size, np.int32)
    positions = np.zeros(size, np.int32)
    span_end = np.arange(1, size + 1, dtype=np.int32)  # padding sees only itself
    trunk_end = span_end.copy()
    branch_start = span_end.copy()
    parent = np.full(size if buckets.recurrent else 0, -1, np.int32)
    chunks = empty_chunks(buckets.max_chunks(size), size)
    export_rows = np.full(buckets.max_exports(size) if used[4] else 0, -1, np.int32)
    n_chunks = n_exports = 0
    read_rows = np.zeros(buckets.max_reads(size), np.int32)
    target_read = np.zeros(buckets.max_targets(size), np.int32)
    target_token = np.zeros(buckets.max_targets(size), np.int32)
    offset, n_reads, n_targets, target_offset, read_offset, row_offset = 0, 0, 0, [], [], []
    lengths = [len(trees[i]) for i in tree_ids]
    media = []
    for i in tree_ids:
        tree = trees[i]
        n = len(tree)
        tokens[offset : offset + n] = tree.tokens
        positions[offset : offset + n] = tree.positions
        span_end[offset : offset + n] = np.asarray(tree.span_end) + offset
        trunk_end[offset : offset + n] = offset + tree.trunk_tokens
        branch_start[offset : offset + n] = np.asarray(tree.branch_start) + offset
        if buckets.recurrent:
            parents = np.asarray(tree.parent)
            parent[offset : offset + n] = np.where(parents < 0, -1, parents + offset)
            tree_chunks = np.asarray(tree.recurrent_chunks(), np.int32).reshape(-1, 4) + [offset, 0, 0, 0]
            exports = tree_chunks[:, 3] == KEEP_EXPORT  # the slots' templates, in slot order: number them
            tree_chunks[exports, 3] += n_exports + np.arange(exports.sum())
            export_rows[n_exports : n_exports + len(tree.slots)] = [offset + slot.row for slot in tree.slots]
            chunks[n_chunks : n_chunks + len(tree_chunks)] = tree_chunks
            n_chunks, n_exports = n_chunks + len(tree_chunks), n_exports + len(tree.slots)
        read_rows[n_reads : n_reads + len(tree.read_rows)] = np.asarray(tree.read_rows, np.int32) + offset
        if tree.targets:
            reads, toks = zip(*tree.targets, strict=True)
            target_read[n_targets : n_targets + len(reads)] = np.asarray(reads) + n_reads
            target_token[n_targets : n_targets + len(toks)] = toks
        target_offset.append(n_targets)
        read_offset.append(n_reads)
        row_offset.append(offset)
        media += [(offset + row, *rest) for row, *rest in tree.media]
        offset += buckets.aligned(n)
        n_reads += len(tree.read_rows)
        n_targets += len(tree.targets)
    return Pass(
        size,
        tree_ids,
        tokens,
        positions,
        span_end,
        trunk_end,
        branch_start,
        tree_starts(size, list(zip(row_offset, lengths, strict=True)), buckets.align, buckets.block),
        parent,
        chunks,
        export_rows,
        read_rows,
        n_reads,
        target_read,
        target_token,
        target_offset,
        read_offset,
        row_offset,
        media,
    )


def tree_starts(size: int, placed: list[tuple[int, int]], align: int, block: int) -> np.ndarray:
    """[size]: the first row of each row's tree, for trees placed at (first row, rows), in order. Padding
    rows (after a tree up to the next aligned row, and the pass's tail) start where their run does, rounded
    down to `align`, and again at each `block` boundary: they see only themselves, and a query block
    of padding reads one key block for them."""
    start = np.arange(size, dtype=np.int32) // block * block
    end = 0
    for first, rows in [*placed, (size, 0)]:
        start[end:first] = np.maximum(start[end:first], end - end % align)
        start[first : first + rows] = first
        end = first + rows
    return start


def empty_chunks(n: int, rows: int) -> np.ndarray:
    """[n, 4] recurrent chunks that hold no rows (after the pass's last row) and change no state."""
    chunks = np.zeros((n, 4), np.int32)
    chunks[:, 0] = rows
    return chunks

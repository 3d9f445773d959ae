"""The engine: token trees in, log-probabilities (and the answers decoded at extraction slots) out. It packs
trees into bucketed passes, runs one compiled program per bucket, decodes the slots of a pass right after it
from its keys and values, and keeps the floors' cache. Requests and responses are spinf_jax.scoring's
business.

Library use (what the server does too, and what a notebook can call directly):

    engine = Engine.load("spinf/gemma-3-270m", precision="bf16")
    response = engine.score({"messages": [...], "scoring": {"queries": [...]}})
    [scored] = engine.score_trees([build_tree(prefix, content_ids, questions)])  # token level
"""

import logging
import math
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spinf_jax import audio, fingerprint, media
from spinf_jax.answers import Vocabulary, vocabulary
from spinf_jax.builtin_models import DEFAULT_MODEL
from spinf_jax.extraction import CANDIDATES, Decoded, SlotSearch, path_columns
from spinf_jax.layout import (
    MAX_ANSWER_TOKENS,
    MAX_CLOSING_TOKENS,
    MAX_GENERATED_TOKENS,
    SEARCH_WIDTH,
    Extract,
    QuestionKey,
    Tree,
    build_tree,
)
from spinf_jax.loader import Model, load_model
from spinf_jax.models import gemma4_audio
from spinf_jax.models.decoder import split
from spinf_jax.models.layers import DecodeBatch, RecurrentState, TreeBatch, by_rows
from spinf_jax.models.params import nbytes
from spinf_jax.packer import READ_CHUNK, Buckets, Cuts, Pass, cut, pack
from spinf_jax.progress import PROGRESS, Progress, Steps, log

if TYPE_CHECKING:
    from spinf_jax.service import Service

ENGINE_VERSION = "7"  # bump whenever the engine's arithmetic changes (it is part of the fingerprint)
# Passes launched and not yet read back, at most (Engine.launch): the device runs one while the host launches
# the next; each holds its outputs and temporaries on the device, so more would only take memory.
IN_FLIGHT = 2
# Images and audio clips whose soft tokens the engine keeps (Engine.image_tokens, audio_tokens): 2 MiB an
# image at Gemma 3 12B's width in bf16.
MEDIA_CACHE = 256
KINDS = {"text": 0, "number": 1, "amount": 2}  # rows of the masks table; ENDS is its last row
ENDS = 3
# History columns of a decode step: an answer's tokens and its closing text. Fixed per width (one for
# generated slots, SEARCH_WIDTH for searched ones), so a slot's program never depends on its companions.
HISTORY_STEPS = {
    1: MAX_GENERATED_TOKENS + MAX_CLOSING_TOKENS,
    SEARCH_WIDTH: MAX_ANSWER_TOKENS + MAX_CLOSING_TOKENS,
}
# The most a decode step's history may hold (every row's keys and values for each of its HISTORY_STEPS
# columns, and its recurrent layers' states): the step's largest input. At Gemma 3 12B's shape a generated
# row's history is 54 MiB, so the 1,024 rows of a GPU step would need 54 GiB, which left no room on an 80 GB
# H100 beside the weights and the pass's cache (start_time-h100-2026-12-05); at Qwen3.5-4B's a
# row's states alone are 48 MiB. A width's steps take fewer rows where their history would not fit.
HISTORY_BYTES = 20 << 30  # 12B: searched steps keep their 1,024 rows (18 GiB), generated ones take 256


def decode_shapes() -> tuple[int, tuple[int, ...]]:
    """(rows per tile of a decode step's row-local work and attention, the step sizes in rows).

    On the CPU: 8-row tiles and steps of 16, 32 or 64 rows, so that one searched slot stays cheap and three or
    four run in four tiles, not eight (each tile reads every weight: a 64-row step of Gemma 3 270M takes
    0.76 s, a 16-row one 0.28 s); two tiles at least, as a loop that runs once is inlined and rounds
    differently. On GPUs one shape only, 1,024 rows in one tile: each tile reads every weight once and each
    attention loop runs once per layer for all slots of the step (on the H200, 128-row tiles made a step at
    the 12B shape take 330 ms), and with one shape a slot's bits cannot depend on how many slots share its
    step."""
    return (8, (16, 32, 64)) if jax.default_backend() == "cpu" else (1024, (1024,))


def scoring_device() -> jax.Device:
    """The device the passes run on: jax's default device where one is set (a replica of `serve --devices`
    is pinned to its own), else the first."""
    chosen = jax.config.jax_default_device
    return chosen if isinstance(chosen, jax.Device) else jax.devices()[0]


def use_compilation_cache(path) -> None:
    """Keep compiled bucket programs, and XLA's GPU autotuning results with them, on disk. A restart then
    reuses both: it starts sooner, and it cannot autotune its way to different kernels (and other bits)."""
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# The programs are module-level jits with the model's structure (its graphdef) as a static argument: jit's
# cache then keys traces and compiled programs by structure and shapes, so every engine over a model of the
# same structure shares them (a second engine, other buckets, a reload of the model compile nothing new).
# The weights are always an argument, never a constant.


def _targets(decoder, hidden, read_rows, target_read, target_token, row_tile):
    """Every target's logit [max_targets] (a row-wise dot with its read's hidden state; its log-prob once its
    read's normaliser, which _read_chunk computes, is subtracted), and the final hidden state at every read
    row [max_reads, D]."""
    hidden = hidden[read_rows]
    return by_rows(decoder.token_logits, row_tile, hidden[target_read], target_token), hidden


@partial(jax.jit, static_argnames=("graphdef", "row_tile"))
def _score_pass(weights, batch: TreeBatch, reads, *, graphdef, row_tile):
    """One pass: its targets' logits and its reads' hidden states (_targets; reads: the pass's read rows and
    its targets' reads and tokens, Engine._pass_args)."""
    decoder = nnx.merge(graphdef, weights)
    return _targets(decoder, decoder(batch, row_tile), *reads, row_tile)


@partial(jax.jit, static_argnames=("graphdef", "row_tile"))
def _extract_pass(weights, batch: TreeBatch, reads, *, graphdef, row_tile):
    """_score_pass, and the layers' keys and values, which decoding the pass's extraction slots continues
    from (Decoder.forward: [repeats, T, K, D] per stack and position, None for layers that read another's). A
    second program, so that passes without extraction slots keep their outputs small."""
    decoder = nnx.merge(graphdef, weights)
    hidden, kv = decoder.forward(batch, row_tile)
    return (*_targets(decoder, hidden, *reads, row_tile), kv)


@partial(jax.jit, static_argnames=("graphdef",))
def _read_chunk(weights, hidden, chunk, *, graphdef):
    """Reads chunk × READ_CHUNK onwards of a pass (hidden: _targets' [max_reads, D]): each one's log-softmax
    normaliser and most likely next token [READ_CHUNK], from the same full-vocabulary logits.

    A program of its own, launched once per chunk a pass uses (Engine._read_chunks): a pass's reads are as
    many as its trees ask for, and the rest of its read capacity is padding whose full-vocabulary logits would
    be thrown away (at Gemma 3 270M on the CPU, the padding reads of a 256-row pass cost as much as its
    layers). Every chunk is the same GEMM shape in every bucket, so a read's bits depend on nothing else in
    the pass. The host knows the count: in the pass program it was a while loop with a trip count on the
    device, and XLA:GPU copies such a loop's condition to the host every iteration, so launching a pass
    waited for the pass (on the H200, 136 of a 137 ms pass; 69 ms after, the host enqueueing the program)."""
    decoder = nnx.merge(graphdef, weights)
    logits = decoder.logits(jax.lax.dynamic_slice_in_dim(hidden, chunk * READ_CHUNK, READ_CHUNK))
    return jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _choose(decoder, hidden, kind, closing_first, ends, forced, masks, tile):
    """Per row of hidden [N, D]: the CANDIDATES most likely next tokens its slot allows, with their log-probs
    under the full vocabulary ([N, CANDIDATES] each); the log-prob of one forced token [N]; and the log of
    the probability outside its kind's tokens [N] (how a number ends: with anything that is not a number).

    A row allows masks[kind] (its slot's kind), its closing text's first token, and where `ends` is set the
    tokens that end an answer (masks[ENDS])."""
    vocab = jnp.arange(masks.shape[1], dtype=jnp.int32)

    def rows(h, kind, closing_first, ends, forced):
        logits = decoder.logits(h)
        logprobs = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        allowed = masks[kind] | (vocab[None] == closing_first[:, None]) | (ends[:, None] & masks[ENDS][None])
        top_lp, top_tok = jax.lax.top_k(jnp.where(allowed, logprobs, -jnp.inf), CANDIDATES)
        forced_lp = jnp.take_along_axis(logprobs, jnp.maximum(forced, 0)[:, None], axis=1)[:, 0]
        outside = jax.nn.logsumexp(jnp.where(masks[kind], -jnp.inf, logprobs), axis=-1)
        return top_lp, top_tok.astype(jnp.int32), forced_lp, outside

    return by_rows(rows, tile, hidden, kind, closing_first, ends, forced)


@partial(jax.jit, static_argnames=("graphdef", "tile"))
def _first_candidates(weights, hidden, kind, closing_first, ends, masks, *, graphdef, tile):
    """The candidates read at the slot rows of a pass (_choose)."""
    decoder = nnx.merge(graphdef, weights)
    top_lp, top_tok, _, outside = _choose(
        decoder, hidden, kind, closing_first, ends, jnp.zeros_like(kind), masks, tile
    )
    return top_lp, top_tok, outside


@partial(jax.jit, static_argnames=("graphdef", "tile", "block"), donate_argnames=("history",))
def _decode_step(weights, cache, history, masks, batch_arrays, kind, closing_first, ends, forced, *, graphdef,
                 tile, block):  # fmt: skip
    """One decode step over [G × W] rows (layers.DecodeBatch): each row's candidates and forced-token log-prob
    (_choose), and the history with this step's keys and values written at column `step`."""
    decoder = nnx.merge(graphdef, weights)
    tokens, positions, tree_start, trunk_end, branch_start, slot_end, export, path, step = batch_arrays
    g = tree_start.shape[0]
    width = tokens.shape[0] // g
    batch = DecodeBatch(
        tokens, positions, tree_start, trunk_end, branch_start, slot_end, export, path, step, cache, history,
        block=block, group_tile=tile // width,
    )  # fmt: skip
    hidden, kv = decoder.forward(batch, tile)

    def write(column, new):  # [repeats, G, S, W, K, D], [repeats, R, K, D]; a recurrent layer's: replaced
        if isinstance(new, RecurrentState):
            return new
        new = new.reshape(new.shape[0], g, width, *new.shape[2:])
        return jax.lax.dynamic_update_index_in_dim(column, new, step, 2)

    history = jax.tree.map(write, history, kv, is_leaf=lambda x: isinstance(x, RecurrentState))
    return (*_choose(decoder, hidden, kind, closing_first, ends, forced, masks, tile), history)


@dataclass
class Scored:
    """What a pass gave for one tree: its targets' log-probabilities, its reads' most likely tokens, and the
    answers decoded at its extraction slots."""

    tree: Tree
    logprobs: np.ndarray  # [len(tree.targets)] float32
    top_tokens: np.ndarray  # [len(tree.read_rows)] int32: the most likely next token at each read
    answers: list[list[Decoded]] = field(default_factory=list)  # per slot (tree.slots), most likely first
    decode_tokens: int = 0  # tokens fed to decode steps for its slots

    def option_logprobs(self, question: int) -> np.ndarray:
        """Each option's log-prob: the sum of its tokens' (float64, in numpy's order of summation)."""
        return self._option_logprobs[question]

    @cached_property
    def _option_logprobs(self) -> list[np.ndarray]:
        # Every option of the tree in one gather and one sum: a numpy call per option (one to five tokens)
        # was the largest host cost of a request with many options. A short option is padded with reads of
        # an appended 0.0, which leaves its sum's bits as they are.
        options = [option for question in self.tree.options for option in question]
        width = max(map(len, options), default=1)
        padded = np.array([o + [-1] * (width - len(o)) for o in options], np.int64)
        logprobs = np.append(self.logprobs.astype(np.float64), 0.0)
        sums = logprobs[padded.reshape(len(options), width)].sum(axis=1)
        return np.split(sums, np.cumsum([len(q) for q in self.tree.options])[:-1])


def _ready(outputs) -> bool:
    """Whether the device has computed these arrays (without waiting for them)."""
    return all(leaf.is_ready() for leaf in jax.tree.leaves(outputs))


@dataclass
class Launched:
    """Passes started by Engine.launch: the trees, their results so far (those of passes that ran to the end
    in launch), and the passes still on the device with their outputs."""

    trees: list[Tree]
    out: list[Scored | None]
    # Each with its outputs on the device (Engine._launch_pass: targets' logits, and per read chunk its
    # normalisers and top tokens) and the time it was launched.
    running: list[tuple[Pass, tuple, float]] = field(default_factory=list)

    def wait(self, leaving: int = 0) -> None:
        """Until its passes have run, all but the last `leaving` of them. (A copy of the list: a launch queued
        behind this one may read its passes back meanwhile, Engine.launch.)"""
        running = list(self.running)
        jax.block_until_ready([outputs for _, outputs, _ in running[: max(0, len(running) - leaving)]])


def _floor_entry_bytes(key: QuestionKey, floor) -> int:
    """What a floor cache entry holds, near enough: a token id in a tuple takes a pointer and, past 256, an
    int object (8 + 28 bytes); a fixed part per tuple and for the entry. A floor is options' log-probs (an
    array) or an extraction slot's answers (a list of them)."""
    tokens = len(key.template_ids) + sum(len(o) for o in key.option_ids)
    held = floor.nbytes if isinstance(floor, np.ndarray) else sys.getsizeof(floor) + 128 * len(floor)
    return 36 * tokens + 56 * (1 + len(key.option_ids)) + held + 256


class Engine:
    def __init__(
        self,
        model: Model,
        buckets: Buckets | None = None,
        floor_cache_bytes: int = 256 << 20,
    ):
        """floor_cache_bytes: what the floors of recent questions may hold (their keys' tokens and their
        options' log-probs), least recently used dropped first; the largest question a request may ask
        holds about a quarter of a megabyte."""
        self.model = model
        self.buckets = buckets = buckets or Buckets()
        if model.decoder.recurrent and not buckets.recurrent:  # its passes carry recurrent chunks
            self.buckets = buckets = replace(buckets, recurrent=True)
        buckets.check_row_tile(model.row_tile)
        self._configured = buckets  # every size; `buckets` is what passes are packed into (see warmup)
        self.compiling: tuple[int, ...] = ()  # sizes a background warmup has yet to compile
        self.fingerprint_parts = fingerprint.parts(
            scoring_device(),
            {
                "model": model.digest,
                "precision": model.precision.value,
                "block": str(buckets.block),
                "row_tile": str(model.row_tile),
                "engine_version": ENGINE_VERSION,
            },
        )
        self.fingerprint = fingerprint.digest(self.fingerprint_parts)
        self._floor_cache: OrderedDict[QuestionKey, np.ndarray] = OrderedDict()
        self._floor_cache_bytes = floor_cache_bytes
        self.floor_cache_held = 0  # bytes, as _floor_entry_bytes counts them
        self._floor_lock = threading.Lock()  # read on request threads, written by the engine thread
        # (a file's digest, how it is read: an ImageFormat or "audio") → its soft tokens (LRU)
        self._media: OrderedDict[tuple, jax.Array] = OrderedDict()
        self._media_lock = threading.Lock()  # requests are planned on several threads
        self.on_pass = None  # optional callback(bucket size, seconds) after each pass, for metrics
        # Split once: the compiled step is a plain jax.jit over the weights' state, the module structure is
        # static. (Weights changed on model.decoder after this are not seen by this engine.)
        graphdef, self._weights = split(model.decoder)
        self._graphdef = graphdef
        # (bucket size, whether its passes hold images) → its compiled pass
        self._programs: dict[tuple[int, bool], jax.stages.Compiled] = {}
        self._warm: dict[int, float] = {}  # bucket size: seconds of its pass, once warmup has run it
        # (bucket size, whether at the smallest decode size alone) whose extraction programs have run
        self._warm_extraction: set[tuple[int, bool]] = set()
        # Extraction: a pass that also hands back its keys and values, then fixed-shape decode steps of
        # [G × W] rows in buckets of decode_sizes rows (spinf_jax.extraction).
        self.decode_tile, self.decode_sizes = decode_shapes()
        self._extract = partial(_extract_pass, graphdef=graphdef, row_tile=model.row_tile)
        self._read = partial(_read_chunk, graphdef=graphdef)
        self._first = partial(_first_candidates, graphdef=graphdef)
        self._step = partial(_decode_step, graphdef=graphdef, block=self.buckets.block)
        size = model.config.vocab_size
        self.vocabulary = vocabulary(model.tokenizer) if model.tokenizer else Vocabulary.anything(size)
        v = self.vocabulary
        table = np.zeros((4, size), bool)
        for row, allowed in enumerate((v.text, v.number, v.amount, v.newline | v.end)):
            table[row, : len(allowed)] = allowed[:size]
        self._masks = jnp.asarray(table)
        self._ends = table[ENDS]
        self._excluded: dict[tuple[int, ...], frozenset[int]] = {}  # closing ids → tokens barred inside

    @classmethod
    def load(
        cls,
        spec: str = DEFAULT_MODEL,
        precision: str | None = None,
        progress: Progress | None = None,
        row_tile: int | None = None,
        **kwargs,
    ) -> "Engine":
        """precision None: the one a `spinf-jax quantize` folder was written for, else bf16. row_tile: the
        rows of row-local work per tile (None: the backend's, loader.default_row_tile); every bucket must
        hold two."""
        model = load_model(spec, precision, progress)
        return cls(model.with_row_tile(row_tile) if row_tile else model, **kwargs)

    def warmup(
        self, progress: Progress | None = None, extraction: bool = False, background: bool = False
    ) -> threading.Thread | None:
        """Compile every bucket's program now and time a pass of it (the server does this before it reports
        ready); each program is a step of "compile" (progress), with its bucket size and seconds. A bucket
        already warmed is not run again (an app started on an engine that served before starts at once).
        From then on the packer cuts batches by those measured costs (Buckets.measured).

        With background (the server's start), only the smallest and the largest bucket now (and any compiled
        already): every request fits the largest, and a lone small one gets the smallest. The others compile
        on a thread of their own, which this returns (`compiling` lists them meanwhile, progress steps
        "compile_background"), and each joins `buckets` once compiled, at a cost interpolated between the
        measured ones (a pass's time grows with its rows). A size added so makes its first run in a served
        pass. Requests get the same bits either way: only which passes they share changes.

        With extraction, also every program extraction runs: each bucket's pass that returns keys and values,
        and the first candidates and decode steps at every decode size, for searched and generated slots.
        With background too (the server's default), only what a small request's slots run (the smallest
        bucket's, at the smallest decode size of each width: 16 s on the 2-core CPU for the default model,
        against ~50 s a bucket for all of them); the first request that needs any other compiles it. Not on
        the background thread: these programs must run to compile, and a program run there beside the
        served passes aborted the process (XLA on the CPU, 2026-12-07); the device thread is the one that
        runs programs."""
        sizes = self._configured.sizes
        compiled = {size for size, media in self._programs if not media}
        ends = (sizes[0], sizes[-1])
        now = tuple(s for s in sizes if not background or s in ends or s in compiled)
        cold = [size for size in now if size not in self._warm]
        with Steps(progress, "compile", len(cold), "program") as step:
            for size in cold:
                start = time.perf_counter()
                self._warm[size] = timed = self._time_pass(size)
                step(bucket=size, seconds=round(time.perf_counter() - start, 2), pass_seconds=round(timed, 4))
        self.buckets = self._packing(now)
        if extraction:
            self._warm_extraction_programs(progress, sizes[:1] if background else now, first_steps=background)
        self.compiling = tuple(s for s in sizes if s not in now)
        if not self.compiling:
            return None
        thread = threading.Thread(target=self._compile_rest, args=(progress,), name="spinf-compile")
        thread.daemon = True  # a server stopping mid-compile does not wait for it
        thread.start()
        return thread

    def _compile_rest(self, progress: Progress | None) -> None:
        """warmup's background half: compile each size in `compiling`, then pack into it too. A size that
        fails to compile (the device short of memory for autotuning beside the passes served meanwhile) is
        left out, with an error line: the sizes served already hold every request."""
        with Steps(progress, "compile_background", len(self.compiling), "program") as step:
            for size in self.compiling:
                start = time.perf_counter()
                try:
                    self.program(size)
                except Exception as exc:  # noqa: BLE001 - the server serves on without this size
                    log(
                        PROGRESS,
                        "compile_failed",
                        logging.ERROR,
                        bucket=size,
                        error=f"{type(exc).__name__}: {exc}",
                    )
                else:
                    self.buckets = self._packing((*self.buckets.sizes, size))
                finally:
                    self.compiling = tuple(s for s in self.compiling if s != size)
                step(bucket=size, seconds=round(time.perf_counter() - start, 2))

    def _packing(self, sizes: tuple[int, ...]) -> Buckets:
        """The configured buckets cut to `sizes`, each costed by its measured pass time or, where none was
        measured (compiled in the background), by the line between the measured sizes around it."""
        measured = sorted(self._warm.items())
        rows, seconds = [m[0] for m in measured], [m[1] for m in measured]
        sizes = tuple(sorted(set(sizes)))
        costs = [float(np.interp(size, rows, seconds)) for size in sizes]
        return self._configured.with_sizes(sizes).measured(costs)

    def _warm_extraction_programs(
        self, progress: Progress | None, sizes: tuple[int, ...], first_steps: bool = False
    ) -> None:
        """warmup's extraction half, for these bucket sizes: every decode size, or the smallest alone."""
        done = self._warm_extraction
        cold = [size for size in sizes if (size, False) not in done and (size, first_steps) not in done]
        with Steps(progress, "compile_extraction", len(cold), "bucket") as step:
            for size in cold:
                start = time.perf_counter()
                for tree in self._extraction_warmup_trees(first_steps):
                    [p] = pack([tree], self._bucket(size))
                    self._extract_and_decode(p, Launched([tree], [None]))
                done.add((size, first_steps))
                step(bucket=size, seconds=round(time.perf_counter() - start, 2))

    def _extraction_warmup_trees(self, first_steps: bool = False) -> list[Tree]:
        """One tree per decode size (the smallest alone, with first_steps), on empty content: enough
        two-token slots of each width (searched and generated) that their rows need that size, so decoding
        them compiles its programs. Where a pass holds fewer slots than that (a recurrent model's:
        Buckets.max_slots), no request decodes that many rows of that width at once, and the tree leaves
        them out."""
        trees, most = [], self.buckets.max_exports(self.buckets.largest) or math.inf
        searched_sizes, generated_sizes = self.step_sizes(SEARCH_WIDTH), self.step_sizes(1)
        for i in range(1 if first_steps else max(len(searched_sizes), len(generated_sizes))):
            # the fewest rows that take each width's i-th size (none where that width has fewer sizes)
            rows = [(0, *s)[i] + 1 if i < len(s) else 0 for s in (searched_sizes, generated_sizes)]
            searched, generated = -(-rows[0] // SEARCH_WIDTH), rows[1]
            counts = {False: searched, True: generated if searched + generated <= most else 0}
            questions = [
                QuestionKey((0,), extract=Extract(max_answers=1, max_tokens=2, generate=generate))
                for generate, count in counts.items()
                for _ in range(count)
            ]
            trees.append(build_tree([0], [], questions))
        return trees

    def step_sizes(self, width: int) -> tuple[int, ...]:
        """Rows of the decode steps of slots of this width: the sizes of decode_sizes whose history fits
        HISTORY_BYTES, else the smallest halved until it does (at least one slot). Fixed per model and width,
        so a slot's step never depends on its companions."""
        column, state = self._history_row_bytes
        row = column * HISTORY_STEPS[width] + state
        fits = tuple(size for size in self.decode_sizes if size * row <= HISTORY_BYTES)
        if fits:
            return fits
        size = self.decode_sizes[0]
        while size > width and size * row > HISTORY_BYTES:
            size //= 2
        return (size,)

    @cached_property
    def _history_row_bytes(self) -> tuple[int, int]:
        """Bytes one row of a decode step holds in its history: per column, every attention layer's keys and
        values for one token; once, every recurrent layer's state. From the pass's cache ([repeats, T, K, D]
        per stack, a recurrent one's [repeats, slots, ...]) of a pass with one slot, traced, not run."""
        tree = build_tree([0], [], [QuestionKey((0,), extract=Extract(max_answers=1, max_tokens=2))])
        [p] = pack([tree], self.buckets)
        *_, cache = jax.eval_shape(self._extract, *self._pass_args(p))
        leaves = jax.tree.leaves(cache, is_leaf=lambda a: isinstance(a, RecurrentState))
        states = [leaf for a in leaves if isinstance(a, RecurrentState) for leaf in jax.tree.leaves(a)]
        kv = [a for a in leaves if not isinstance(a, RecurrentState)]
        return tuple(sum(a.size // a.shape[1] * a.dtype.itemsize for a in part) for part in (kv, states))

    def _time_pass(self, size: int) -> float:
        """Seconds a pass of this size takes, its program compiled first: the pass itself, without its read
        chunks (their count follows the reads a pass holds, not its size). On GPUs a short first run is run
        again: a program's first run there also loads its kernels onto the device."""
        p = self._empty_pass(size)
        args, program = self._pass_args(p), self.program(size)

        def run() -> tuple[float, tuple]:
            start = time.perf_counter()
            outputs = jax.block_until_ready(program(*args))
            return time.perf_counter() - start, outputs

        seconds, (picked, hidden) = run()
        if seconds < 1.0 and jax.default_backend() != "cpu":
            seconds = min(seconds, run()[0])
        self._results(p, picked, self._read_chunks(p, hidden))  # compiles the read chunk's program
        return seconds

    def program(self, size: int, args: tuple | None = None) -> jax.stages.Compiled:
        """One bucket's compiled program, compiled on first use (warmup compiles them all). A pass with images
        (its `args`, _pass_args') has a program of its own, compiled when the first such pass comes."""
        key = (size, args is not None and args[1].media is not None)
        if key not in self._programs:
            lowered = self.lowered(size) if not key[1] else _score_pass.lower(*args, **self._static)
            self._programs[key] = lowered.compile()
        return self._programs[key]

    @property
    def _static(self) -> dict:
        return {"graphdef": self._graphdef, "row_tile": self.model.row_tile}

    def image_tokens(
        self, digest: str, data: bytes, param: str, fmt: media.ImageFormat | None = None
    ) -> jax.Array:
        """An image's soft tokens [n, hidden] on the device (n: ImageFormat.soft_count), from its file
        (`digest`: media.digest of `data`; `param`: its field, for errors): decoded, preprocessed and read by
        the tower once per file and format while it stays among the MEDIA_CACHE most recent. `fmt`: the
        model's image format unless given (a video's frames: its frames()). Raises media.MediaError."""
        fmt = fmt or self.model.image_format

        def read() -> jax.Array:
            image = media.open_image(data, param)
            return self.model.soft_tokens(*fmt.tower_inputs(image, param))[
                : fmt.soft_count(image.size, param)
            ]

        return self._cached((digest, fmt), read)

    def audio_tokens(self, digest: str, samples: np.ndarray) -> jax.Array:
        """A clip's soft tokens [n, hidden] on the device (n: audio.soft_token_count) from its samples at the
        feature extractor's rate (`digest`: what identifies the clip, its file's): its features and the tower
        once per clip while it stays among the MEDIA_CACHE most recent media."""
        cfg = self.model.audio_format.features

        def read() -> jax.Array:
            soft = self.model.audio_soft_tokens(*gemma4_audio.pad_frames(*audio.features(samples, cfg)))
            return soft[: audio.soft_token_count(len(samples), cfg)]

        return self._cached((digest, "audio"), read)

    def _cached(self, key: tuple, read) -> jax.Array:
        """The soft tokens under `key` in the media cache, or read() kept there (the oldest dropped past
        MEDIA_CACHE). The lock is not held while read() runs: two threads may read one file at once, and
        both get the same bits."""
        with self._media_lock:
            if key in self._media:
                self._media.move_to_end(key)
                return self._media[key]
        soft = read()
        with self._media_lock:
            self._media[key] = soft
            while len(self._media) > MEDIA_CACHE:
                self._media.popitem(last=False)
        return soft

    def device_bytes_needed(self) -> int:
        """Device memory the largest passes need at their peak, by XLA's buffer assignment: the weights, and
        IN_FLIGHT times a pass's inputs, temporaries and outputs (compiles every bucket not compiled yet),
        and the f32 logits of one read chunk (_read_chunk runs one at a time; its other buffers are small)."""
        weights = nbytes(self.model.decoder)
        read_chunk = READ_CHUNK * self.model.config.vocab_size * 4
        largest_pass = max(
            m.argument_size_in_bytes
            + m.temp_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
            - weights
            for m in (self.program(size).memory_analysis() for size in self.buckets.sizes)
        )
        return weights + read_chunk + IN_FLIGHT * largest_pass

    def _bucket(self, size: int) -> Buckets:
        return self._configured.with_sizes(tuple(s for s in self._configured.sizes if s >= size))

    def _pass_args(self, p: Pass) -> tuple:
        arrays = (p.tokens, p.positions, p.span_end, p.trunk_end, p.branch_start, p.tree_start)
        recurrent = (p.parent, p.chunks, p.export_rows)
        batch = TreeBatch(*map(jnp.asarray, arrays), *map(jnp.asarray, recurrent), self.buckets.block)
        if p.media:  # as many media rows as the pass has rows: one program per bucket
            batch = batch.with_media(p.media, capacity=p.size)
        return self._weights, batch, (p.read_rows, p.target_read, p.target_token)

    def _launch_pass(self, p: Pass) -> tuple:
        """Launch a pass's program and its read chunks without waiting for them: (its targets' logits,
        [(normalisers, top tokens)] per chunk) on the device (_results reads them back)."""
        args = self._pass_args(p)
        picked, hidden = self.program(p.size, args)(*args)
        return picked, self._read_chunks(p, hidden)

    def _read_chunks(self, p: Pass, hidden: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
        """The chunks of reads the pass uses, launched (_read_chunk); one at least, so that every warm-up
        compiles the program."""
        chunks = max(1, -(-p.reads // READ_CHUNK))
        return [self._read(self._weights, hidden, np.int32(i)) for i in range(chunks)]

    @staticmethod
    def _results(p: Pass, picked: jax.Array, chunks: list) -> tuple[np.ndarray, np.ndarray]:
        """A pass's targets' log-probs [max_targets] and its reads' most likely tokens [max_reads] (0 where a
        read is padding), on the host."""
        norm = np.zeros(len(p.read_rows), np.float32)
        top = np.zeros(len(p.read_rows), np.int32)
        for i, (chunk_norm, chunk_top) in enumerate(chunks):
            rows = slice(i * READ_CHUNK, (i + 1) * READ_CHUNK)
            norm[rows], top[rows] = np.asarray(chunk_norm), np.asarray(chunk_top)
        # The target logit comes from a row-wise dot, the normaliser from the GEMM: they can disagree in the
        # last bits, so a certain token could come out at +1e-7. Clamp to a probability. (float32, as on the
        # device: one rounding, the same bits wherever it runs.)
        return np.minimum(np.asarray(picked) - norm[p.target_read], np.float32(0)), top

    def _run_pass(self, p: Pass) -> tuple[np.ndarray, np.ndarray]:
        return self._results(p, *self._launch_pass(p))

    def lowered(self, size: int) -> jax.stages.Lowered:
        """One bucket's program, lowered, for inspection (`.compile().memory_analysis()`, `.as_text()`)."""
        args = self._pass_args(self._empty_pass(size))
        return _score_pass.lower(*args, **self._static)

    def _empty_pass(self, size: int) -> Pass:
        return pack([build_tree([0], [], [])], self._bucket(size))[0]

    def score_trees(self, trees: list[Tree]) -> list[Scored]:
        """Pack trees into passes, run them, and hand back each tree's target log-probs and top tokens, and
        the answers at its extraction slots (decoded right after their pass, from its keys and values)."""
        return self.collect(self.launch(trees))

    def cut(self, trees: list[Tree]) -> Cuts:
        """How launch would pack these trees and every prefix of them (packer.Cuts: each prefix's seconds)."""
        return cut(trees, self.buckets)

    def launch(self, trees: list[Tree], cuts: Cuts | None = None, behind: Launched | None = None) -> Launched:
        """score_trees in two halves. This one packs the trees and starts their passes on the device without
        waiting for them (JAX dispatches asynchronously), so the caller can prepare the next batch while
        they run; collect waits for their results. Passes with extraction slots run here to the end: their
        decode steps need each step's candidates on the host. `cuts`: `cut` of these trees, or of a list
        they begin (the server's runner has cut its whole batch), so the search is not run again.
        `behind`: a launch whose passes may still be on the device; they count towards IN_FLIGHT, so this
        one can be queued behind its last pass and the device goes from one to the next without waiting
        for the host. Whoever launched it reads it back."""
        launched = Launched(trees, [None] * len(trees))
        for p in (cuts or self.cut(trees)).passes(len(trees)):
            start = time.perf_counter()
            if not any(trees[t].slots for t in p.tree_ids):
                self._make_room(launched, behind)
                launched.running.append((p, self._launch_pass(p), start))
                continue
            self._extract_and_decode(p, launched)
            self._ran(p, start)
        return launched

    def collect(self, launched: Launched) -> list[Scored]:
        """Every tree's results once the passes `launch` started have run."""
        while launched.running:
            self._collect_oldest(launched)
        return launched.out

    def _make_room(self, launched: Launched, behind: Launched | None) -> None:
        """Until fewer than IN_FLIGHT passes are on the device: the oldest of `behind` are waited for, then
        this launch's own are read back."""
        while True:
            running = [o for _, o, _ in list(behind.running) if not _ready(o)] if behind else []
            if len(running) + len(launched.running) < IN_FLIGHT:
                return
            if running:
                jax.block_until_ready(running[0])
            else:
                self._collect_oldest(launched)

    def _collect_oldest(self, launched: Launched) -> None:
        p, outputs, start = launched.running.pop(0)
        self._scored(p, launched, *self._results(p, *outputs))
        self._ran(p, start)

    def _scored(self, p: Pass, launched: Launched, logprobs: np.ndarray, top: np.ndarray) -> None:
        for tree_id, targets, reads in zip(p.tree_ids, p.target_offset, p.read_offset, strict=True):
            tree = launched.trees[tree_id]
            launched.out[tree_id] = Scored(
                tree,
                logprobs[targets : targets + len(tree.targets)],
                top[reads : reads + len(tree.read_rows)],
            )

    def _ran(self, p: Pass, start: float) -> None:
        if self.on_pass:  # from its launch to its results (with passes queued before it, their time too)
            self.on_pass(p.size, time.perf_counter() - start)

    # -----------------------------------------------------------------------------------------------------
    # Extraction

    def _extract_and_decode(self, p: Pass, launched: Launched) -> None:
        """A pass with extraction slots, to the end: the pass that also returns keys and values, then its
        slots' decode steps."""
        slots = [(t, slot) for t in p.tree_ids for slot in launched.trees[t].slots]
        picked, hidden, cache = self._extract(*self._pass_args(p))
        self._scored(p, launched, *self._results(p, picked, self._read_chunks(p, hidden)))
        self._decode(p, launched.trees, launched.out, slots, hidden, cache)

    def _search(self, slot) -> SlotSearch:
        closing, tokenizer = slot.extract.closing_ids, self.model.tokenizer
        if not closing or tokenizer is None:
            return SlotSearch(slot.extract, self._ends)
        if closing not in self._excluded:  # a scan of the whole vocabulary: once per closing text
            held = self.vocabulary.containing(tokenizer.decode(list(closing)))
            self._excluded[closing] = frozenset(held) - {closing[0]}
        return SlotSearch(slot.extract, self._ends, self._excluded[closing])

    def _decode(self, p: Pass, trees, out, slots, hidden, cache) -> None:
        """Decode every extraction slot of a pass: candidates at the slot rows, then decode steps until each
        slot's search is done. Slots decode in groups of one width (search or generate)."""
        searches = [self._search(slot) for _, slot in slots]
        offsets = dict(zip(p.tree_ids, p.row_offset, strict=True))
        reads = dict(zip(p.tree_ids, p.read_offset, strict=True))
        for width in sorted({slot.extract.width for _, slot in slots}):
            chosen = [i for i, (_, slot) in enumerate(slots) if slot.extract.width == width]
            most = self.step_sizes(width)[-1] // width
            for k in range(0, len(chosen), most):
                group = [(slots[i], searches[i]) for i in chosen[k : k + most]]
                rows = [reads[t] + slot.read for (t, slot), _ in group]
                self._start([s for _, s in group], hidden, rows, width)
                # The pass numbered its slots in this order (packer: recurrent states it hands over).
                places = [
                    (*self._place(trees[t], slot, offsets[t]), i)
                    for i, ((t, slot), _) in zip(chosen[k : k + most], group, strict=True)
                ]
                self._run_searches([s for _, s in group], places, cache, width)
        for (t, _), search in zip(slots, searches, strict=True):
            out[t].answers.append(search.answers())
            out[t].decode_tokens += search.fed

    def _rows(self, n: int, width: int) -> int:
        """Rows of a decode program over n rows of slots of this width: the smallest step size that holds
        them."""
        return next(size for size in self.step_sizes(width) if size >= n)

    def _start(self, searches: list[SlotSearch], hidden, rows: list[int], width: int) -> None:
        """Start each search from the candidates read at its slot row (hidden: the pass's read rows)."""
        n = self._rows(len(rows), width)
        pick = np.zeros(n, np.int32)
        pick[: len(rows)] = rows
        kind, closing_first, ends = self._row_rules([s.extract for s in searches], n)
        first = self._first(
            self._weights, hidden[pick], kind, closing_first, ends, self._masks, tile=min(self.decode_tile, n)
        )
        for search, *candidates in zip(searches, *map(np.asarray, first)):  # noqa: B905 - padded rows
            search.start(*candidates)

    @staticmethod
    def _row_rules(extracts, n: int, width: int = 1):
        """Per row: its slot's kind, closing text's first token (-1: none), and whether end tokens end it."""
        kind, closing_first, ends = np.zeros(n, np.int32), np.full(n, -1, np.int32), np.zeros(n, bool)
        for i, e in enumerate(extracts):
            rows = slice(i * width, (i + 1) * width)
            kind[rows] = KINDS[e.kind]
            closing_first[rows] = e.closing_ids[0] if e.closing_ids else -1
            ends[rows] = not e.closing_ids and e.kind == "text"  # numbers end with any other token
        return kind, closing_first, ends

    @staticmethod
    def _place(tree: Tree, slot, offset: int) -> tuple[int, int, int, int, int]:
        """A slot's rows in its pass: tree start, trunk end, template start and end, and the position of
        the first decoded token (then _decode adds the slot's index among the pass's)."""
        return (
            offset,
            offset + tree.trunk_tokens,
            offset + slot.branch_start,
            offset + slot.row + 1,
            tree.positions[slot.row] + 1,
        )

    def _run_searches(self, searches: list[SlotSearch], places, cache, width: int) -> None:
        """Decode steps over one group of slots of one width until every search is done."""
        n = self._rows(len(searches) * width, width)
        g, steps = n // width, HISTORY_STEPS[width]

        # [repeats, T, K, D] keys or values of the pass → [repeats, G, S, W, K, D] of the steps; a recurrent
        # layer's states at the pass's slots [repeats, X, ...] → per hypothesis [repeats, G, W, ...]
        def steps_of(a):
            if isinstance(a, RecurrentState):
                return jax.tree.map(lambda b: jnp.zeros((len(b), g, width, *b.shape[2:]), b.dtype), a)
            return jnp.zeros((len(a), g, steps, width, *a.shape[2:]), a.dtype)

        history = jax.tree.map(steps_of, cache, is_leaf=lambda a: isinstance(a, RecurrentState))
        groups = np.zeros((5, g), np.int32)
        groups[:, : len(places)] = np.array([(*p[:4], p[5]) for p in places]).T
        kind, closing_first, ends = self._row_rules([s.extract for s in searches], n, width)
        for step in range(steps):
            live = [i for i, s in enumerate(searches) if not s.done]
            if not live:
                return
            tokens, positions = np.zeros(n, np.int32), np.zeros(n, np.int32)
            path, forced = np.zeros((g, width, steps), np.int32), np.full(n, -1, np.int32)
            for i in live:
                for w, (token, columns, forced_token) in enumerate(searches[i].feeds()):
                    r = i * width + w
                    tokens[r], positions[r], forced[r] = token, places[i][4] + step, forced_token
                    path[i, w] = path_columns(columns, w, steps)
            # A finished slot's group reads nothing more (its rows ride along unread; on GPUs the kernel
            # skips a group whose tree is empty).
            finished = np.ones(g, bool)
            finished[live] = False
            batch = (tokens, positions, *np.where(finished, 0, groups), path, np.int32(step))
            *read, history = self._step(
                self._weights, cache, history, self._masks, batch, kind, closing_first, ends, forced,
                tile=min(self.decode_tile, n),
            )  # fmt: skip
            lp, tok, forced_lp, outside = map(np.asarray, read)
            for i in live:
                rows = slice(i * width, i * width + len(searches[i].live))
                searches[i].advance(lp[rows], tok[rows], forced_lp[rows], outside[rows])

    def score(self, body: dict) -> dict:
        """A scoring request (SPEC section 1) → the scoring response (section 2), through `service`: the
        same path the server takes (spinf_jax.scoring)."""
        return self.service.score(body)

    def decide(self, body: dict) -> dict:
        """A decision (SPEC section 5: {id, state, question, options, orderings?}) → its result, or a shared
        request ({state, decisions: [...]}) → every decision's, through `service` (spinf_jax.decisions)."""
        return self.service.decide(body)

    @cached_property
    def service(self) -> "Service":
        """This engine's Service with the default limits, the official prompt packs and no workloads, built
        on first use (`Service.over(engine, packs=..., calibration=...)` builds others)."""
        from spinf_jax.service import Service  # it builds on this module

        return Service.over(self)

    def cached_floors(self, keys) -> dict[QuestionKey, np.ndarray]:
        """The floors (option log-probs on empty content) of those questions that are cached."""
        with self._floor_lock:
            return {k: self._floor_cache[k] for k in keys if k in self._floor_cache}

    def remember_floor(self, key: QuestionKey, logprobs) -> None:
        size = _floor_entry_bytes(key, logprobs)
        if size > self._floor_cache_bytes:
            return
        with self._floor_lock:
            if key in self._floor_cache:
                self.floor_cache_held -= _floor_entry_bytes(key, self._floor_cache[key])
            self._floor_cache[key] = logprobs
            self._floor_cache.move_to_end(key)
            self.floor_cache_held += size
            while self.floor_cache_held > self._floor_cache_bytes:
                old_key, old = self._floor_cache.popitem(last=False)
                self.floor_cache_held -= _floor_entry_bytes(old_key, old)

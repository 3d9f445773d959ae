"""The engine: token trees in, log-probabilities out. It packs trees into bucketed passes, runs one compiled
program per bucket, and keeps the floors' cache. Requests and responses are spinf_jax.scoring's business.

Library use (what the server does too, and what a notebook can call directly):

    engine = Engine.load("spinf/gemma-3-270m", precision="bf16")
    response = engine.score({"messages": [...], "scoring": {"queries": [...]}})
    [scored] = engine.score_trees([build_tree(prefix, content_ids, questions)])  # token level
"""

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spinf_jax.layout import QuestionKey, Tree, build_tree
from spinf_jax.loader import DEFAULT_MODEL, Model, load_model
from spinf_jax.models.decoder import split
from spinf_jax.models.layers import TreeBatch, by_rows
from spinf_jax.packer import READ_CHUNK, Buckets, Pass, pack
from spinf_jax.scoring import Scorer

ENGINE_VERSION = "2"  # bump whenever the engine's arithmetic changes (it is part of the fingerprint)


def use_compilation_cache(path) -> None:
    """Keep compiled bucket programs, and XLA's GPU autotuning results with them, on disk. A restart then
    reuses both: it starts sooner, and it cannot autotune its way to different kernels (and other bits)."""
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _score_pass(weights, batch: TreeBatch, read_rows, target_read, target_token, *, graphdef, row_tile):
    """One pass: every target's log-prob [max_targets], and the most likely next token at each read row
    [max_reads] (from the same full-vocabulary logits as the log-softmax normalisers)."""
    decoder = nnx.merge(graphdef, weights)
    hidden = decoder(batch, row_tile)[read_rows]  # [R, D]
    chunks = hidden.reshape(-1, READ_CHUNK, hidden.shape[-1])

    def read(h):  # [READ_CHUNK, D] → normaliser and argmax per row
        logits = decoder.logits(h)
        return jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1).astype(jnp.int32)

    norm, top = (x.reshape(-1) for x in jax.lax.map(read, chunks))
    picked = by_rows(decoder.token_logits, row_tile, hidden[target_read], target_token)
    # The target logit comes from a row-wise dot, the normaliser from the GEMM: they can disagree in the
    # last bits, so a certain token could come out at +1e-7. Clamp to a probability.
    return jnp.minimum(picked - norm[target_read], 0.0), top


@dataclass
class Scored:
    """What a pass gave for one tree: its targets' log-probabilities and its reads' most likely tokens."""

    tree: Tree
    logprobs: np.ndarray  # [len(tree.targets)] float32
    top_tokens: np.ndarray  # [len(tree.read_rows)] int32: the most likely next token at each read

    def option_logprobs(self, question: int) -> np.ndarray:
        return np.array(
            [float(np.sum(self.logprobs[idx], dtype=np.float64)) for idx in self.tree.options[question]]
        )


class Engine:
    def __init__(
        self,
        model: Model,
        buckets: Buckets | None = None,
        floor_cache: int = 65536,
    ):
        self.model = model
        self.buckets = buckets = buckets or Buckets()
        buckets.check_row_tile(model.row_tile)
        self.fingerprint = (
            "fp_"
            + hashlib.sha256(
                "|".join(
                    [
                        model.digest,
                        model.precision.value,
                        f"block={buckets.block}",
                        f"row_tile={model.row_tile}",
                        ENGINE_VERSION,
                        jax.__version__,
                        jax.default_backend(),
                        jax.devices()[0].device_kind,  # another GPU model may compile other kernels
                    ]
                ).encode()
            ).hexdigest()[:16]
        )
        self._floor_cache: OrderedDict[QuestionKey, np.ndarray] = OrderedDict()
        self._floor_cache_size = floor_cache
        self._floor_lock = threading.Lock()  # read on request threads, written by the engine thread
        self.on_pass = None  # optional callback(bucket size, seconds) after each pass, for metrics
        # Split once: the compiled step is a plain jax.jit over the weights' state, the module structure is
        # static. (Weights changed on model.decoder after this are not seen by this engine.)
        graphdef, self._weights = split(model.decoder)
        self._run = jax.jit(partial(_score_pass, graphdef=graphdef, row_tile=model.row_tile))
        self._programs: dict[int, jax.stages.Compiled] = {}  # bucket size → its compiled pass

    @classmethod
    def load(cls, spec: str = DEFAULT_MODEL, precision: str = "bf16", **kwargs) -> "Engine":
        return cls(load_model(spec, precision), **kwargs)

    def warmup(self) -> None:
        """Compile every bucket's program now and run it once (the server does this before it reports
        ready)."""
        for size in self.buckets.sizes:
            self._run_pass(self._empty_pass(size))

    def program(self, size: int) -> jax.stages.Compiled:
        """One bucket's compiled program, compiled on first use (warmup compiles them all)."""
        if size not in self._programs:
            self._programs[size] = self.lowered(size).compile()
        return self._programs[size]

    def device_bytes_needed(self) -> int:
        """Device memory the largest pass needs at its peak, by XLA's buffer assignment: the weights and the
        pass's inputs, its temporaries and its outputs (compiles every bucket not compiled yet)."""
        return max(
            m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            for m in (self.program(size).memory_analysis() for size in self.buckets.sizes)
        )

    def _bucket(self, size: int) -> Buckets:
        return Buckets(tuple(s for s in self.buckets.sizes if s >= size), self.buckets.block)

    def _pass_args(self, p: Pass) -> tuple:
        arrays = (p.tokens, p.positions, p.span_end, p.trunk_end, p.branch_start, p.tree_start_block)
        batch = TreeBatch(*map(jnp.asarray, arrays))
        return self._weights, batch, p.read_rows, p.target_read, p.target_token

    def _run_pass(self, p: Pass) -> tuple[np.ndarray, np.ndarray]:
        return tuple(map(np.asarray, self.program(p.size)(*self._pass_args(p))))

    def lowered(self, size: int) -> jax.stages.Lowered:
        """One bucket's program, lowered, for inspection (`.compile().memory_analysis()`, `.as_text()`)."""
        return self._run.lower(*self._pass_args(self._empty_pass(size)))

    def _empty_pass(self, size: int) -> Pass:
        return pack([build_tree([0], [], [])], self._bucket(size))[0]

    def score_trees(self, trees: list[Tree]) -> list[Scored]:
        """Pack trees into passes, run them, and hand back each tree's target log-probs and top tokens."""
        out: list[Scored | None] = [None] * len(trees)
        for p in pack(trees, self.buckets):
            start = time.perf_counter()
            logprobs, top = self._run_pass(p)
            if self.on_pass:
                self.on_pass(p.size, time.perf_counter() - start)
            for tree_id, targets, reads in zip(p.tree_ids, p.target_offset, p.read_offset, strict=True):
                tree = trees[tree_id]
                out[tree_id] = Scored(
                    tree,
                    logprobs[targets : targets + len(tree.targets)],
                    top[reads : reads + len(tree.read_rows)],
                )
        return out

    def score(self, body: dict) -> dict:
        """A scoring request (SPEC section 1) → the scoring response (section 2): the library's entry point,
        the same path the server takes (spinf_jax.scoring), with the default limits."""
        return Scorer(self).score(body)

    def cached_floors(self, keys) -> dict[QuestionKey, np.ndarray]:
        """The floors (option log-probs on empty content) of those questions that are cached."""
        with self._floor_lock:
            return {k: self._floor_cache[k] for k in keys if k in self._floor_cache}

    def remember_floor(self, key: QuestionKey, logprobs: np.ndarray) -> None:
        with self._floor_lock:
            self._floor_cache[key] = logprobs
            self._floor_cache.move_to_end(key)
            while len(self._floor_cache) > self._floor_cache_size:
                self._floor_cache.popitem(last=False)

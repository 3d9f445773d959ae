"""The scoring engine: compile a request into token trees, pack them into bucketed passes, run one compiled
program per bucket, and turn log-probabilities into the API's scores.

Library use (what the server calls, and what a notebook can call directly):

    engine = Engine.load("spinf/gemma-3-270m", precision="bf16")
    response = engine.score({"messages": [...], "scoring": {"queries": [...]}})
"""

import hashlib
import math
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from spinf_jax.compiler import CompiledRequest, Limits, ScoringError, compile_request
from spinf_jax.layout import QuestionKey, Tree, build_tree
from spinf_jax.loader import DEFAULT_MODEL, Model, load_model
from spinf_jax.models.layers import TreeBatch, by_rows
from spinf_jax.packer import READ_CHUNK, Buckets, Pass, content_trees, pack

ENGINE_VERSION = "2"  # bump whenever the engine's arithmetic changes (it is part of the fingerprint)
LOW_OPTION_MASS = 0.05


def use_compilation_cache(path) -> None:
    """Keep compiled bucket programs, and XLA's GPU autotuning results with them, on disk. A restart then
    reuses both: it starts sooner, and it cannot autotune its way to different kernels (and other bits)."""
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _score_pass(params, batch: TreeBatch, read_rows, target_read, target_token, *, model: Model):
    """One pass: hidden states, log-softmax normalisers at the read rows, and every target's log-prob."""
    family, cfg = model.family, model.config
    hidden = family.forward(params, batch, cfg, model.precision, model.row_tile)[read_rows]  # [R, D]
    chunks = hidden.reshape(-1, READ_CHUNK, hidden.shape[-1])
    norm = jax.lax.map(lambda h: jax.nn.logsumexp(family.logits(params, h, cfg), axis=-1), chunks).reshape(-1)
    picked = by_rows(
        lambda h, t: family.token_logits(params, h, t, cfg), model.row_tile, hidden[target_read], target_token
    )
    # The target logit comes from a row-wise dot, the normaliser from the GEMM: they can disagree in the
    # last bits, so a certain token could come out at +1e-7. Clamp to a probability.
    return jnp.minimum(picked - norm[target_read], 0.0)


@dataclass
class Scored:
    """Log-probabilities of one tree's targets."""

    tree: Tree
    logprobs: np.ndarray  # [len(tree.targets)] float32

    def option_logprobs(self, question: int) -> np.ndarray:
        return np.array(
            [float(np.sum(self.logprobs[idx], dtype=np.float64)) for idx in self.tree.options[question]]
        )


@dataclass
class Plan:
    """A compiled request and the trees it needs scored."""

    request: CompiledRequest
    trees: list[Tree]  # the contents' trees, then one floor tree per floor not cached
    owners: list[int]  # for each content tree, the index of its content
    floor_keys: list[QuestionKey]  # for each floor tree, its question
    floors: dict[QuestionKey, np.ndarray]  # floors found in the cache


class Engine:
    def __init__(
        self,
        model: Model,
        buckets: Buckets | None = None,
        limits: Limits | None = None,
        floor_cache: int = 65536,
    ):
        self.model = model
        self.buckets = buckets = buckets or Buckets()
        tile = model.row_tile
        if tile and any(s % tile or s < 2 * tile for s in buckets.sizes):
            # XLA inlines a loop that runs once, and inlined code rounds differently from the loop body.
            raise ValueError(
                f"with {tile}-row tiles every bucket must be a multiple of {tile} and at least {2 * tile}"
            )
        self.limits = limits or Limits()
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
        self._floor_lock = threading.Lock()  # plans are made on request threads, floors stored by the runner
        self.on_pass = None  # optional callback(bucket size, seconds) after each pass, for metrics
        self._run = jax.jit(partial(_score_pass, model=model))

    @classmethod
    def load(cls, spec: str = DEFAULT_MODEL, precision: str = "bf16", **kwargs) -> "Engine":
        return cls(load_model(spec, precision), **kwargs)

    def warmup(self) -> None:
        """Compile every bucket's program now (the server does this before it reports ready)."""
        for size in self.buckets.sizes:
            self._run_pass(self._empty_pass(size))

    def _bucket(self, size: int) -> Buckets:
        return Buckets(tuple(s for s in self.buckets.sizes if s >= size), self.buckets.block)

    def _pass_args(self, p: Pass) -> tuple:
        arrays = (p.tokens, p.positions, p.span_end, p.trunk_end, p.branch_start, p.tree_start_block)
        batch = TreeBatch(*map(jnp.asarray, arrays))
        return self.model.params, batch, p.read_rows, p.target_read, p.target_token

    def _run_pass(self, p: Pass) -> np.ndarray:
        return np.asarray(self._run(*self._pass_args(p)))

    def lowered(self, size: int) -> jax.stages.Lowered:
        """One bucket's program, lowered, for inspection (`.compile().memory_analysis()`, `.as_text()`)."""
        return self._run.lower(*self._pass_args(self._empty_pass(size)))

    def _empty_pass(self, size: int) -> Pass:
        return pack([build_tree([0], [], [])], self._bucket(size))[0]

    def score_trees(self, trees: list[Tree]) -> list[Scored]:
        """Pack trees into passes, run them, and hand back each tree's target log-probs."""
        out: list[Scored | None] = [None] * len(trees)
        for p in pack(trees, self.buckets):
            start = time.perf_counter()
            logprobs = self._run_pass(p)
            if self.on_pass:
                self.on_pass(p.size, time.perf_counter() - start)
            for tree_id, offset in zip(p.tree_ids, p.target_offset, strict=True):
                tree = trees[tree_id]
                out[tree_id] = Scored(tree, logprobs[offset : offset + len(tree.targets)])
        return out

    def score(self, body: dict) -> dict:
        """A scoring request (SPEC section 1) → the scoring response (section 2)."""
        plan = self.plan(body)
        return self.finish(plan, self.score_trees(plan.trees))

    def plan(self, body: dict) -> "Plan":
        """Compile a request and lay out every tree it needs: its contents', then floors not yet cached.

        The trees of several plans can share passes (the server batches concurrent requests that way);
        `finish` turns a plan's scored trees into the response."""
        if self.model.tokenizer is None:
            raise ValueError("scoring text needs a model with a tokenizer (score_trees works on token ids)")
        request = compile_request(body, self.model.tokenizer, self.limits)
        if request.pack_ids:
            raise ScoringError(
                "unknown_pack", f"no prompt pack {request.pack_ids[0]!r} is loaded", "packs[0].id"
            )
        trees, owners = self.trees(request)
        floors, missing = {}, []
        if request.empty_floor:
            wanted = dict.fromkeys(
                _key(q) for content in request.contents for query in content.queries for q in query.questions
            )
            with self._floor_lock:
                floors = {k: self._floor_cache[k] for k in wanted if k in self._floor_cache}
            missing = [k for k in wanted if k not in floors]
        prefix = self.model.tokenizer.prefix()
        floor_trees = [build_tree(prefix, [], [k]) for k in missing]
        processed = sum(len(t) for t in trees) + sum(len(t) for t in floor_trees)
        if processed > self.limits.max_request_tokens:
            raise ScoringError(
                "too_many_tokens",
                f"the request needs {processed} processed tokens; "
                f"the limit is {self.limits.max_request_tokens}",
                "inputs",
            )
        return Plan(request, trees + floor_trees, owners, missing, floors)

    def trees(self, request: CompiledRequest) -> tuple[list[Tree], list[int]]:
        """Every content's tree(s), and for each tree the index of the content it reads."""
        prefix = self.model.tokenizer.prefix()
        trees, owners = [], []
        for c, content in enumerate(request.contents):
            keys = [_key(q) for query in content.queries for q in query.questions]
            try:
                chunks = content_trees(prefix, list(content.content_ids), keys, self.buckets)
            except ValueError as e:
                raise ScoringError("content_too_long", str(e), f"inputs[{c}]") from e
            trees += [tree for tree, _ in chunks]
            owners += [c] * len(chunks)
        return trees, owners

    def finish(self, plan: "Plan", scored: list[Scored]) -> dict:
        n = len(plan.owners)
        floors = dict(plan.floors)
        for key, result in zip(plan.floor_keys, scored[n:], strict=True):
            floors[key] = result.option_logprobs(0)
            self._remember_floor(key, floors[key])
        by_content = plan.trees[:n]
        usage = {
            "content_tokens": sum(t.trunk_tokens for t in by_content),
            "query_tokens": sum(len(t) - t.trunk_tokens for t in by_content),
            "floor_tokens": sum(len(t) for t in plan.trees[n:]),
        }
        per_content: list[list[np.ndarray]] = [[] for _ in plan.request.contents]
        for c, result in zip(plan.owners, scored[:n], strict=True):
            per_content[c] += [result.option_logprobs(i) for i in range(len(result.tree.options))]
        return self._respond(plan.request, per_content, floors, usage)

    def _remember_floor(self, key: QuestionKey, logprobs: np.ndarray) -> None:
        with self._floor_lock:
            self._floor_cache[key] = logprobs
            self._floor_cache.move_to_end(key)
            while len(self._floor_cache) > self._floor_cache_size:
                self._floor_cache.popitem(last=False)

    def _respond(self, request: CompiledRequest, per_content, floors, usage) -> dict:
        results, warnings = [], []
        for content, logprobs in zip(request.contents, per_content, strict=True):
            queries, i = [], 0
            for query in content.queries:
                combinations = []
                for q in query.questions:
                    floor = floors.get(_key(q)) if request.empty_floor else None
                    combo = _combination(q, logprobs[i], floor)
                    i += 1
                    combinations.append(combo)
                    mass = 1.0 - combo["residual"]
                    if mass < LOW_OPTION_MASS:
                        warnings.append(
                            {
                                "code": "low_option_mass",
                                "input_id": content.input_id,
                                "query_id": query.id,
                                "message": f"the options hold {mass:.1%} of the probability at the slot"
                                + (f" for values {q.values}" if q.values else "")
                                + "; check the template and the options' leading spaces",
                            }
                        )
                queries.append({"id": query.id, "combinations": combinations})
            results.append({"input_id": content.input_id, "queries": queries})
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "score",
            "created": int(time.time()),
            "model": self.model.name,
            "system_fingerprint": self.fingerprint,
            "results": results,
            "warnings": warnings,
            "usage": {"prompt_tokens": sum(usage.values()), "prompt_tokens_details": usage},
        }


def _key(q) -> QuestionKey:
    return QuestionKey(tuple(q.template_ids), tuple(tuple(o) for o in q.option_ids))


def _distribution(logprobs: np.ndarray) -> tuple[np.ndarray, float]:
    """Options' probabilities renormalised over the options, and the mass left outside them."""
    top = float(np.max(logprobs))
    weights = np.exp(logprobs - top)
    mass = math.exp(top) * float(np.sum(weights))
    return weights / np.sum(weights), max(0.0, 1.0 - mass)


def _combination(q, logprobs: np.ndarray, floor: np.ndarray | None) -> dict:
    p, residual = _distribution(logprobs)
    options = [
        {"text": text, "logprob": float(lp), "p": float(pi)}
        for text, lp, pi in zip(q.options, logprobs, p, strict=True)
    ]
    combo = {"values": dict(q.values), "options": options, "residual": residual}
    if floor is not None:
        floor_p, floor_residual = _distribution(floor)
        for option, fp in zip(options, floor_p, strict=True):
            option["floor_p"] = float(fp)
        combo["floor_residual"] = floor_residual
    return combo

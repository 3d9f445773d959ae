"""Requests in, responses out: a scoring request (SPEC section 1) → the token trees it needs → the response
(SPEC section 2). Plain Python and numpy around an Engine, which only runs passes over token trees.

    scorer = Scorer(engine)
    plan = scorer.plan(request)  # compile, lay out the contents' trees and the floors not cached
    response = scorer.finish(plan, engine.score_trees(plan.trees))  # an api.ScoreResponse

The server makes plans on request threads and lets its engine thread score the trees of several plans in
shared passes; `Scorer.score` does the three steps in a row for the library, from a dict to a dict.
"""

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from spinf_jax import api, media, orderings
from spinf_jax.answers import parse_amount, parse_number
from spinf_jax.calibration import Calibration, Workload, apply_temperature
from spinf_jax.compiler import (
    CompiledRequest,
    ContentAudio,
    Limits,
    MediaFormats,
    MediaParts,
    PackAsk,
    Query,
    Question,
    compile_request,
)
from spinf_jax.decoding import convert
from spinf_jax.errors import ScoringError
from spinf_jax.extraction import Decoded
from spinf_jax.layout import Extract, QuestionKey, Tree, build_tree
from spinf_jax.packer import content_trees
from spinf_jax.packs import rules

if TYPE_CHECKING:
    from spinf_jax.engine import Engine, Scored
    from spinf_jax.packs.compiled import CompiledPack

LOW_OPTION_MASS = 0.05  # warn when the options hold less of the probability at the slot


@dataclass
class Plan:
    """A compiled request and the trees it needs scored."""

    request: CompiledRequest
    # The contents' trees, then one floor tree per floor not cached, then the empty contents of the packs
    # that present the content in their own way (their floors).
    trees: list[Tree]
    owners: list[tuple[int, int]]  # for each content tree, its content and which of its reads (Content.reads)
    floor_keys: list[QuestionKey]  # for each floor tree, its question
    floors: dict[QuestionKey, np.ndarray]  # floors found in the cache
    pack_floors: list[str] = field(default_factory=list)  # for each pack floor tree, its pack

    @property
    def inputs(self) -> int:
        return len(self.request.contents)

    @property
    def questions(self) -> int:
        """The questions asked of every content: each query's combinations and orderings, and the packs'."""
        return sum(
            len(query.questions)
            for c in self.request.contents
            for *_, queries in c.reads()
            for query in queries
        )


class Scorer:
    def __init__(
        self,
        engine: "Engine",
        limits: Limits | None = None,
        packs: dict[str, "CompiledPack"] | None = None,
        calibration: Calibration | None = None,
    ):
        self.engine = engine
        self.limits = limits or Limits()
        self.packs = packs or {}  # the prompt packs requests may name, by id (spinf_jax.packs.compiled)
        self.calibration = calibration  # the workloads queries may name (spinf_jax.calibration)

    def score(self, body: dict) -> dict:
        plan = self.plan(body)
        return msgspec.to_builtins(self.finish(plan, self.engine.score_trees(plan.trees)))

    def plan(self, body: api.ScoreRequest | dict) -> Plan:
        """Compile a request (decoded, or as Python objects) and lay out every tree it needs: its contents',
        then floors not yet cached."""
        tokenizer = self.engine.model.tokenizer
        if tokenizer is None:
            raise ValueError("scoring text needs a model with a tokenizer (score_trees works on token ids)")
        if not isinstance(body, api.ScoreRequest):
            body = convert(body, api.ScoreRequest)
        model = self.engine.model
        formats = MediaFormats(model.image_format, model.audio_format)
        request = compile_request(body, tokenizer, self.limits, self.packs, self.calibration, formats)
        prefix = tokenizer.prefix()
        budget = _TokenBudget(self.limits.max_request_tokens)
        budget.check_shape(request, len(prefix))
        trees, owners, wanted = [], [], {}

        def read(content_ids, queries, param, parts: MediaParts = ()) -> list[Tree]:
            keys = [q.key for query in queries for q in query.questions]
            soft = tuple((row, *self._soft_tokens(part, formats)) for row, part in parts)
            try:
                chunks = content_trees(prefix, list(content_ids), keys, self.engine.buckets, soft)
            except ValueError as e:
                raise ScoringError("question_too_large", str(e), param) from e
            return budget.spend(tree for tree, _ in chunks)

        for c, content in enumerate(request.contents):
            for part, (content_ids, parts, queries) in enumerate(content.reads()):
                chunks = read(content_ids, queries, content.param, parts)
                trees += chunks
                owners += [(c, part)] * len(chunks)
                if part == 0:  # a wrapping pack's floor is its wrapper around empty content (below)
                    questions = [q for query in queries for q in query.questions]
                    wanted |= dict.fromkeys(q.key for q in questions if q.floor)
        floors = self.engine.cached_floors(wanted)
        missing = [k for k in wanted if k not in floors]
        trees += budget.spend(build_tree(prefix, [], [k]) for k in missing)
        wrapping = {
            a.pack.pack.id: a.pack for c in request.contents for a in c.packs if a.content_ids is not None
        }
        pack_floors = []
        for pack_id, pack in wrapping.items():
            chunks = read(pack.empty_ids, pack.queries, "packs")
            trees += chunks
            pack_floors += [pack_id] * len(chunks)
        return Plan(request, trees, owners, missing, floors, pack_floors)

    def _soft_tokens(self, part, formats: MediaFormats) -> tuple:
        """A media part's soft tokens, as a tree's media entry after its row (TreeBatch.with_media)."""
        if isinstance(part, ContentAudio):
            return self.engine.audio_tokens(part.digest, part.samples), "audio"
        try:
            if part.frame:
                return self.engine.image_tokens(part.digest, part.data, part.param, formats.video), "video"
            return (self.engine.image_tokens(part.digest, part.data, part.param),)
        except media.MediaError as e:
            raise ScoringError(e.code, str(e), part.param + part.url) from None

    def finish(self, plan: Plan, scored: list["Scored"]) -> api.ScoreResponse:
        """The response of a plan whose trees were scored (in the plan's order)."""
        n, f = len(plan.owners), len(plan.owners) + len(plan.floor_keys)
        floors = dict(plan.floors)
        for key, result in zip(plan.floor_keys, scored[n:f], strict=True):
            floors[key] = _question_results(result)[0]
            self.engine.remember_floor(key, floors[key])
        pack_floors: dict[str, list] = {}
        for pack_id, result in zip(plan.pack_floors, scored[f:], strict=True):
            pack_floors.setdefault(pack_id, []).extend(_question_results(result))
        by_content = plan.trees[:n]
        usage = api.TokenDetails(
            content_tokens=sum(t.trunk_tokens for t in by_content),
            query_tokens=sum(len(t) - t.trunk_tokens for t in by_content),
            floor_tokens=sum(len(t) for t in plan.trees[n:]),
            decode_tokens=sum(result.decode_tokens for result in scored),
            image_tokens=sum(m[1].shape[0] for t in by_content for m in t.media if m[2:] == ()),
            audio_tokens=sum(m[1].shape[0] for t in by_content for m in t.media if m[2:] == ("audio",)),
            video_tokens=sum(m[1].shape[0] for t in by_content for m in t.media if m[2:] == ("video",)),
        )
        per_read: list[list[list]] = [[[] for _ in c.reads()] for c in plan.request.contents]
        for (c, part), result in zip(plan.owners, scored[:n], strict=True):
            per_read[c][part] += _question_results(result)
        return self._respond(plan.request, per_read, floors, pack_floors, usage)

    def _respond(
        self, request: CompiledRequest, per_read, floors, pack_floors, usage: api.TokenDetails
    ) -> api.ScoreResponse:
        results, warnings = [], []
        for content, reads in zip(request.contents, per_read, strict=True):
            answered, wrapped = reads[0], iter(reads[1:])
            queries, i = [], 0
            for query in content.queries:
                combinations = []
                step = len(query.orders) or 1  # a combination's questions: one per ordering
                for start in range(0, len(query.questions), step):
                    q = query.questions[start]
                    mine, i = answered[i : i + step], i + step
                    floor = floors.get(q.key) if q.floor else None
                    if q.extract is not None:
                        combinations.append(self._extracted(q, mine[0], floor))
                        continue
                    combo = self._scored(query, q, mine, floor)
                    combinations.append(combo)
                    mass = 1.0 - combo.residual
                    if mass < LOW_OPTION_MASS:
                        warnings.append(
                            api.ScoringWarning(
                                code="low_option_mass",
                                input_id=content.input_id,
                                query_id=query.id,
                                message=f"the options hold {mass:.1%} of the probability at the slot"
                                + (f" for values {q.values}" if q.values else "")
                                + "; check the template and the options' leading spaces",
                            )
                        )
                queries.append(api.QueryResult(id=query.id, combinations=combinations))
            packs = []
            for ask in content.packs:
                if ask.content_ids is None:  # its questions follow the content's own in the shared read
                    count = sum(len(q.questions) for q in ask.queries)
                    own, i = answered[i : i + count], i + count
                    floor = [floors[q.key] for query in ask.queries for q in query.questions]
                else:
                    own = next(wrapped)
                    floor = _pack_floor(ask, pack_floors[ask.pack.pack.id])
                packs.append(pack_result(ask, own, floor))
            results.append(api.InputResult(input_id=content.input_id, queries=queries, packs=packs or None))
        tokens = usage.content_tokens + usage.query_tokens + usage.floor_tokens
        return api.ScoreResponse(
            id=f"score-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.engine.model.name,
            system_fingerprint=self.engine.fingerprint,
            results=results,
            warnings=warnings,
            usage=api.Usage(prompt_tokens=tokens, prompt_tokens_details=usage),
        )

    def _scored(self, query: Query, q: Question, per_order: list[np.ndarray], floor) -> api.CombinationResult:
        """A {?} combination from its options' log-probs in each ordering asked (the listed order first)."""
        combo = _scored_combination(q, per_order[0], floor)
        chosen = per_order[0]
        if query.orders:
            p = [orderings.by_id(orderings.distribution, lp, q.options) for lp in per_order]
            combo.combined = orderings.combine(q.options, list(query.orders), p)
            chosen = np.log(np.array(combo.combined.probabilities))
        if query.workload is not None:
            workload = self.calibration.workloads[query.workload]
            combo.calibrated = _calibrated(q, query.workload, workload, chosen, floor)
        return combo

    def _extracted(self, q: Question, decoded: list[Decoded], floor) -> api.CombinationResult:
        answers, residual = _answers(decoded, q.extract, self.engine.model.tokenizer)
        combo = api.CombinationResult(values=dict(q.values), answers=answers, residual=residual)
        if floor is not None:
            combo.floor_answers, combo.floor_residual = _answers(
                floor, q.extract, self.engine.model.tokenizer
            )
        return combo


class _TokenBudget:
    """The processed-token limit of one request, charged as its trees are built: the one place that checks
    it, and it stops building as soon as the request is over (a request cannot make us build 10^8 nodes)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def check_shape(self, request, prefix: int) -> None:
        """Refuse a request whose trees would be over the limit, counted from its compiled shape before any
        tree is built: each read of a content once, each question's template and its longest option but
        the last token (a tree split over buckets reads its trunk again, options' own rows and floors come
        on top: this is the least it needs). A request
        of 1,001 contents asked a 1,000-combination grid is refused here in milliseconds, not after seconds
        and hundreds of megabytes of trees."""
        per_query: dict[int, int] = {}

        def asked(query) -> int:
            if id(query) not in per_query:
                # An option's last token is read, not a row; options share their first tokens (a trie).
                per_query[id(query)] = sum(
                    len(q.template_ids) + max((len(o) - 1 for o in q.option_ids), default=0)
                    for q in query.questions
                )
            return per_query[id(query)]

        least = 0
        for n, content in enumerate(request.contents, 1):
            for content_ids, _, queries in content.reads():
                least += prefix + len(content_ids) + sum(asked(query) for query in queries)
            if least > self.limit:
                raise ScoringError(
                    "too_many_tokens",
                    f"the request needs more than {self.limit:,} processed tokens (contents, questions and "
                    f"floors: at least {least:,} by the first {n:,} contents); split it",
                )

    def spend(self, trees) -> list[Tree]:
        out = []
        for tree in trees:
            self.used += len(tree)
            if self.used > self.limit:
                raise ScoringError(
                    "too_many_tokens",
                    f"the request needs more than {self.limit} processed tokens (contents, questions and "
                    "floors); split it",
                )
            out.append(tree)
        return out


def _pack_floor(ask: PackAsk, results: list) -> list:
    """A wrapping pack's floors for the questions it asked, out of its floors for all its questions."""
    by_query = {}
    for query in ask.pack.queries:
        by_query[query.id], results = results[: len(query.questions)], results[len(query.questions) :]
    return [lp for query in ask.queries for lp in by_query[query.id]]


def pack_result(ask: PackAsk, logprobs: list, floors: list) -> api.PackResult:
    """A pack's categories and decision from its questions' option log-probs and floors (in question order,
    spinf_jax.packs.rules)."""
    pack, combos, k = ask.pack.pack, {}, 0
    for query in ask.queries:
        n = len(query.questions)
        pairs = zip(logprobs[k : k + n], floors[k : k + n], strict=True)
        combos[query.id] = [(_distribution(lp)[0], _distribution(fl)[0]) for lp, fl in pairs]
        k += n
    scores, listed = {}, []
    options = {q.id: q.options for q in pack.questions}
    for category_id in ask.categories:
        category = pack.category(category_id)
        cells = [rules.cell_score(c, options[c.question], combos[c.question]) for c in category.cells]
        scores[category_id] = rules.category_score(category, [c.score for c in cells])
        listed += cells
    label, fired = rules.decide(pack, scores)
    result = api.PackResult(
        id=pack.id,
        version=pack.version,
        categories=[api.CategoryScore(id=c, score=s) for c, s in scores.items()],
        decision=api.PackDecision(
            label=label,
            rules=[api.FiredRule(category=r.category, at_least=r.at_least, label=r.label) for r in fired],
        ),
    )
    if ask.cells:
        result.cells = [
            api.PackCell(question=c.question, option=c.option, value=c.value, score=c.score, p=c.p,
                         floor_p=c.floor_p)
            for c in listed
        ]  # fmt: skip
    return result


def _question_results(result: "Scored") -> list:
    """Per question of a scored tree, in order: its options' log-probs, or its slot's decoded answers."""
    answers = {
        slot.question: decoded for slot, decoded in zip(result.tree.slots, result.answers, strict=True)
    }
    return [
        answers[i] if i in answers else result.option_logprobs(i) for i in range(len(result.tree.options))
    ]


def _answers(decoded: list[Decoded], extract: Extract, tokenizer) -> tuple[list[api.Answer], float]:
    """The listed answers of a slot: the most likely first, one per text (the best way of writing it), those
    of a {n} or {$} slot only where a number can be read, up to max_answers (one generated); with the mass
    they leave (1 - Σ exp(logprob), clamped at 0)."""
    kept, seen = [], set()
    wanted = 1 if extract.generate else extract.max_answers
    for d in decoded:
        text = tokenizer.decode(list(d.tokens)).strip()
        if not text or text in seen:
            continue
        seen.add(text)
        answer = api.Answer(text=text, p=0.0, logprob=d.logprob)
        if extract.kind == "number":
            answer.value = parse_number(text)
        elif extract.kind == "amount":
            answer.value, answer.currency = parse_amount(text)
        if extract.kind != "text" and answer.value is None:
            continue
        kept.append(answer)
        if len(kept) == wanted:
            break
    if not kept:
        return [], 1.0
    p, residual = _distribution(np.array([a.logprob for a in kept]))
    for answer, pi in zip(kept, p, strict=True):
        answer.p = float(pi)
    return kept, residual


def _distribution(logprobs: np.ndarray) -> tuple[np.ndarray, float]:
    """Options' probabilities renormalised over the options, and the mass left outside them."""
    top = float(logprobs.max())  # methods, not np.max and np.sum: a request makes thousands of these calls
    weights = np.exp(logprobs - top)
    total = weights.sum()
    return weights / total, max(0.0, 1.0 - math.exp(top) * float(total))


def _calibrated(
    q: Question, name: str, workload: Workload, logprobs: np.ndarray, floor
) -> api.ScoreCalibrated:
    """A combination at its workload's temperature, with the option its rule picks and those over their
    thresholds."""
    p = orderings.by_id(lambda x: apply_temperature(x, workload.temperature), logprobs, q.options)
    lifted = logprobs - floor if workload.rule == "floor_lift" else p
    return api.ScoreCalibrated(
        workload=name,
        temperature=workload.temperature,
        probabilities=p.tolist(),
        choice=q.options[int(np.argmax(lifted))],
        rule=workload.rule,
        # An option without a threshold is never above one (no p reaches 2).
        above_threshold=[
            o for o, pi in zip(q.options, p, strict=True) if pi >= workload.thresholds.get(o, 2.0)
        ],
    )


def _scored_combination(q: Question, logprobs: np.ndarray, floor: np.ndarray | None) -> api.CombinationResult:
    p, residual = _distribution(logprobs)
    options = [
        api.OptionScore(text=text, logprob=float(lp), p=float(pi))
        for text, lp, pi in zip(q.options, logprobs, p, strict=True)
    ]
    combo = api.CombinationResult(values=dict(q.values), options=options, residual=residual)
    if floor is not None:
        floor_p, combo.floor_residual = _distribution(floor)
        for option, fp in zip(options, floor_p, strict=True):
            option.floor_p = float(fp)
    return combo

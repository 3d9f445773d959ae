"""Typed decisions (SPEC section 5): a question over a state, answered as a probability over a fixed set of
options, read from the options' letters at the first position of the model's answer.

    decider = Decider(engine)
    decider.decide({"id": "d1", "state": "...", "question": "...", "options": [...]})

The prompt is SemIf's `direct-options-v1`, so its prompts and their sha256 compare with that service: a
system instruction, then one JSON object as the user's message, through the model's chat template:

    {"evidence": <state>, "criterion": <question>, "options": [{"letter": "A", "description": ...}, ...]}

A model without a chat template (a base model) reads PLAIN instead and answers after "Answer:", with a
space before the letter (`direct-options-plain-v1`).

Every decision, and every ordering of a decision's options, is a branch of one read of the state: the
tree's trunk is the prompt up to the end of the state, a branch the rest of that prompt, its options the
letters. So a decision's bits do not depend on the other decisions asked with it, on how many orderings are
asked, or on the order they are listed in (the combination sums in a canonical order).
"""

import hashlib
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from typing import TYPE_CHECKING

import jax
import msgspec
import numpy as np
from msgspec.structs import replace

from spinf_jax import api, orderings
from spinf_jax.calibration import Calibration, apply_temperature
from spinf_jax.compiler import IMAGE_MARK, Limits, MediaFormats, MediaParts, media_content_ids
from spinf_jax.decoding import convert
from spinf_jax.errors import ScoringError
from spinf_jax.layout import QuestionKey, Tree
from spinf_jax.packer import content_trees

if TYPE_CHECKING:
    from spinf_jax.engine import Engine, Scored

LETTERS = "ABCDEFGHIJKLMNOP"  # /decide's options: 2 to 16
SYSTEM = (
    "Apply the supplied criterion to the supplied evidence. Choose exactly one listed option. "
    "Respond with only its uppercase letter, with no explanation or reasoning."
)


def json_payload(state, question, options: list[dict], names: list[str]) -> tuple[str, int]:
    """SemIf's user message: one JSON object, the state first, then the criterion and the lettered options.
    Returns the text, and where the state ends in it (characters)."""
    listed = [{"letter": name, **o} for name, o in zip(names, options, strict=False)]
    text = json.dumps({"evidence": state, "criterion": question, "options": listed}, ensure_ascii=False)
    return text, len('{"evidence": ') + len(json.dumps(state, ensure_ascii=False))


@dataclass(frozen=True)
class Contract:
    """A prompt contract: the wording of a labelled question over a state, versioned. The user's message
    (`payload`: the state, the question, the options without their labels, the labels) begins with the
    state, so that every question's prompt begins with the same tokens: the tree's trunk."""

    chat_version: str  # read through the model's chat template
    plain_version: str  # a base model: the system text, the payload, then "\n\nAnswer:" (a space, the label)
    system: str
    # (state, question, options, labels or None: listed by name) → the message, and where the state ends
    payload: Callable[[object, object, list[dict], list[str] | None], tuple[str, int]]


DIRECT_OPTIONS = Contract("direct-options-v1", "direct-options-plain-v1", SYSTEM, json_payload)
PLAIN_TAIL = "\n\nAnswer:"


def candidate_labels() -> list[str]:
    """The labels a question's options may take, in order: A to Z, then AA, AB, ... (a tokenizer keeps
    those it reads as one token)."""
    singles = [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    return singles + [a + b for a in singles for b in singles]


class Format:
    """How one tokenizer is asked lettered questions under a contract: the prompt's wording, and the labels'
    tokens. Refuses a tokenizer that cannot read a letter as one token that stays apart from the text before
    it; two-letter labels (past Z) are those it reads that way, up to `max_labels` in all."""

    def __init__(self, tokenizer, contract: Contract = DIRECT_OPTIONS, max_labels: int = len(LETTERS)):
        self.tokenizer = tokenizer
        self.contract = contract
        self.chat = tokenizer.chat_template is not None
        self.version = contract.chat_version if self.chat else contract.plain_version
        probe = self._render("x", "q", [{"description": "a"}, {"description": "b"}], ["A", "B"])[0]
        probe_ids = tokenizer.encode(probe)
        self.labels, self.label_ids = [], []
        for name in candidate_labels():
            if len(self.labels) == max_labels:
                break
            text = name if self.chat else " " + name
            ids = tokenizer.encode(text)
            apart = tokenizer.encode(probe + text) == probe_ids + ids
            if len(ids) == 1 and tokenizer.decode(ids) == text and apart:
                self.labels.append(name)
                self.label_ids.append(ids[0])
            elif len(name) == 1 and len(self.labels) < len(LETTERS):
                raise ScoringError(
                    "decisions_unsupported",
                    f"this model's tokenizer does not read the answer {text!r} as one token of its own after "
                    "the prompt, so decisions cannot be read from it",
                )

    def render(self, state, question, options: list[dict], labelled: bool = True) -> tuple[str, int]:
        """The prompt's text, and where the state ends in it (characters); `labelled` False: the options
        listed by name, for a contract that reads the answer as an option's name."""
        return self._render(state, question, options, self.labels if labelled else None)

    def _render(self, state, question, options: list[dict], names: list[str] | None) -> tuple[str, int]:
        user, state_end = self.contract.payload(state, question, options, names)
        system = self.contract.system
        if not self.chat:
            head = system + "\n\n"
            return head + user + PLAIN_TAIL, len(head) + state_end
        text = self.tokenizer.render_chat(
            [{"role": "system", "content": system}, {"role": "user", "content": user}]
        )
        at = text.find(user)
        if at < 0:
            raise ScoringError(
                "decisions_unsupported",
                "this model's chat template rewrites the user's message, so the state cannot be read once "
                "for many decisions",
            )
        return text, at + state_end


# ---------------------------------------------------------------------------------------------------------
# A request's decisions → token trees


@dataclass(frozen=True)
class Ordering:
    order: tuple[int, ...]  # the options' indices in letter order
    prompt_sha256: str
    branch_ids: tuple[int, ...]  # the prompt after the trunk
    input_tokens: int  # the whole prompt's, BOS included


@dataclass(frozen=True)
class Decision:
    id: str
    option_ids: tuple[str, ...]
    orderings: tuple[Ordering, ...]  # the options as listed first
    averaged: bool  # orderings were asked for
    workload: str | None


def _at(param: str, name: str) -> str:
    """A field of a decision: top-level in /decide (param ""), decisions[i].name in /decide/shared."""
    return f"{param}.{name}" if param else name


def _check(question: api.DecisionQuestion, param: str, calibration: Calibration | None) -> None:
    n = len(question.options)
    if not 2 <= n <= len(LETTERS):
        raise ScoringError(
            "option_count", f"{n} options; a decision has 2 to {len(LETTERS)}", _at(param, "options")
        )
    seen = set()
    for j, option in enumerate(question.options):
        if option.id in seen:
            raise ScoringError(
                "duplicate_option_id",
                f"option id {option.id!r} is used twice",
                _at(param, f"options[{j}].id"),
            )
        seen.add(option.id)
    if problem := orderings.count_error(n, question.orderings):
        raise ScoringError("too_many_orderings", problem, _at(param, "orderings"))
    workload = question.workload
    if workload is not None and (calibration is None or workload not in calibration.workloads):
        known = ", ".join(sorted(calibration.workloads)) if calibration else "none: serve with --calibration"
        raise ScoringError(
            "unknown_workload", f"no calibration for workload {workload!r} (loaded: {known})",
            _at(param, "workload"),
        )  # fmt: skip


@dataclass(frozen=True)
class Asked:
    """One question over a state as the model reads it: the question (any JSON value), its options as
    shown (label-less dicts), and the orders in which they are listed (indices; the listed order first)."""

    param: str  # where the question is in the request, for errors
    question: object
    options: list[dict]
    orders: list[tuple[int, ...]]
    labelled: bool = True  # listed with labels (the answer a label), or by name (the answer a name)


@dataclass(frozen=True)
class StateImages:
    """The images of a state, in the order their IMAGE_MARKs stand in its text, and how the model reads
    them."""

    parts: tuple  # compiler.ContentImage
    formats: MediaFormats


def read_state(
    state,
    asked: list[Asked],
    form: Format,
    limits: Limits | None,
    floor: bool = False,
    images: StateImages | None = None,
) -> tuple[tuple[int, ...], list[tuple[Ordering, ...]], MediaParts]:
    """The state's trunk (tokens without BOS), each question's orderings as branches of it, and where the
    state's images stand in the trunk; raises ScoringError. An empty state is refused, unless it is read on
    purpose (`floor`: the questions' prior). The state is held to limits.max_content_tokens; without limits,
    only the buckets bound it (a state with its largest question must fit the largest: packer.content_trees
    refuses it otherwise). With images, the state's text is tokenised piece by piece around them and apart
    from the questions, as /v1/score tokenises a content with images."""
    if not floor and (state in ("", {}, []) or (isinstance(state, str) and not state.strip())):
        raise ScoringError("empty_state", "the state is empty: give the text or JSON to decide over", "state")
    if images is not None and images.parts:
        return _read_with_images(state, asked, form, images)
    tokenizer, prefix = form.tokenizer, form.tokenizer.prefix()
    rendered = [
        form.render(state, question.question, [question.options[i] for i in order], question.labelled)
        for question in asked
        for order in question.orders
    ]
    # One call for every prompt: the tokenizer's batch runs them side by side (the ids of one by one).
    encodings = iter(tokenizer.backend.encode_batch([text for text, _ in rendered], add_special_tokens=False))
    rendered = iter(rendered)
    trunk, out = None, []
    for question in asked:
        branches = []
        for order in question.orders:
            text, state_end = next(rendered)
            encoding = next(encodings)
            ids = list(encoding.ids)
            if prefix and ids[:1] == prefix:  # the template wrote BOS itself; the tree adds it
                ids = ids[1:]
                offsets = encoding.offsets[1:]
            else:
                offsets = encoding.offsets
            cut = sum(1 for _, end in offsets if end <= state_end)
            if trunk is None:
                trunk = tuple(ids[:cut])
                if limits is not None and len(trunk) > limits.max_content_tokens:
                    raise ScoringError(
                        "content_too_long",
                        f"the state's prompt is {len(trunk)} tokens; at most {limits.max_content_tokens}",
                        "state",
                    )
            if tuple(ids[:cut]) != trunk:
                raise ScoringError(
                    "decisions_unsupported",
                    "this model's tokenizer joins the end of the state with the text after it, so the state "
                    "cannot be read once for many decisions",
                    question.param,
                )
            digest = hashlib.sha256(text.encode()).hexdigest()
            branches.append(Ordering(order, digest, tuple(ids[cut:]), len(prefix) + len(ids)))
        out.append(tuple(branches))
    return trunk, out, ()


def _read_with_images(
    state, asked: list[Asked], form: Format, images: StateImages
) -> tuple[tuple[int, ...], list[tuple[Ordering, ...]], MediaParts]:
    tokenizer, prefix = form.tokenizer, form.tokenizer.prefix()
    trunk, placed, out = None, (), []
    for question in asked:
        branches = []
        for order in question.orders:
            shown = [question.options[i] for i in order]
            text, state_end = form.render(state, question.question, shown, question.labelled)
            if trunk is None:
                head = text[:state_end]
                pieces = [*head.split(IMAGE_MARK), images.formats.gap]
                ids = {piece: tuple(tokenizer.encode(piece)) for piece in pieces}
                trunk, placed = media_content_ids(head, images.parts, ids, images.formats, "state")
                if prefix and trunk[: len(prefix)] == tuple(prefix):  # the template wrote BOS itself
                    trunk = trunk[len(prefix) :]
                    placed = tuple((row - len(prefix), part) for row, part in placed)
            if IMAGE_MARK in text[state_end:]:
                raise ScoringError(
                    "unsupported_content",
                    "images are read in the state only, not in questions",
                    question.param,
                )
            rest = tuple(tokenizer.encode(text[state_end:]))
            digest = hashlib.sha256(text.encode()).hexdigest()
            branches.append(Ordering(order, digest, rest, len(prefix) + len(trunk) + len(rest)))
        out.append(tuple(branches))
    return trunk, out, placed


def compile_decisions(
    state,
    questions: list[api.DecisionQuestion],
    params: list[str],
    form: Format,
    limits: Limits,
    calibration: Calibration | None,
) -> tuple[tuple[int, ...], list[Decision]]:
    """The state's trunk (tokens without BOS) and each decision's orderings as branches; raises
    ScoringError."""
    asked = []
    for question, param in zip(questions, params, strict=True):
        _check(question, param, calibration)
        options = [{"description": o.description} for o in question.options]
        asked.append(
            Asked(param, question.question, options, orderings.orders(len(options), question.orderings))
        )
    trunk, branches, _ = read_state(state, asked, form, limits)
    decisions = [
        Decision(q.id, tuple(o.id for o in q.options), b, q.orderings is not None, q.workload)
        for q, b in zip(questions, branches, strict=True)
    ]
    return trunk, decisions


# ---------------------------------------------------------------------------------------------------------
# Scores → the reply


def by_option(order: tuple[int, ...], letter_values: np.ndarray) -> np.ndarray:
    """Values in letter order → per option, in the options' listed order."""
    out = np.empty(len(order))
    out[list(order)] = letter_values
    return out


@dataclass
class DecisionPlan:
    trunk: tuple[int, ...]
    decisions: list[Decision]
    trees: list[Tree]  # the decisions' orderings, in order, as branches
    shared: bool  # a /decide/shared request
    inputs = 1  # the state: what the request log counts as a scoring request's contents

    @property
    def questions(self) -> int:
        """Each decision in each of its orderings (as a scoring request's questions count them)."""
        return sum(len(d.orderings) for d in self.decisions)


class Decider:
    """Decisions over an Engine, through the same trees and passes as scoring."""

    def __init__(
        self, engine: "Engine", limits: Limits | None = None, calibration: Calibration | None = None
    ):
        self.engine = engine
        self.limits = limits or Limits()
        self.calibration = calibration
        self._format: Format | None = None
        model = engine.model
        self.model_info = api.DecisionModel(
            name=model.name, digest=model.digest, precision=model.precision.value,
            versions=api.Versions(spinf_jax=version("spinf-jax"), jax=jax.__version__,
                                  backend=jax.default_backend()),
        )  # fmt: skip

    @property
    def format(self) -> Format:
        if self._format is None:
            if self.engine.model.tokenizer is None:
                raise ScoringError("decisions_unsupported", "decisions need a model with a tokenizer")
            self._format = Format(self.engine.model.tokenizer)
        return self._format

    def plan(self, body: api.DecideRequest | api.SharedDecideRequest) -> DecisionPlan:
        shared = isinstance(body, api.SharedDecideRequest)
        questions, params = [body], [""]
        if shared:  # the request's workload is each decision's unless it names its own
            questions = [
                d if d.workload is not None or body.workload is None else replace(d, workload=body.workload)
                for d in body.decisions
            ]
            params = [f"decisions[{i}]" for i in range(len(questions))]
            seen = set()
            for question, param in zip(questions, params, strict=True):
                if question.id in seen:
                    raise ScoringError(
                        "invalid_request", f"decision id {question.id!r} is used twice", param + ".id"
                    )
                seen.add(question.id)
        trunk, decisions = compile_decisions(
            body.state, questions, params, self.format, self.limits, self.calibration
        )
        asked = sum(len(d.orderings) for d in decisions)
        if asked > self.limits.max_questions_per_content:
            raise ScoringError(
                "too_many_questions",
                f"{asked} prompts (decisions x orderings); at most {self.limits.max_questions_per_content}",
                "decisions",
            )
        letters = tuple((i,) for i in self.format.label_ids)
        keys = [
            QuestionKey(o.branch_ids, letters[: len(d.option_ids)]) for d in decisions for o in d.orderings
        ]
        try:
            chunks = content_trees(self.format.tokenizer.prefix(), list(trunk), keys, self.engine.buckets)
        except ValueError as e:
            raise ScoringError("question_too_large", str(e), self._too_large(trunk, decisions, params)) from e
        return DecisionPlan(trunk, decisions, [tree for tree, _ in chunks], shared)

    def _too_large(self, trunk, decisions: list[Decision], params: list[str]) -> str:
        """Which field a prompt too large for the largest bucket is blamed on: the state where it alone
        takes most of the bucket, else the decision whose prompt after the state is the longest."""
        largest = self.engine.buckets.largest
        if len(trunk) > largest // 2:
            return "state"
        longest = max(
            range(len(decisions)), key=lambda i: max(len(o.branch_ids) for o in decisions[i].orderings)
        )
        return _at(params[longest], "question")

    def finish(self, plan: DecisionPlan, scored: list["Scored"]):
        """The reply of a plan whose trees were scored: an api.DecisionResult, or api.SharedDecisions."""
        logprobs = []
        for result in scored:
            logprobs += [result.option_logprobs(i) for i in range(len(result.tree.options))]
        results, k = [], 0
        for decision in plan.decisions:
            mine = logprobs[k : k + len(decision.orderings)]
            k += len(decision.orderings)
            results.append(self._result(decision, mine))
        tokens = sum(len(t) for t in plan.trees)
        if not plan.shared:
            return results[0]
        return api.SharedDecisions(
            id=f"decisions-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model_info,
            system_fingerprint=self.engine.fingerprint,
            state_tokens=len(self.format.tokenizer.prefix()) + len(plan.trunk),
            processed_tokens=tokens,
            results=results,
        )

    def _result(self, decision: Decision, letter_logprobs: list[np.ndarray]) -> api.DecisionResult:
        ids, asked = decision.option_ids, [o.order for o in decision.orderings]
        # Each ordering renormalised over its letters in letter order: the same prompt, the same bits,
        # whichever way the request listed the options. Then per option, in the listed order.
        letter_p = [orderings.distribution(lp) for lp in letter_logprobs]
        per_option = [by_option(order, p) for order, p in zip(asked, letter_p, strict=True)]
        first = decision.orderings[0]
        result = api.DecisionResult(
            id=decision.id,
            option_ids=list(ids),
            probabilities=per_option[0].tolist(),  # the listed order is the first ordering's letter order
            option_logits=letter_logprobs[0].tolist(),
            prompt_sha256=first.prompt_sha256,
            prompt_version=self.format.version,
            model=self.model_info,
            input_tokens=first.input_tokens,
            system_fingerprint=self.engine.fingerprint,
        )
        chosen = per_option[0]
        if decision.averaged:
            result.orderings = [
                api.OrderingResult(
                    order=[ids[i] for i in o.order],
                    probabilities=p.tolist(),
                    option_logits=by_option(o.order, lp).tolist(),
                    prompt_sha256=o.prompt_sha256,
                )
                for o, p, lp in zip(decision.orderings, per_option, letter_logprobs, strict=True)
            ]
            result.combined = orderings.combine(ids, asked, per_option)
            chosen = np.array(result.combined.probabilities)
        if decision.workload is not None:
            temperature = self.calibration.workloads[decision.workload].temperature
            p = orderings.by_id(lambda x: apply_temperature(x, temperature), np.log(chosen), ids)
            result.calibrated = api.Calibrated(
                workload=decision.workload,
                temperature=temperature,
                probabilities=p.tolist(),
                top=ids[int(np.argmax(p))],
            )
        return result

    def decide(self, body: dict) -> dict:
        """One decision ({id, state, question, options, ...}) or a shared request ({state, decisions}) as
        Python objects → its reply as Python objects: the library's entry point."""
        kind = api.SharedDecideRequest if "decisions" in body else api.DecideRequest
        plan = self.plan(convert(body, kind))
        return msgspec.to_builtins(self.finish(plan, self.engine.score_trees(plan.trees)))

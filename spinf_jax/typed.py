"""Typed questions over states, as the decision APIs of the field ask them (System One's noul / choice /
score, OpenAI's predicate / choice / score): each question is a branch of one read of its state, its options
listed with labels (A to Z, then AA, AB, ...: up to 255), the answer read from the labels' log-probabilities
at the first position of the model's answer.

The prompt contract is `typed-options-v1` (through the model's chat template: a system text, then the
user's message) or `typed-options-plain-v1` (a base model: the system text, the message, then "Answer:"; the
label follows after a space), spinf_jax.decisions.Format's two forms. The message is

    State:
    <the state: text as it is, an object or an array as compact JSON>

    Question: <the instructions>
    Options:
    A. <name>: <description>
    B. ...

- noul: the options `yes` and `no`, with the criteria's `true` / `false` descriptions where given; the
  answer is P(yes). Without instructions the question reads "Which option is true of the state?".
- choice: each option's name, and its description where it has one (objects and arrays as compact JSON).
- score: the levels' descriptions in order, the header saying "(from the lowest level to the highest)"; the
  answer is Σ i·pᵢ.

One line an option keeps 255 described options within one read (about 12 tokens each).
The question's id is never shown. The state comes first, so every question's prompt starts with the same
tokens (the tree's trunk) and its answer's bits do not depend on what else is asked, under which id, in which
order, or with which other states in the pass.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from spinf_jax import api, orderings
from spinf_jax.calibration import Calibration, apply_temperature
from spinf_jax.compiler import Limits
from spinf_jax.decisions import Asked, Contract, Format, Ordering, StateImages, by_option, read_state
from spinf_jax.errors import ScoringError
from spinf_jax.layout import QuestionKey, Tree
from spinf_jax.packer import Buckets, content_trees

TYPED_SYSTEM = (
    "Answer the question about the supplied state. Choose exactly one listed option. "
    "Respond with only its label, with no explanation or reasoning."
)


def _text(value) -> str:
    """A string as it is; an object or an array as compact JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _option_parts(shown: dict, by_name: bool) -> list[str]:
    """An option's name (a level's number, where the options are listed by name) and its description."""
    name = shown.get("name", shown.get("level") if by_name else None)
    parts = [] if name is None else [_text(name)]
    if "description" in shown:
        parts.append(_text(shown["description"]))
    return parts


def _message(state, question, options: list[dict], lines: list[str], last: str = "") -> tuple[str, int]:
    head, state_text = "State:\n", _text(state)
    ordered = " (from the lowest level to the highest)" if options and "level" in options[0] else ""
    text = f"{head}{state_text}\n\nQuestion: {_text(question)}\nOptions{ordered}:\n" + "\n".join(lines)
    return text + ("\n" + last if last else ""), len(head) + len(state_text)


def text_payload(state, question, options: list[dict], labels: list[str] | None) -> tuple[str, int]:
    """typed-options-v1's message: the state, the question, then one line per option (`B. name: description`).
    Returns the text, and where the state ends in it (characters)."""
    lines = [
        f"{label}. " + ": ".join(_option_parts(o, False)) for label, o in zip(labels, options, strict=False)
    ]
    return _message(state, question, options, lines)


def names_payload(state, question, options: list[dict], labels: list[str] | None) -> tuple[str, int]:
    """typed-names-v1's message: the options listed by name (`- name: description`; a score's levels by
    number), and a last line asking for the name; with labels (a question whose names the tokenizer cannot
    read as answers), typed-options-v1's lines and a last line asking for the label."""
    if labels is not None:
        text, state_end = text_payload(state, question, options, labels)
        return text + "\n" + BY_LABEL, state_end
    lines = ["- " + ": ".join(_option_parts(o, True)) for o in options]
    return _message(state, question, options, lines, BY_NAME)


TYPED_OPTIONS = Contract("typed-options-v1", "typed-options-plain-v1", TYPED_SYSTEM, text_payload)
NAMES_SYSTEM = (
    "Answer the question about the supplied state. Choose exactly one listed option. "
    "Respond with only what the message's last line asks for, with no explanation or reasoning."
)
BY_NAME = "Answer with the option's name, exactly as listed."
BY_LABEL = "Answer with the option's label."
TYPED_NAMES = Contract("typed-names-v1", "typed-names-plain-v1", NAMES_SYSTEM, names_payload)
CONTRACTS = (TYPED_OPTIONS, TYPED_NAMES)
DEFAULT_CONTRACT = TYPED_OPTIONS
MAX_OPTIONS = 255  # System One's documented maximum (OpenAI's Decisions API has the same)
MAX_LEVELS = 10
NOUL_QUESTION = "Which option is true of the state?"
KINDS = ("noul", "choice", "score")


@dataclass(frozen=True)
class TypedQuestion:
    """A typed question as the model reads it. `names` key the answer: ("true", "false") for a noul, the
    options' names for a choice, "0".."n-1" for a score."""

    kind: str
    question: object  # the instructions (any JSON value)
    names: tuple[str, ...]
    shown: tuple[dict, ...]  # each option as the payload lists it, without its label
    param: str  # where it is in the request, for errors


def _shown(name_key: str, name, description) -> dict:
    return {name_key: name} if description is None else {name_key: name, "description": description}


def noul(instructions, true=None, false=None, param: str = "") -> TypedQuestion:
    question = NOUL_QUESTION if instructions is None else instructions
    shown = (_shown("name", "yes", true), _shown("name", "no", false))
    return TypedQuestion("noul", question, ("true", "false"), shown, param)


def choice(instructions, names: list[str], descriptions: list, param: str = "", shown_as: list | None = None):
    """names: the options' keys in the answer, in the caller's order; descriptions: each one's, or None;
    shown_as: what the model reads as each option's name (a JSON value), where it is not the name itself."""
    if not 2 <= len(names) <= MAX_OPTIONS:
        raise ScoringError("option_count", f"{len(names)} options; a choice has 2 to {MAX_OPTIONS}", param)
    shown = tuple(_shown("name", n, d) for n, d in zip(shown_as or names, descriptions, strict=True))
    return TypedQuestion("choice", instructions, tuple(names), shown, param)


def score(instructions, levels: list, param: str = "") -> TypedQuestion:
    """levels: descriptions from the lowest (0) to the highest."""
    if not 2 <= len(levels) <= MAX_LEVELS:
        raise ScoringError("option_count", f"{len(levels)} levels; a score has 2 to {MAX_LEVELS}", param)
    shown = tuple(_shown("level", i, d) for i, d in enumerate(levels))
    return TypedQuestion("score", instructions, tuple(str(i) for i in range(len(levels))), shown, param)


@dataclass(frozen=True)
class Settings:
    """What a request asks beyond its questions (the `x_` fields of the decision APIs)."""

    orderings: str | None = None  # "rotations" or "all": every ordering of the options, combined
    workload: str | None = None  # a workload of the calibration file
    # Divide by the same question's probabilities on an empty state (its floor) and renormalise: the model's
    # prior over the labels (small models lean toward A) taken out.
    prior: bool = False
    contract: str | None = None  # a contract's version (chat or plain form); None: the reader's default


@dataclass
class StateRead:
    trunk: tuple[int, ...]
    branches: list[tuple[Ordering, ...]]  # per question, its orderings (the listed order first)


@dataclass
class TypedPlan:
    questions_asked: list[TypedQuestion]
    settings: Settings
    states: list[StateRead]
    trees: list[Tree]
    prefix_tokens: int  # BOS and whatever the tokenizer puts before every prompt
    version: str  # the prompt contract's, as this model reads it
    floor: StateRead | None = None  # the questions on an empty state (Settings.prior): read after the states

    @property
    def inputs(self) -> int:
        """The states: what the request log counts as a scoring request's contents."""
        return len(self.states)

    @property
    def questions(self) -> int:
        return sum(len(b) for s in self._reads for b in s.branches)

    @property
    def _reads(self) -> list[StateRead]:
        return self.states + ([self.floor] if self.floor else [])

    def _tokens(self, read: StateRead) -> int:
        return self.prefix_tokens + len(read.trunk) + sum(len(o.branch_ids) for b in read.branches for o in b)

    def state_tokens(self, i: int) -> int:
        """Every token the pass reads for state i: the state once, each question's prompt after it."""
        return self._tokens(self.states[i])

    @property
    def input_tokens(self) -> int:
        """The states' tokens, and the floor's where it is read."""
        return sum(self._tokens(read) for read in self._reads)


@dataclass
class TypedAnswer:
    question: TypedQuestion
    # per name: the listed order's, or the orderings' combination; over the floor where the prior is taken out
    probabilities: np.ndarray
    listed: np.ndarray  # the listed order's, as read
    option_mass: float  # the labels' share of the next-token probability (the listed order's prompt)
    prompt_sha256: str  # the listed order's prompt
    combined: api.Combined | None = None
    floor: np.ndarray | None = None  # the same reading on an empty state (Settings.prior)
    calibrated: np.ndarray | None = None
    temperature: float | None = None

    @property
    def top(self) -> str:
        return self.question.names[int(np.argmax(self.probabilities))]

    @property
    def confidence(self) -> float:
        """System One's documented formulas: for a choice (m − 1/n)/(1 − 1/n), m the top probability; for a
        score max(0, 1 − Σ pᵢ·|i − k| / D), k the most likely level and D = (1/n)·Σ|i − (n − 1)/2|."""
        p, n = self.probabilities, len(self.probabilities)
        if self.question.kind == "score":
            levels = np.arange(n)
            spread = float(np.mean(np.abs(levels - (n - 1) / 2)))
            k = int(np.argmax(p))
            return _unit(1.0 - float(np.sum(p * np.abs(levels - k))) / spread)
        return _unit((float(np.max(p)) - 1 / n) / (1 - 1 / n))

    @property
    def expectation(self) -> float:
        """A score's Σ i·pᵢ."""
        return float(np.sum(np.arange(len(self.probabilities)) * self.probabilities))


def _unit(x: float) -> float:
    return min(1.0, max(0.0, x))


class NameAnswers:
    """How one tokenizer reads an option's name as the model's answer (typed-names-v1): the probability of
    the answer beginning with the name's tokens. A question's names are read so only where each is at most
    MAX_TOKENS tokens and stays apart from the prompt before it, and no name's tokens begin another's (so no
    reading holds another's, and the mass outside the options is the answers that begin with none of them);
    otherwise the question is listed with labels. (Reading the end of the reply after the name as well was
    tried: small models rarely end there, which put nearly all of their mass outside the options.)"""

    MAX_TOKENS = 16

    def __init__(self, form: Format):
        self.tokenizer = form.tokenizer
        self.lead = "" if form.chat else " "  # a base model answers after "Answer:" and a space
        self.probe = form.render("x", "q", [{"name": "a"}, {"name": "b"}], False)[0]
        self.probe_ids = self.tokenizer.encode(self.probe)
        self._cache: dict[tuple[str, ...], tuple[tuple[int, ...], ...] | None] = {}

    def ids(self, question: TypedQuestion) -> tuple[tuple[int, ...], ...] | None:
        """Each option's answer tokens in the listed order, or None: the question is listed with labels."""
        names = tuple(_text(o.get("name", o.get("level"))) for o in question.shown)
        if names not in self._cache:
            if len(self._cache) > 4096:  # request-specific names: held only while they recur
                self._cache.clear()
            self._cache[names] = self._read(names)
        return self._cache[names]

    def _read(self, names: tuple[str, ...]) -> tuple[tuple[int, ...], ...] | None:
        out = []
        for name in names:
            if not name or name != name.strip() or "\n" in name:
                return None
            ids = tuple(self.tokenizer.encode(self.lead + name))
            if not 0 < len(ids) <= self.MAX_TOKENS:
                return None
            if self.tokenizer.encode(self.probe + self.lead + name) != [*self.probe_ids, *ids]:
                return None
            out.append(ids)
        for a in out:
            if any(b != a and b[: len(a)] == a for b in out) or out.count(a) > 1:
                return None
        return tuple(out)


class TypedReader:
    """Typed questions over an engine's model: a request's states and questions → trees, and their results
    → answers, under one of CONTRACTS (the labels the tokenizer reads as single tokens, per contract)."""

    def __init__(
        self,
        tokenizer,
        buckets: Buckets,
        limits: Limits,
        calibration: Calibration | None = None,
        image_tokens: Callable | None = None,
    ):
        """image_tokens: an image part (compiler.ContentImage) → its soft tokens, for a model that reads
        images (Engine.image_tokens)."""
        if tokenizer is None:
            raise ScoringError("decisions_unsupported", "decisions need a model with a tokenizer")
        self.formats = {c.chat_version: Format(tokenizer, c, MAX_OPTIONS) for c in CONTRACTS}
        self.format = self.formats[DEFAULT_CONTRACT.chat_version]
        self.names = NameAnswers(self.formats[TYPED_NAMES.chat_version])
        self.buckets = buckets
        self.limits = limits
        self.calibration = calibration
        self.image_tokens = image_tokens

    @property
    def version(self) -> str:
        """The default contract's, as this model reads it."""
        return self.format.version

    def contract(self, settings: Settings) -> Format:
        if settings.contract is None:
            return self.format
        for c in CONTRACTS:
            if settings.contract in (c.chat_version, c.plain_version):
                return self.formats[c.chat_version]
        known = ", ".join(v for c in CONTRACTS for v in (c.chat_version, c.plain_version))
        raise ScoringError(
            "unknown_contract", f"no prompt contract {settings.contract!r} (one of: {known})", "x_contract"
        )

    def check(self, questions: list[TypedQuestion], settings: Settings, by_label: list[bool]) -> None:
        most = len(self.format.labels)
        for q, labelled in zip(questions, by_label, strict=True):
            if labelled and len(q.names) > most:
                raise ScoringError(
                    "option_count",
                    f"{len(q.names)} options; this model's tokenizer reads {most} labels as single tokens",
                    q.param,
                )
            if problem := orderings.count_error(len(q.names), settings.orderings):
                raise ScoringError("too_many_orderings", problem, "x_orderings")
        workload, calibration = settings.workload, self.calibration
        if workload is not None and (calibration is None or workload not in calibration.workloads):
            known = (
                ", ".join(sorted(calibration.workloads)) if calibration else "none: serve with --calibration"
            )
            raise ScoringError(
                "unknown_workload",
                f"no calibration for workload {workload!r} (loaded: {known})",
                "x_workload",
            )

    def plan(
        self,
        states: list,
        questions: list[TypedQuestion],
        settings: Settings,
        params: list[str],
        images: list[StateImages | None] | None = None,
    ) -> TypedPlan:
        """The trees of every state's questions; params: where each state is in the request, for errors;
        images: each state's, where it has any (its text holds an IMAGE_MARK where each stands)."""
        form = self.contract(settings)
        by_name = [self.names.ids(q) if form.contract is TYPED_NAMES else None for q in questions]
        self.check(questions, settings, [ids is None for ids in by_name])
        prefix = form.tokenizer.prefix()
        asked_per_state = sum(len(orderings.orders(len(q.names), settings.orderings)) for q in questions)
        if asked_per_state > self.limits.max_questions_per_content:
            raise ScoringError(
                "too_many_questions",
                f"{asked_per_state} prompts per state (questions x orderings); at most "
                f"{self.limits.max_questions_per_content}",
                "questions",
            )
        asked = [
            Asked(
                q.param,
                q.question,
                list(q.shown),
                orderings.orders(len(q.names), settings.orderings),
                ids is None,
            )
            for q, ids in zip(questions, by_name, strict=True)
        ]
        reads, trees = [], []
        for state, param, pictures in zip(states, params, images or [None] * len(states), strict=True):
            try:
                # The decision APIs' state budget is the buckets' (System One allows 32k tokens of state).
                trunk, branches, placed = read_state(state, asked, form, None, images=pictures)
            except ScoringError as e:
                if e.param == "state" and param != "state":
                    e.param = param
                raise
            read, read_trees = self._trees(form, trunk, branches, by_name, param, placed)
            reads.append(read)
            trees += read_trees
        plan = TypedPlan(questions, settings, reads, trees, len(prefix), form.version)
        if settings.prior:
            trunk, branches, _ = read_state("", asked, form, None, True)
            floor, floor_trees = self._trees(form, trunk, branches, by_name, "")
            plan.floor, plan.trees = floor, trees + floor_trees
        if plan.input_tokens > self.limits.max_request_tokens:
            raise ScoringError(
                "too_many_tokens",
                f"the request would read {plan.input_tokens:,} tokens; "
                f"at most {self.limits.max_request_tokens:,}",
            )
        return plan

    def _trees(
        self, form: Format, trunk, branches, answers: list, param: str, placed=()
    ) -> tuple[StateRead, list]:
        """answers: per question, its options' names' tokens as the caller listed them (NameAnswers.ids), or
        None where the answer is a label."""
        keys = [
            QuestionKey(
                o.branch_ids,
                tuple((i,) for i in form.label_ids[: len(o.order)])
                if names is None
                else tuple(names[k] for k in o.order),
            )
            for names, b in zip(answers, branches, strict=True)
            for o in b
        ]
        soft = tuple((row, self.image_tokens(part)) for row, part in placed)
        try:
            chunks = content_trees(form.tokenizer.prefix(), list(trunk), keys, self.buckets, soft)
        except ValueError as e:
            raise ScoringError("question_too_large", str(e), param) from e
        return StateRead(trunk, branches), [tree for tree, _ in chunks]

    def answers(self, plan: TypedPlan, scored: list) -> list[list[TypedAnswer]]:
        """Per state, per question (in the request's order), its answer."""
        logprobs = iter([r.option_logprobs(i) for r in scored for i in range(len(r.tree.options))])
        read = [
            [
                self._reading(question, branches, [next(logprobs) for _ in branches], plan.settings)
                for question, branches in zip(plan.questions_asked, state.branches, strict=True)
            ]
            for state in plan._reads
        ]
        floors = read.pop() if plan.floor else [None] * len(plan.questions_asked)
        for answers in read:
            for answer, floor in zip(answers, floors, strict=True):
                self._finish(answer, floor, plan.settings)
        return read

    def _finish(self, answer: TypedAnswer, floor: TypedAnswer | None, settings: Settings) -> None:
        names = answer.question.names
        if floor is not None:
            answer.floor = floor.probabilities
            lifted = np.log(answer.probabilities) - np.log(floor.probabilities)
            answer.probabilities = orderings.by_id(orderings.distribution, lifted, names)
        temperature = self.temperature(answer.question, settings)
        if temperature is not None:
            answer.temperature = temperature
            answer.calibrated = orderings.by_id(
                lambda x: apply_temperature(x, temperature), np.log(answer.probabilities), names
            )

    def temperature(self, question: TypedQuestion, settings: Settings) -> float | None:
        """The request's workload's, else the calibration file's for this type and option count, if any."""
        if self.calibration is None:
            return None
        if settings.workload is not None:
            return self.calibration.workloads[settings.workload].temperature
        return self.calibration.typed.for_question(question.kind, len(question.names))

    def _reading(
        self, question: TypedQuestion, branches, label_lp: list[np.ndarray], settings
    ) -> TypedAnswer:
        names = question.names
        # Each ordering renormalised over its labels in label order, then per option in the listed order: the
        # same prompt gives the same bits however the request listed the options.
        per_option = [
            by_option(o.order, orderings.distribution(lp)) for o, lp in zip(branches, label_lp, strict=True)
        ]
        answer = TypedAnswer(
            question,
            per_option[0],
            listed=per_option[0],
            option_mass=float(np.sum(np.exp(label_lp[0]))),
            prompt_sha256=branches[0].prompt_sha256,
        )
        if settings.orderings is not None:
            answer.combined = orderings.combine(names, [o.order for o in branches], per_option)
            answer.probabilities = np.array(answer.combined.probabilities)
        return answer

"""The decision APIs of the field over one engine: System One (`/v1/systemone`, its batch form) and OpenAI's
Decisions API (`/v1/decisions`). Each request is planned into trees (spinf_jax.typed: every question a branch
of one read of its state), scored in the engine's shared passes, and finished into its API's reply.

    apis = DecisionApis(engine)
    apis.systemone({"model": "jev-latest", "state": "...", "questions": {...}})   # Python objects in and out
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from spinf_jax import openai_decisions, systemone, typed
from spinf_jax.calibration import Calibration
from spinf_jax.compiler import Limits
from spinf_jax.decoding import convert
from spinf_jax.errors import ScoringError

if TYPE_CHECKING:
    from spinf_jax.engine import Engine, Scored

# What decision clients send as `model` for the model a server serves: System One's documented names and
# aliases, the names self-hosted servers accept, and OpenAI's only Decisions model. The reply names the model
# that answered.
ALIASES = frozenset(
    {"jev-latest", "jev-preview", "jev-1.13", "jev-1.13.0", "jev-1.14", "jev-1.14.0", "jev", "gpt-6-luna"}
)


@dataclass
class Planned:
    """A decision request's trees, and what its reply needs besides their scores."""

    plan: typed.TypedPlan
    body: systemone.Request | systemone.BatchRequest | openai_decisions.Request
    ids: list[str]  # System One's question ids, in request order

    @property
    def trees(self):
        return self.plan.trees

    @property
    def inputs(self) -> int:
        return self.plan.inputs

    @property
    def questions(self) -> int:
        return self.plan.questions


class DecisionApis:
    def __init__(
        self, engine: "Engine", limits: Limits | None = None, calibration: Calibration | None = None
    ):
        self.engine = engine
        self.limits = limits or Limits()
        self.calibration = calibration
        self._reader: typed.TypedReader | None = None

    @property
    def reader(self) -> typed.TypedReader:
        """Made on first use: it reads which labels the tokenizer has as single tokens."""
        if self._reader is None:
            model = self.engine.model
            self._reader = typed.TypedReader(
                model.tokenizer, self.engine.buckets, self.limits, self.calibration
            )
        return self._reader

    # ---- planning (worker threads)

    def plan_systemone(self, body: systemone.Request) -> Planned:
        ids, questions = systemone.questions(body.questions)
        plan = self.reader.plan([body.state], questions, systemone.settings(body), ["state"])
        return Planned(plan, body, ids)

    def plan_systemone_batch(self, body: systemone.BatchRequest) -> Planned:
        ids, questions = systemone.questions(body.questions)
        if len(body.states) > self.limits.max_inputs:
            most = self.limits.max_inputs
            raise ScoringError("too_many_inputs", f"{len(body.states):,} states; at most {most:,}", "states")
        params = [f"states[{i}]" for i in range(len(body.states))]
        return Planned(self.reader.plan(body.states, questions, systemone.settings(body), params), body, ids)

    def plan_decisions(self, body: openai_decisions.Request) -> Planned:
        questions = openai_decisions.questions(body)
        settings = typed.Settings(orderings=body.x_orderings, workload=body.x_workload)
        state = openai_decisions.state(body)
        return Planned(self.reader.plan([state], questions, settings, ["input"]), body, [])

    # ---- finishing (finisher threads)

    @property
    def model_name(self) -> str:
        return self.engine.model.name

    def _systemone_reply(self, planned: Planned, answers: list[typed.TypedAnswer], tokens: int):
        workload = planned.plan.settings.workload
        return systemone.Response(
            model=self.model_name,
            answers={qid: systemone.answer(a, workload) for qid, a in zip(planned.ids, answers, strict=True)},
            usage=systemone.Usage(input_tokens=tokens),
            x_system_fingerprint=self.engine.fingerprint,
            x_prompt_version=self.reader.version,
        )

    def finish_systemone(self, planned: Planned, scored: list["Scored"]) -> systemone.Response:
        (answers,) = self.reader.answers(planned.plan, scored)
        return self._systemone_reply(planned, answers, planned.plan.input_tokens)

    def finish_systemone_batch(self, planned: Planned, scored: list["Scored"]) -> systemone.BatchResponse:
        per_state = self.reader.answers(planned.plan, scored)
        results = [
            self._systemone_reply(planned, answers, planned.plan.state_tokens(i))
            for i, answers in enumerate(per_state)
        ]
        return systemone.BatchResponse(
            model=self.model_name,
            results=results,
            total_usage=systemone.Usage(input_tokens=planned.plan.input_tokens),
        )

    def finish_decisions(self, planned: Planned, scored: list["Scored"]) -> openai_decisions.Response:
        (answers,) = self.reader.answers(planned.plan, scored)
        body = planned.body
        return openai_decisions.Response(
            model=self.model_name,
            answers=[
                openai_decisions.answer(q, a, body.x_refusal_below)
                for q, a in zip(body.questions, answers, strict=True)
            ],
            usage=openai_decisions.usage(planned.plan.input_tokens),
            x_system_fingerprint=self.engine.fingerprint,
            x_prompt_version=self.reader.version,
        )

    # ---- the library's face: Python objects in and out

    def _run(self, body: dict, kind, plan, finish) -> dict:
        planned = plan(convert(body, kind))
        return msgspec.to_builtins(finish(planned, self.engine.score_trees(planned.trees)))

    def systemone(self, body: dict) -> dict:
        """A System One request → its reply."""
        return self._run(body, systemone.Request, self.plan_systemone, self.finish_systemone)

    def systemone_batch(self, body: dict) -> dict:
        """{states: [...], questions: {...}} → {results: [one reply per state], total_usage}."""
        return self._run(body, systemone.BatchRequest, self.plan_systemone_batch, self.finish_systemone_batch)

    def decisions(self, body: dict) -> dict:
        """An OpenAI Decisions request → its reply."""
        return self._run(body, openai_decisions.Request, self.plan_decisions, self.finish_decisions)

"""TypeSafe's System One API (`POST /v1/systemone`), as typesafe-sdk 0.7 and the jevcompat conformance suite
define it, and the batch form self-hosted servers added (`POST /v1/systemone/batch`): wire types, and the
translation to and from typed questions (spinf_jax.typed).

    {"model": "jev-latest", "state": ..., "questions": {"refund": {"type": "noul", "instructions": ...}}}
    → {"model": <served name>, "answers": {"refund": {"type": "noul", "noul": 0.93}},
       "usage": {"input_tokens": 211, "output_tokens": 0}}

Our own fields beside the standard ones are prefixed `x_` (the SDK ignores fields it does not know): on a
request `x_orderings` and `x_workload`; on each answer `x_residual` (the probability outside the options'
labels), `x_prompt_sha256`, with orderings `x_agreement` and `x_spread`, with a workload `x_calibrated`; on
the reply `x_system_fingerprint` and `x_prompt_version`.
"""

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from spinf_jax import typed
from spinf_jax.errors import ScoringError

# What a client may write where the API takes text: a string, an object or an array.
Text = str | dict[str, Any] | list[Any]
State = Annotated[Text, Meta(description="the content every question refers to: text, an object or an array")]
Orderings = Annotated[
    Literal["rotations", "all"] | None,
    Meta(description='every ordering of each question\'s options, combined ("all": up to 4 options)'),
]


class Question(Struct, kw_only=True):
    type: Annotated[
        Literal["noul", "choice", "score", "box"],
        Meta(description="noul: P(true); choice: one of named options; score: ordered levels"),
    ]
    instructions: Text | None = None
    criteria: Any = None  # by type: {"true"?, "false"?} | {name: description | null} | [level, ...]


class Asset(Struct, kw_only=True):
    type: Literal["image"]
    format: Literal["png", "jpg", "jpeg"]
    data_base64: str | None = None
    part: str | None = None


class Request(Struct, kw_only=True):
    """A System One request: questions about one state (POST /v1/systemone)."""

    model: Annotated[str | None, Meta(description="a served name, or an alias clients send (jev-latest)")] = (
        None
    )
    state: State
    questions: Annotated[dict[str, Question], Meta(description="by id; the id is never shown to the model")]
    assets: dict[str, Asset] | None = None
    x_orderings: Orderings = None
    x_workload: Annotated[str | None, Meta(description="a workload of the server's calibration file")] = None


class BatchRequest(Struct, kw_only=True):
    """The same questions about many states, packed into shared passes (POST /v1/systemone/batch)."""

    model: str | None = None
    states: Annotated[list[State], Meta(min_length=1)]
    questions: dict[str, Question]
    x_orderings: Orderings = None
    x_workload: str | None = None


class Calibrated(Struct, kw_only=True):
    workload: str
    temperature: float
    probabilities: dict[str, float]


class _Extras(Struct, kw_only=True, omit_defaults=True):
    x_residual: Annotated[float, Meta(description="the probability left outside the options' labels")]
    x_prompt_sha256: str
    x_agreement: float | None = None
    x_spread: float | None = None
    x_calibrated: Calibrated | None = None


class NoulAnswer(_Extras, kw_only=True, tag_field="type", tag="noul"):
    noul: Annotated[float, Meta(description="the probability that the answer is true (yes)")]


class ChoiceAnswer(_Extras, kw_only=True, tag_field="type", tag="choice"):
    choice: str
    probabilities: dict[str, float]
    confidence: float


class ScoreAnswer(_Extras, kw_only=True, tag_field="type", tag="score"):
    score: Annotated[float, Meta(description="Σ i·pᵢ over the levels")]
    legend: dict[str, Any]
    probabilities: dict[str, float]
    confidence: float


Answer = NoulAnswer | ChoiceAnswer | ScoreAnswer


class Usage(Struct, kw_only=True):
    input_tokens: int
    output_tokens: int = 0


class Response(Struct, kw_only=True):
    model: str
    answers: dict[str, Answer]
    usage: Usage
    x_system_fingerprint: str
    x_prompt_version: str


class BatchResponse(Struct, kw_only=True):
    model: str
    results: Annotated[list[Response], Meta(description="one per state, in request order")]
    total_usage: Usage


def questions(asked: dict[str, Question]) -> tuple[list[str], list[typed.TypedQuestion]]:
    """The request's questions as typed questions, with their ids; raises ScoringError naming the field."""
    if not asked:
        raise ScoringError("invalid_request", "questions is empty: ask at least one", "questions")
    ids, out = [], []
    for qid, q in asked.items():
        param = f"questions.{qid}"
        if not qid:
            raise ScoringError("invalid_request", "a question id is empty", "questions")
        out.append(_question(q, param))
        ids.append(qid)
    return ids, out


def _question(q: Question, param: str) -> typed.TypedQuestion:
    criteria = q.criteria
    if q.type == "box":
        raise ScoringError(
            "question_type_unsupported",
            "box questions locate things in images; this server answers noul, choice and score",
            f"{param}.type",
        )
    if q.type == "noul":
        if criteria is None:
            criteria = {}
        if not isinstance(criteria, dict) or set(criteria) - {"true", "false"}:
            raise ScoringError(
                "invalid_request", 'a noul\'s criteria is {"true": ..., "false": ...}, either side optional',
                f"{param}.criteria",
            )  # fmt: skip
        _texts(criteria.values(), f"{param}.criteria", allow_null=True)
        if q.instructions is None and not any(v is not None for v in criteria.values()):
            raise ScoringError(
                "invalid_request", "a noul needs instructions, or criteria that describe its outcomes",
                f"{param}.instructions",
            )  # fmt: skip
        return typed.noul(q.instructions, criteria.get("true"), criteria.get("false"), param)
    if q.type == "choice":
        if not isinstance(criteria, dict) or not criteria:
            raise ScoringError(
                "invalid_request", "a choice's criteria is {name: description or null} with 2 to 255 names",
                f"{param}.criteria",
            )  # fmt: skip
        if "" in criteria:
            raise ScoringError("invalid_request", "an option's name is empty", f"{param}.criteria")
        _texts(criteria.values(), f"{param}.criteria", allow_null=True)
        return typed.choice(q.instructions, list(criteria), list(criteria.values()), f"{param}.criteria")
    if not isinstance(criteria, list) or not criteria:
        raise ScoringError(
            "invalid_request", "a score's criteria is a list of level descriptions, lowest first",
            f"{param}.criteria",
        )  # fmt: skip
    _texts(criteria, f"{param}.criteria", allow_null=False)
    return typed.score(q.instructions, criteria, f"{param}.criteria")


def _texts(values, param: str, allow_null: bool) -> None:
    for v in values:
        if v is None and allow_null:
            continue
        if not isinstance(v, str | dict | list):
            raise ScoringError(
                "invalid_request", f"a description is a string, an object or an array, not {v!r:.40}", param
            )


def settings(body: Request | BatchRequest) -> typed.Settings:
    return typed.Settings(orderings=body.x_orderings, workload=body.x_workload)


def answer(a: typed.TypedAnswer, workload: str | None) -> Answer:
    q = a.question
    extras = {"x_residual": max(0.0, 1.0 - a.option_mass), "x_prompt_sha256": a.prompt_sha256}
    if a.combined is not None:
        extras.update(x_agreement=a.combined.agreement, x_spread=a.combined.spread)
    p = {name: float(x) for name, x in zip(q.names, a.probabilities, strict=True)}
    if a.calibrated is not None:
        extras["x_calibrated"] = Calibrated(
            workload=workload, temperature=a.temperature,
            probabilities={n: float(x) for n, x in zip(q.names, a.calibrated, strict=True)},
        )  # fmt: skip
    if q.kind == "noul":
        return NoulAnswer(noul=p["true"], **extras)
    if q.kind == "choice":
        return ChoiceAnswer(choice=a.top, probabilities=p, confidence=a.confidence, **extras)
    legend = {str(i): shown.get("description") for i, shown in enumerate(q.shown)}
    return ScoreAnswer(score=a.expectation, legend=legend, probabilities=p, confidence=a.confidence, **extras)

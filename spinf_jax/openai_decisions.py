"""OpenAI's Decisions API (`POST /v1/decisions`, the SDK's `client.decisions.create`): wire types, and the
translation to and from typed questions (spinf_jax.typed).

    {"model": ..., "input": "text" | [messages],
     "questions": [{"type": "predicate", "name"?, "instructions"},
                   {"type": "choice", "choices": [{"value", "description"?}], ...},
                   {"type": "score", "levels": [{"label", "description"?}], ...}]}
    → {"model", "answers": [...in question order...], "usage": {...}}

A question is answered `{"type": "refusal", "name"}` when the model puts less than REFUSAL_MASS of its
next-token probability on the options' labels: the listed options are then not what it would answer, and a
probability renormalised over them would claim more than the model said.
"""

import json
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from spinf_jax import typed
from spinf_jax.errors import ScoringError

# Below half: the model's answer is more likely something other than a listed option than any of them
# together. The share is `x_option_mass` on every answer; `x_refusal_below` sets another bar (0: never
# refuse), as small base models put much of their mass elsewhere.
REFUSAL_MASS = 0.5
MAX_QUESTIONS = 400  # the SDK's documented "1–400 questions"


class TextPart(Struct, kw_only=True, tag_field="type", tag="input_text"):
    text: str


class ImagePart(Struct, kw_only=True, tag_field="type", tag="input_image"):
    image_url: str
    detail: str | None = None


class JsonPart(Struct, kw_only=True, tag_field="type", tag="input_json"):
    data: dict[str, Any] | list[dict[str, Any]]


Part = TextPart | ImagePart | JsonPart


class Message(Struct, kw_only=True):
    role: Literal["user", "developer", "system", "assistant"]
    content: str | list[Part]
    type: Literal["message"] = "message"


class Choice(Struct, kw_only=True):
    value: str | bool
    description: str | None = None


class Level(Struct, kw_only=True):
    label: str
    description: str | None = None


class Predicate(Struct, kw_only=True, tag_field="type", tag="predicate"):
    instructions: str | list[Part]
    name: str | None = None


class ChoiceQuestion(Struct, kw_only=True, tag_field="type", tag="choice"):
    instructions: str | list[Part]
    choices: list[Choice]
    name: str | None = None


class ScoreQuestion(Struct, kw_only=True, tag_field="type", tag="score"):
    instructions: str | list[Part]
    levels: list[Level]
    name: str | None = None


Question = Predicate | ChoiceQuestion | ScoreQuestion


class Request(Struct, kw_only=True):
    model: str | None = None
    input: Annotated[str | list[Message], Meta(description="text, or messages of text, image and JSON parts")]
    questions: Annotated[list[Question], Meta(min_length=1, max_length=MAX_QUESTIONS)]
    safety_identifier: str | None = None
    x_orderings: Literal["rotations", "all"] | None = None
    x_workload: str | None = None
    x_refusal_below: Annotated[
        float, Meta(ge=0, le=1, description="refuse where the options hold less of the probability than this")
    ] = REFUSAL_MASS


class ChoiceProbability(Struct, kw_only=True):
    value: str | bool
    probability: float


class ScoreProbability(Struct, kw_only=True):
    value: int
    label: str
    probability: float


class _Extras(Struct, kw_only=True, omit_defaults=True):
    name: str | None
    x_option_mass: Annotated[float, Meta(description="the options' labels' share of the probability")] = 1.0
    x_prompt_sha256: str = ""
    x_agreement: float | None = None
    x_calibrated: list[float] | None = None


class PredicateAnswer(_Extras, kw_only=True, tag_field="type", tag="predicate"):
    probability: float


class ChoiceAnswer(_Extras, kw_only=True, tag_field="type", tag="choice"):
    choice: str | bool
    probabilities: list[ChoiceProbability]
    confidence: float


class ScoreAnswer(_Extras, kw_only=True, tag_field="type", tag="score"):
    score: float
    probabilities: list[ScoreProbability]
    confidence: float


class Refusal(_Extras, kw_only=True, tag_field="type", tag="refusal"):
    pass


Answer = PredicateAnswer | ChoiceAnswer | ScoreAnswer | Refusal


class InputDetails(Struct, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0


class Usage(Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputDetails
    output_tokens: int
    output_tokens_details: OutputDetails
    total_tokens: int


class Response(Struct, kw_only=True):
    object: Literal["decision"] = "decision"
    model: str
    answers: list[Answer]
    usage: Usage
    x_system_fingerprint: str
    x_prompt_version: str


def usage(tokens: int) -> Usage:
    return Usage(
        input_tokens=tokens, input_tokens_details=InputDetails(), output_tokens=0,
        output_tokens_details=OutputDetails(), total_tokens=tokens,
    )  # fmt: skip


def _text(parts: str | list[Part], param: str) -> str:
    """Text parts as they are, JSON parts as compact JSON, one per line; images are refused (no model that
    reads them is served on this route yet)."""
    if isinstance(parts, str):
        return parts
    out = []
    for j, part in enumerate(parts):
        if isinstance(part, ImagePart):
            raise ScoringError(
                "unsupported_content", "this route reads text and JSON parts; images are not read here",
                f"{param}[{j}]",
            )  # fmt: skip
        out.append(part.text if isinstance(part, TextPart) else json.dumps(part.data, ensure_ascii=False))
    return "\n".join(out)


def state(body: Request) -> str:
    """The input as the state every question reads: text as it is, messages' texts joined by blank lines."""
    if isinstance(body.input, str):
        return body.input
    return "\n\n".join(_text(m.content, f"input[{i}].content") for i, m in enumerate(body.input))


def questions(body: Request) -> list[typed.TypedQuestion]:
    out = []
    for i, q in enumerate(body.questions):
        param = f"questions[{i}]"
        instructions = _text(q.instructions, f"{param}.instructions")
        if isinstance(q, Predicate):
            out.append(typed.noul(instructions, param=param))
        elif isinstance(q, ChoiceQuestion):
            # Values are typed: "true" and true are two options; each is shown as the JSON it is.
            names = [json.dumps(c.value, ensure_ascii=False) for c in q.choices]
            if len(set(names)) < len(names):
                raise ScoringError("duplicate_option", "each choice must be unique", f"{param}.choices")
            descriptions = [c.description for c in q.choices]
            values = [c.value for c in q.choices]
            out.append(typed.choice(instructions, names, descriptions, f"{param}.choices", shown_as=values))
        else:
            levels = [
                lv.label if lv.description is None else f"{lv.label}: {lv.description}" for lv in q.levels
            ]
            out.append(typed.score(instructions, levels, f"{param}.levels"))
    return out


def answer(q: Question, a: typed.TypedAnswer, refusal_below: float = REFUSAL_MASS) -> Answer:
    extras = {"name": q.name, "x_option_mass": a.option_mass, "x_prompt_sha256": a.prompt_sha256}
    if a.combined is not None:
        extras["x_agreement"] = a.combined.agreement
    if a.calibrated is not None:
        extras["x_calibrated"] = [float(x) for x in a.calibrated]
    if a.option_mass < refusal_below:
        return Refusal(**extras)
    p = [float(x) for x in a.probabilities]
    if isinstance(q, Predicate):
        return PredicateAnswer(probability=p[0], **extras)
    if isinstance(q, ChoiceQuestion):
        probabilities = [
            ChoiceProbability(value=c.value, probability=x) for c, x in zip(q.choices, p, strict=True)
        ]
        top = q.choices[a.probabilities.argmax()].value
        return ChoiceAnswer(choice=top, probabilities=probabilities, confidence=a.confidence, **extras)
    probabilities = [
        ScoreProbability(value=i, label=lv.label, probability=x)
        for i, (lv, x) in enumerate(zip(q.levels, p, strict=True))
    ]
    return ScoreAnswer(score=a.expectation, probabilities=probabilities, confidence=a.confidence, **extras)

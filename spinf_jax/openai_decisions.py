"""OpenAI's Decisions API (`POST /v1/decisions`, the SDK's `client.decisions.create`): the wire types
(spinf_jax.decision_apis translates them to typed questions and back).

    {"model": ..., "input": "text" | [messages],
     "questions": [{"type": "predicate", "name"?, "instructions"},
                   {"type": "choice", "choices": [{"value", "description"?}], ...},
                   {"type": "score", "levels": [{"label", "description"?}], ...}]}
    → {"model", "answers": [...in question order...], "usage": {...}}

A question is answered `{"type": "refusal", "name"}` when the model puts less than REFUSAL_MASS of its
next-token probability on the options' labels: the listed options are then not what it would answer, and a
probability renormalised over them would claim more than the model said.
"""

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from spinf_jax.systemone import PromptContract

# Below half: the model's answer is more likely something other than a listed option than any of them
# together. The share is `x_option_mass` on every answer; `x_refusal_below` sets another bar (0: never
# refuse), as small base models put much of their mass elsewhere.
REFUSAL_MASS = 0.5
MAX_QUESTIONS = 400  # the SDK's documented "1–400 questions"


class InputTextPart(Struct, kw_only=True, tag_field="type", tag="input_text"):
    text: str


class InputImagePart(Struct, kw_only=True, tag_field="type", tag="input_image"):
    image_url: str
    detail: str | None = None


class InputJsonPart(Struct, kw_only=True, tag_field="type", tag="input_json"):
    data: dict[str, Any] | list[dict[str, Any]]


InputPart = InputTextPart | InputImagePart | InputJsonPart


class InputMessage(Struct, kw_only=True):
    role: Literal["user", "developer", "system", "assistant"]
    content: str | list[InputPart]
    type: Literal["message"] = "message"


class DecisionsChoice(Struct, kw_only=True):
    value: str | bool
    description: str | None = None


class DecisionsLevel(Struct, kw_only=True):
    label: str
    description: str | None = None


class PredicateQuestion(Struct, kw_only=True, tag_field="type", tag="predicate"):
    instructions: str | list[InputPart]
    name: str | None = None


class ChoiceQuestion(Struct, kw_only=True, tag_field="type", tag="choice"):
    instructions: str | list[InputPart]
    choices: list[DecisionsChoice]
    name: str | None = None


class ScoreQuestion(Struct, kw_only=True, tag_field="type", tag="score"):
    instructions: str | list[InputPart]
    levels: list[DecisionsLevel]
    name: str | None = None


DecisionsQuestion = PredicateQuestion | ChoiceQuestion | ScoreQuestion


class DecisionsRequest(Struct, kw_only=True):
    model: str | None = None
    input: Annotated[
        str | list[InputMessage], Meta(description="text, or messages of text, image and JSON parts")
    ]
    questions: Annotated[list[DecisionsQuestion], Meta(min_length=1, max_length=MAX_QUESTIONS)]
    safety_identifier: str | None = None
    x_orderings: Literal["rotations", "all"] | None = None
    x_workload: str | None = None
    x_prior: Annotated[bool, Meta(description="divide by each question's floor (an empty input)")] = False
    x_contract: PromptContract = None
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


class _DecisionsExtras(Struct, kw_only=True, omit_defaults=True):
    name: str | None
    x_option_mass: Annotated[float, Meta(description="the options' labels' share of the probability")] = 1.0
    x_prompt_sha256: str = ""
    x_agreement: float | None = None
    x_calibrated: list[float] | None = None


class PredicateAnswer(_DecisionsExtras, kw_only=True, tag_field="type", tag="predicate"):
    probability: float


class DecisionsChoiceAnswer(_DecisionsExtras, kw_only=True, tag_field="type", tag="choice"):
    choice: str | bool
    probabilities: list[ChoiceProbability]
    confidence: float


class DecisionsScoreAnswer(_DecisionsExtras, kw_only=True, tag_field="type", tag="score"):
    score: float
    probabilities: list[ScoreProbability]
    confidence: float


class RefusalAnswer(_DecisionsExtras, kw_only=True, tag_field="type", tag="refusal"):
    pass


DecisionsAnswer = PredicateAnswer | DecisionsChoiceAnswer | DecisionsScoreAnswer | RefusalAnswer


class InputTokensDetails(Struct, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0


class DecisionsUsage(Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class DecisionsResponse(Struct, kw_only=True):
    object: Literal["decision"] = "decision"
    model: str
    answers: list[DecisionsAnswer]
    usage: DecisionsUsage
    x_system_fingerprint: str
    x_prompt_version: str


def usage(tokens: int) -> DecisionsUsage:
    return DecisionsUsage(
        input_tokens=tokens, input_tokens_details=InputTokensDetails(), output_tokens=0,
        output_tokens_details=OutputTokensDetails(), total_tokens=tokens,
    )  # fmt: skip

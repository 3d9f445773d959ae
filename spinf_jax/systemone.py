"""TypeSafe's System One API (`POST /v1/systemone`), as typesafe-sdk 0.7 and the jevcompat conformance suite
define it, and the batch form self-hosted servers added (`POST /v1/systemone/batch`): the wire types
(spinf_jax.decision_apis translates them to typed questions and back).

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

# What a client may write where the API takes text: a string, an object or an array.
Text = str | dict[str, Any] | list[Any]
State = Annotated[Text, Meta(description="the content every question refers to: text, an object or an array")]
Orderings = Annotated[
    Literal["rotations", "all"] | None,
    Meta(description='every ordering of each question\'s options, combined ("all": up to 4 options)'),
]

Prior = Annotated[
    bool,
    Meta(description="divide by each question's probabilities on an empty state (its floor), renormalised"),
]

PromptContract = Annotated[
    str | None,
    Meta(
        description="the prompt contract: typed-options-v1 (labels read) or typed-names-v1 (the options' "
        "names read); the plain forms' names also accepted; null: the server's default"
    ),
]


class SystemOneQuestion(Struct, kw_only=True):
    type: Annotated[
        Literal["noul", "choice", "score", "box"],
        Meta(description="noul: P(true); choice: one of named options; score: ordered levels"),
    ]
    instructions: Text | None = None
    criteria: Any = None  # by type: {"true"?, "false"?} | {name: description | null} | [level, ...]


class SystemOneAsset(Struct, kw_only=True):
    """An image a reference to which (the asset's key in `assets`) stands in the state."""

    type: Literal["image"]
    format: Literal["png", "jpg", "jpeg"] | None = None
    data_base64: str | None = None
    part: Annotated[str | None, Meta(description="a multipart body's part holding the file")] = None


class SystemOneRequest(Struct, kw_only=True):
    """A System One request: questions about one state (POST /v1/systemone)."""

    model: Annotated[str | None, Meta(description="a served name, or an alias clients send (jev-latest)")] = (
        None
    )
    state: State
    questions: Annotated[
        dict[str, SystemOneQuestion], Meta(description="by id; the id is never shown to the model")
    ]
    assets: dict[str, SystemOneAsset] | None = None
    x_orderings: Orderings = None
    x_workload: Annotated[str | None, Meta(description="a workload of the server's calibration file")] = None
    x_prior: Prior = False
    x_contract: PromptContract = None


class SystemOneBatchRequest(Struct, kw_only=True):
    """The same questions about many states, packed into shared passes (POST /v1/systemone/batch)."""

    model: str | None = None
    states: Annotated[list[State], Meta(min_length=1)]
    questions: dict[str, SystemOneQuestion]
    x_orderings: Orderings = None
    x_workload: str | None = None
    x_prior: Prior = False
    x_contract: PromptContract = None


class SystemOneCalibrated(Struct, kw_only=True):
    workload: Annotated[str | None, Meta(description="the request's; null: the file's typed temperatures")]
    temperature: float
    probabilities: dict[str, float]


class _SystemOneExtras(Struct, kw_only=True, omit_defaults=True):
    x_residual: Annotated[float, Meta(description="the probability left outside the options' labels")]
    x_prompt_sha256: str
    x_listed: Annotated[
        dict[str, float] | None, Meta(description="with x_orderings or x_prior: the listed order's, as read")
    ] = None
    x_agreement: float | None = None
    x_spread: float | None = None
    x_floor: Annotated[dict[str, float] | None, Meta(description="with x_prior: on an empty state")] = None
    x_calibrated: SystemOneCalibrated | None = None


class NoulAnswer(_SystemOneExtras, kw_only=True, tag_field="type", tag="noul"):
    noul: Annotated[float, Meta(description="the probability that the answer is true (yes)")]


class SystemOneChoiceAnswer(_SystemOneExtras, kw_only=True, tag_field="type", tag="choice"):
    choice: str
    probabilities: dict[str, float]
    confidence: float


class SystemOneScoreAnswer(_SystemOneExtras, kw_only=True, tag_field="type", tag="score"):
    score: Annotated[float, Meta(description="Σ i·pᵢ over the levels")]
    legend: dict[str, Any]
    probabilities: dict[str, float]
    confidence: float


SystemOneAnswer = NoulAnswer | SystemOneChoiceAnswer | SystemOneScoreAnswer


class SystemOneUsage(Struct, kw_only=True):
    input_tokens: int
    output_tokens: int = 0


class SystemOneResponse(Struct, kw_only=True):
    model: str
    answers: dict[str, SystemOneAnswer]
    usage: SystemOneUsage
    x_system_fingerprint: str
    x_prompt_version: str


class SystemOneBatchResponse(Struct, kw_only=True):
    model: str
    results: Annotated[list[SystemOneResponse], Meta(description="one per state, in request order")]
    total_usage: SystemOneUsage

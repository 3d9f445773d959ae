"""The API's bodies (SPEC sections 1-3) as msgspec Structs: what a request decodes into, what a response
encodes from, and what Litestar documents at /schema. Litestar documents a field's Meta description, not a
Struct's docstring: what a client needs to read is said on the fields.

Decoding checks what JSON can say (types, required fields, lists that must not be empty); the compiler checks
what the request means (slots, placeholders, options, limits). Optional fields are None when absent, and null
counts as absent: OpenAI-style clients send null for "not given". Unknown fields are ignored, so a body
written for the hosted API, or a chat completion with generation settings, decodes as it is.
"""

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from spinf_jax.errors import CODES

# ---------------------------------------------------------------------------------------------------------
# The request (SPEC section 1)


class TextPart(Struct, kw_only=True, tag_field="type", tag="text"):
    text: str


# Parts for models that read more than text (image_url: Gemma 3 with its vision tower reads
# {"url": "data:image/...;base64,..."}); models that read text only answer them with unsupported_content.
class ImagePart(Struct, kw_only=True, tag_field="type", tag="image_url"):
    image_url: dict[str, Any] | None = None


class AudioPart(Struct, kw_only=True, tag_field="type", tag="input_audio"):
    input_audio: dict[str, Any] | None = None


class VideoPart(Struct, kw_only=True, tag_field="type", tag="video_url"):
    video_url: dict[str, Any] | None = None


ContentPart = TextPart | ImagePart | AudioPart | VideoPart


class Message(Struct, kw_only=True):
    role: Annotated[str | None, Meta(description="ignored: no chat template is applied")] = None
    content: Annotated[
        str | list[ContentPart],
        Meta(
            description="a string, or a list of parts: text, and image_url / input_audio / video_url for "
            "models that read them (text-only models answer those with unsupported_content)"
        ),
    ]


Messages = Annotated[
    list[Message],
    Meta(
        min_length=1, description='one content: every message\'s text, joined with "\\n"; roles are ignored'
    ),
]


class Query(Struct, kw_only=True, forbid_unknown_fields=True):
    """A closed question: a template read right after the content, and the options scored at its slot."""

    id: Annotated[str, Meta(min_length=1, description="names the query in the results; unique per content")]
    template: Annotated[
        str,
        Meta(
            description="text that ends in exactly one slot: {?} (score the options), or {*} (text), {n} (a "
            "number), {$} (an amount), which may be followed by a short closing text; up to 5 {name} "
            "placeholders; {{ and }} are literal braces; at most 256 tokens once filled"
        ),
    ]
    options: (
        Annotated[
            list[str],
            Meta(
                min_length=1,
                description="for a {?} slot: 1 to 1,000 options of 1 to 5 tokens each, written as they "
                'continue the template (" yes"), no two equal ignoring case',
            ),
        ]
        | None
    ) = None
    combinations: Annotated[
        Annotated[list[dict[str, str]], Meta(min_length=1)] | Literal["all"] | None,
        Meta(
            description='the placeholders\' values: a list of {name: value} objects, or "all" for every '
            "combination of `values` (at most 1,000 per query); absent for a template without placeholders"
        ),
    ] = None
    values: Annotated[
        dict[str, Annotated[list[str], Meta(min_length=1)]] | None,
        Meta(description='with combinations "all": {name: [values]}'),
    ] = None
    mode: Annotated[
        Literal["search", "generate"] | None,
        Meta(
            description="for an extraction slot: search lists the most likely answers (beam search); "
            "generate writes one answer greedily; absent: search"
        ),
    ] = None
    max_answers: Annotated[
        int | None, Meta(description="for a searched extraction slot: answers listed, 1 to 8; absent: 5")
    ] = None
    max_tokens: Annotated[
        int | None,
        Meta(
            description="for an extraction slot: tokens of an answer, its closing text not counted; 1 to 32 "
            "searched (absent: 16), 1 to 128 generated (absent: 64)"
        ),
    ] = None
    floor: Annotated[
        bool | None,
        Meta(
            description="for an extraction slot: decode it on empty content too (floor_answers); "
            "absent: false"
        ),
    ] = None
    orderings: Annotated[
        Literal["rotations", "all"] | None,
        Meta(
            description="for a {?} slot whose template lists the options where {options} stands: also ask "
            'them listed in other orders ("rotations", or "all" up to 4 options), each a branch of the same '
            "read; each combination then has `combined`"
        ),
    ] = None
    workload: Annotated[
        str | None,
        Meta(
            description="for a {?} slot: a workload of the server's calibration file; each combination then "
            "has `calibrated` (its temperature, choice rule and thresholds)"
        ),
    ] = None


class Scoring(Struct, kw_only=True, forbid_unknown_fields=True):
    queries: Annotated[
        list[Query] | None,
        Meta(
            description="asked of every content (of an input, those it names in query_ids); at most 10,000 "
            "questions (templates x combinations) per content"
        ),
    ] = None
    empty_floor: Annotated[
        bool | None,
        Meta(description="score each question on empty content too (floor_p, floor_residual); absent: true"),
    ] = None


class Input(Struct, kw_only=True, forbid_unknown_fields=True):
    """One of several contents, asked the scoring queries (or those it names) and its own."""

    id: Annotated[str, Meta(min_length=1, description="its results' input_id; absent: its index")] | None = (
        None
    )
    messages: Messages
    query_ids: Annotated[
        list[str] | None, Meta(description="ask only these of scoring.queries; absent: all of them")
    ] = None
    queries: Annotated[list[Query] | None, Meta(description="questions for this content only")] = None


class PackRef(Struct, kw_only=True, forbid_unknown_fields=True):
    id: Annotated[
        str, Meta(description="a loaded pack's id (GET /v1/packs lists them), such as spinf/moderation")
    ]
    version: Annotated[str | None, Meta(description="refuse the request unless this version is loaded")] = (
        None
    )
    categories: Annotated[
        Annotated[list[str], Meta(min_length=1)] | None,
        Meta(description="ask only the questions of these categories, and decide over them; absent: all"),
    ] = None
    cells: Annotated[bool | None, Meta(description="also list each question's value and score")] = None


class ScoreRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """Closed questions about one content (`messages`) or several (`inputs`)."""

    model: Annotated[str | None, Meta(description="a served model's name; absent: the served model")] = None
    messages: Messages | None = None
    inputs: (
        Annotated[
            list[Input],
            Meta(
                min_length=1, description="several contents instead of messages; results come in this order"
            ),
        ]
        | None
    ) = None
    scoring: Annotated[Scoring | None, Meta(description="required, unless packs ask the questions")] = None
    packs: Annotated[
        list[PackRef] | None,
        Meta(description="preloaded prompt packs whose questions are asked in the same read"),
    ] = None


class ChatCompletionRequest(ScoreRequest, kw_only=True, forbid_unknown_fields=False):
    """The scoring request as the OpenAI SDKs send it: scoring, inputs and packs travel in extra_body. Its
    top level takes the chat fields the SDKs send (temperature, max_tokens, ...) and ignores them."""

    stream: Annotated[
        bool | None, Meta(description="scores are not streamed: true answers streaming_unsupported")
    ] = None


# ---------------------------------------------------------------------------------------------------------
# The response (SPEC section 2)


class OptionScore(Struct, kw_only=True, omit_defaults=True):
    text: str
    logprob: Annotated[float, Meta(description="log P(the option's tokens | content + filled template)")]
    p: Annotated[float, Meta(description="exp(logprob) renormalised over the listed options")]
    floor_p: Annotated[float | None, Meta(description="p on empty content; absent without the floor")] = None


class Answer(Struct, kw_only=True, omit_defaults=True):
    """One of the most likely answers at an extraction slot ({*}, {n}, {$})."""

    text: Annotated[str, Meta(description="the answer as written, without its closing text, spaces trimmed")]
    p: Annotated[float, Meta(description="exp(logprob) renormalised over the listed answers")]
    logprob: Annotated[
        float | None,
        Meta(description="log P(the answer's tokens and its closing text or end | content + template)"),
    ] = None
    value: Annotated[
        float | None, Meta(description="the number, for {n} (a percentage as a fraction) and {$} answers")
    ] = None
    currency: Annotated[str | None, Meta(description="ISO 4217, for {$} answers where one is written")] = None


class ScoreCalibrated(Struct, kw_only=True):
    workload: str
    temperature: float
    probabilities: Annotated[list[float], Meta(description="per option: p at the workload's temperature")]
    choice: Annotated[
        str,
        Meta(
            description="the option that the rule picks: the most likely, or the most lifted over its floor"
        ),
    ]
    rule: Literal["argmax", "floor_lift"]
    above_threshold: Annotated[
        list[str],
        Meta(
            description="the options whose calibrated p reaches its threshold (fitted for a target precision)"
        ),
    ] = []


class CombinationResult(Struct, kw_only=True, omit_defaults=True):
    values: Annotated[dict[str, str], Meta(description="the placeholders' values; {} when there are none")]
    options: Annotated[list[OptionScore] | None, Meta(description="for a {?} slot, in request order")] = None
    residual: Annotated[
        float | None,
        Meta(description="1 - Σ exp(logprob) over the options or answers: the mass elsewhere, clamped at 0"),
    ] = None
    floor_residual: Annotated[float | None, Meta(description="residual on empty content")] = None
    answers: Annotated[
        list[Answer] | None, Meta(description="for an extraction slot: the most likely answers, best first")
    ] = None
    floor_answers: Annotated[
        list[Answer] | None, Meta(description="for an extraction slot asked with floor: on empty content")
    ] = None
    calibrated: Annotated[ScoreCalibrated | None, Meta(description="for a query with a workload")] = None
    combined: Annotated[
        "Combined | None",
        Meta(description="for a query with orderings: their log-mean (top: an option's text)"),
    ] = None


class QueryResult(Struct, kw_only=True):
    id: str
    combinations: Annotated[list[CombinationResult], Meta(description="one per combination, in order")]


class CategoryScore(Struct, kw_only=True):
    id: str
    score: float


class FiredRule(Struct, kw_only=True):
    category: str
    at_least: float
    label: str


class PackDecision(Struct, kw_only=True):
    label: Annotated[str, Meta(description="the pack's decision, such as allow, review or block")]
    rules: Annotated[list[FiredRule], Meta(description="the rules that fired (none: the mildest label)")] = []


class PackCell(Struct, kw_only=True, omit_defaults=True):
    question: str
    option: str
    value: Annotated[float, Meta(description="the option's p, lift p - floor_p, or log-lift (the pack says)")]
    score: Annotated[float, Meta(description="the value calibrated against normal traffic")]
    p: float
    floor_p: float | None = None


class PackResult(Struct, kw_only=True, omit_defaults=True):
    id: str
    version: Annotated[str | None, Meta(description="the pack's version (always sent by this server)")] = None
    categories: list[CategoryScore]
    decision: PackDecision
    cells: Annotated[list[PackCell] | None, Meta(description='with "cells": true')] = None


class InputResult(Struct, kw_only=True, omit_defaults=True):
    input_id: Annotated[str, Meta(description="the input's id, or its index as a string")]
    queries: list[QueryResult]
    packs: Annotated[list[PackResult] | None, Meta(description="one per pack asked for")] = None


class ScoringWarning(Struct, kw_only=True):
    code: Annotated[
        Literal["low_option_mass"],
        Meta(description="the options hold under 5% of the probability at the slot"),
    ]
    input_id: str
    query_id: str
    message: str


class TokenDetails(Struct, kw_only=True):
    content_tokens: int
    query_tokens: int
    floor_tokens: int
    decode_tokens: Annotated[
        int, Meta(description="tokens fed while decoding extraction slots (every hypothesis, every step)")
    ] = 0
    image_tokens: Annotated[
        int, Meta(description="of content_tokens, the images' soft tokens (models that read images)")
    ] = 0
    audio_tokens: Annotated[
        int, Meta(description="of content_tokens, the audio clips' soft tokens (models that hear audio)")
    ] = 0
    video_tokens: Annotated[
        int, Meta(description="of content_tokens, the video frames' soft tokens (models that read video)")
    ] = 0


class Usage(Struct, kw_only=True):
    prompt_tokens: Annotated[
        int, Meta(description="tokens read: contents, questions, floors (decode tokens not included)")
    ]
    prompt_tokens_details: TokenDetails


class _Scores(Struct, kw_only=True):
    """What a scoring response and a chat completion share; each names its `object`."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: Annotated[
        str, Meta(description="changes whenever scores could change; equal fingerprints compare bit for bit")
    ]
    results: Annotated[list[InputResult], Meta(description="one per content, in request order")]
    warnings: list[ScoringWarning]
    usage: Usage


class ScoreResponse(_Scores, kw_only=True):
    object: Literal["score"] = "score"


# ---------------------------------------------------------------------------------------------------------
# Decisions (SPEC section 5)

State = Annotated[
    str | dict[str, Any] | list[Any],
    Meta(
        description="what is decided over: text, or a JSON object or array (written into the prompt as JSON)"
    ),
]
Orderings = Annotated[
    Literal["rotations", "all"] | None,
    Meta(
        description="also ask the options in other orders, each a branch of the same read, and combine them: "
        '"rotations" (n orders) or "all" (n!, up to 4 options); absent: the order listed only'
    ),
]
Workload = Annotated[
    str | None,
    Meta(description="a workload of the server's calibration file: adds `calibrated` (its temperature)"),
]


class DecisionOption(Struct, kw_only=True, forbid_unknown_fields=True):
    id: Annotated[str, Meta(min_length=1, description="names the option in the reply")]
    description: Annotated[str, Meta(description="what the model reads beside the option's letter")]


class DecisionQuestion(Struct, kw_only=True, forbid_unknown_fields=True):
    """One typed question: pick exactly one option (2 to 16, lettered A to P in the prompt)."""

    id: Annotated[str, Meta(min_length=1, description="names the decision in the reply")]
    question: Annotated[str, Meta(min_length=1, description="the criterion applied to the state")]
    options: list[DecisionOption]
    orderings: Orderings = None
    workload: Workload = None


class DecideRequest(DecisionQuestion, kw_only=True):
    """A decision over a state (POST /decide)."""

    model: Annotated[str | None, Meta(description="a served model's name; absent: the served model")] = None
    state: State


class SharedDecideRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """Many decisions over one state, which is read once (POST /decide/shared)."""

    model: Annotated[str | None, Meta(description="a served model's name; absent: the served model")] = None
    state: State
    decisions: Annotated[list[DecisionQuestion], Meta(min_length=1)]
    workload: Annotated[
        str | None, Meta(description="every decision's workload, unless a decision names its own")
    ] = None


class DecisionModel(Struct, kw_only=True):
    name: str
    digest: Annotated[str, Meta(description="sha256 of the checkpoint's files")]
    precision: str
    versions: "Versions"


class OrderingResult(Struct, kw_only=True):
    order: Annotated[list[str], Meta(description="the option ids in letter order (A first)")]
    probabilities: Annotated[list[float], Meta(description="per option, in the request's order")]
    option_logits: list[float]
    prompt_sha256: str


class Combined(Struct, kw_only=True):
    method: Literal["log-mean"]
    orderings: Annotated[int, Meta(description="how many orderings were combined")]
    probabilities: Annotated[
        list[float], Meta(description="per option: the orderings' mean log-probability, renormalised")
    ]
    top: Annotated[str, Meta(description="the most likely option's id (a query's: its text)")]
    agreement: Annotated[
        float,
        Meta(description="the share of orderings whose most likely option is `top`: a confidence signal"),
    ]
    spread: Annotated[
        float,
        Meta(description="the largest range, over options, of an option's probability across orderings"),
    ]


class Calibrated(Struct, kw_only=True):
    workload: str
    temperature: float
    probabilities: Annotated[
        list[float],
        Meta(description="`combined` (or, without orderings, the native) probabilities at the temperature"),
    ]
    top: Annotated[str, Meta(description="the same option as uncalibrated: a temperature keeps the order")]


class DecisionResult(Struct, kw_only=True, omit_defaults=True):
    id: str
    option_ids: list[str]
    probabilities: Annotated[
        list[float], Meta(description="per option: the letters' probabilities renormalised over the letters")
    ]
    option_logits: Annotated[
        list[float],
        Meta(
            description="per option: its letter's log-probability at the answer's first position (its logit "
            "less the position's log-normaliser, which softmax cancels)"
        ),
    ]
    prompt_sha256: Annotated[
        str, Meta(description="sha256 of the prompt's text, options in the listed order")
    ]
    prompt_version: Annotated[
        str, Meta(description="direct-options-v1 (chat template) or direct-options-plain-v1 (base model)")
    ]
    model: DecisionModel
    input_tokens: Annotated[int, Meta(description="the prompt's tokens, as one forward would read them")]
    system_fingerprint: str
    orderings: Annotated[
        list[OrderingResult] | None, Meta(description="with orderings: each one's result")
    ] = None
    combined: Annotated[Combined | None, Meta(description="with orderings: their combination")] = None
    calibrated: Annotated[Calibrated | None, Meta(description="with a workload")] = None


class SharedDecisions(Struct, kw_only=True):
    id: str
    object: Literal["decision.list"] = "decision.list"
    created: int
    model: DecisionModel
    system_fingerprint: str
    state_tokens: Annotated[
        int, Meta(description="the prompt's tokens up to the end of the state, read once")
    ]
    processed_tokens: Annotated[int, Meta(description="every token of the pass: the state once, each branch")]
    results: Annotated[list[DecisionResult], Meta(description="one per decision, in request order")]


# ---------------------------------------------------------------------------------------------------------
# The OpenAI-compatible surface and the server (SPEC section 3)


class ChatUsage(Usage, kw_only=True):
    completion_tokens: Annotated[int, Meta(description="the decode tokens of extraction slots")] = 0
    total_tokens: Annotated[int, Meta(description="prompt_tokens + completion_tokens")]


class ChatCompletion(_Scores, kw_only=True):
    object: Literal["chat.completion"] = "chat.completion"
    usage: ChatUsage
    choices: Annotated[
        list[dict[str, Any]], Meta(max_length=0, description="always empty: the scores are in results")
    ]


class ModelCard(Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class DecisionModelCard(Struct, kw_only=True):
    """A model as System One's SDK lists it."""

    name: str
    description: str
    release_date: Annotated[str, Meta(description="YYYY-MM-DD: when this server made it ready")]


class ModelList(Struct, kw_only=True):
    """OpenAI's `data` and System One's `models` in one body, so that both SDKs list the served models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    models: list[DecisionModelCard]


class Versions(Struct, kw_only=True):
    spinf_jax: str
    jax: str
    backend: str


class DeviceMemory(Struct, kw_only=True, omit_defaults=True):
    needed_bytes: Annotated[
        int,
        Meta(description="the largest pass's peak by XLA's buffer assignment: weights, inputs, temporaries"),
    ]
    in_use_bytes: Annotated[
        int | None, Meta(description="the allocator's count now (GPUs; absent on CPUs)")
    ] = None
    peak_bytes: Annotated[int | None, Meta(description="the allocator's peak since start (GPUs)")] = None
    limit_bytes: Annotated[int | None, Meta(description="what the allocator may take (GPUs)")] = None


class PackInfo(Struct, kw_only=True, omit_defaults=True):
    id: str
    version: str
    description: str
    source: Annotated[str, Meta(description='"official", a folder, or a git URL')]
    commit: Annotated[str | None, Meta(description="the commit a git source was pinned to")] = None
    questions: int
    categories: list[str]
    labels: Annotated[list[str], Meta(description="the decision's labels, mildest first")]
    calibrated_on: list[str] = []


class PackList(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[PackInfo]


class ReplicaHealth(Struct, kw_only=True, omit_defaults=True):
    """One replica of `serve --devices` (docs/scale-out.md)."""

    index: int
    device: Annotated[str, Meta(description="platform:id, as gpu:0 or cpu:1")]
    state: Literal["starting", "ready", "down", "failed"]
    in_flight: Annotated[int, Meta(description="requests the front has sent it and not had answered")]
    restarts: Annotated[int, Meta(description="times its process exited and was started again")]
    error: str | None = None
    memory: DeviceMemory | None = None


class Health(Struct, kw_only=True, omit_defaults=True):
    """The server's state; 503 until the model is loaded and compiled (with `serve --devices`, 200 once one
    replica is ready)."""

    status: Literal["ok", "warming_up", "error"]
    ready: bool
    model: str
    served_names: list[str]
    precision: str
    versions: Versions
    error: Annotated[str | None, Meta(description="why the model failed to load")] = None
    system_fingerprint: str | None = None
    fingerprint_parts: Annotated[
        dict[str, str] | None,
        Meta(
            description="what system_fingerprint hashes, by name (checkpoint, precision, engine, jax, "
            "device, XLA_FLAGS, CUDA libraries or the CPU's extensions): where two servers' fingerprints "
            "differ, why"
        ),
    ] = None
    buckets: Annotated[list[int] | None, Meta(description="the compiled pass sizes, in tokens")] = None
    pass_seconds: Annotated[
        list[float] | None,
        Meta(description="what a pass of each bucket takes, measured at start: what batches are cut by"),
    ] = None
    compiling: Annotated[
        list[int] | None,
        Meta(description="pass sizes still compiling after the server became ready; in `buckets` once done"),
    ] = None
    limits: Annotated[
        dict[str, int | float | bool] | None,
        Meta(description="the request limits, max_body_bytes included (allow_remote_media: a flag)"),
    ] = None
    memory: DeviceMemory | None = None
    packs: Annotated[list[PackInfo] | None, Meta(description="the prompt packs requests may name")] = None
    workloads: Annotated[
        dict[str, float] | None, Meta(description="the calibration file's workloads and their temperatures")
    ] = None
    device: Annotated[str | None, Meta(description="the device this server scores on, as gpu:0")] = None
    replicas: Annotated[
        list[ReplicaHealth] | None,
        Meta(description="with `serve --devices`: each replica; `memory` is theirs"),
    ] = None


class ProfileRequest(Struct, kw_only=True):
    """POST /v1/admin/profile: trace the served traffic for a while (a server started with --profile-dir)."""

    seconds: Annotated[float, Meta(gt=0, le=300, description="how long to trace, at most 300")] = 10.0


class ProfileResult(Struct, kw_only=True):
    trace_dir: Annotated[
        str,
        Meta(
            description="the folder on the server's machine holding the trace: XProf/TensorBoard read it; "
            "plugins/profile/*/*.trace.json.gz has its Chrome trace events"
        ),
    ]
    seconds: Annotated[float, Meta(description="how long the profiler was on")]
    held_seconds: Annotated[
        float,
        Meta(
            description="how long no pass was launched because of the profile: the waits for the device to "
            "finish its batch before the profiler turned on and off, and the turning"
        ),
    ]


ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "not_found_error",
    "rate_limit_error",
    "not_supported_error",
    "overloaded_error",
    "server_error",
]


class ErrorDetail(Struct, kw_only=True):
    type: ErrorType
    code: Literal[tuple(CODES)]  # the table in docs/api.md
    message: str
    param: Annotated[
        str | None, Meta(description="the offending field, as inputs[2].queries[0].template; null for none")
    ]


class ErrorEnvelope(Struct, kw_only=True):
    """Every failure, with its HTTP status."""

    error: ErrorDetail
    request_id: str

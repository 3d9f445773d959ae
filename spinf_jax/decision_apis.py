"""The decision APIs of the field over one engine: System One (`/v1/systemone`, its batch form) and OpenAI's
Decisions API (`/v1/decisions`). Each request is planned into trees (spinf_jax.typed: every question a branch
of one read of its state), scored in the engine's shared passes, and finished into its API's reply.

    apis = DecisionApis(engine)
    apis.systemone({"model": "jev-latest", "state": "...", "questions": {...}})   # Python objects in and out
"""

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from spinf_jax import media, openai_decisions, systemone, typed
from spinf_jax.calibration import Calibration
from spinf_jax.compiler import IMAGE_MARK, ContentImage, Limits, MediaFormats
from spinf_jax.decisions import StateImages
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
    body: systemone.SystemOneRequest | systemone.SystemOneBatchRequest | openai_decisions.DecisionsRequest
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
                model.tokenizer, self.engine.buckets, self.limits, self.calibration, self._image_tokens
            )
        return self._reader

    def _image_tokens(self, part: ContentImage):
        try:
            return self.engine.image_tokens(part.digest, part.data, part.param + part.url)
        except media.MediaError as e:
            raise ScoringError(e.code, str(e), part.param + part.url) from None

    def _formats(self, param: str) -> MediaFormats:
        model = self.engine.model
        if model.image_format is None:
            raise ScoringError("unsupported_content", "this model reads no images", param)
        return MediaFormats(model.image_format, model.audio_format)

    def _asset_images(self, body: systemone.SystemOneRequest):
        """The state with an IMAGE_MARK where each asset's reference stands, and its images in that order."""
        formats = self._formats("assets")
        images = {}
        for ref, asset in body.assets.items():
            where = f"assets.{ref}"
            if asset.data_base64 is None:
                raise ScoringError(
                    "invalid_media", "an asset needs data_base64 (or a multipart part)", where + ".part"
                )
            try:
                data = base64.b64decode(asset.data_base64, validate=True)
            except (binascii.Error, ValueError) as e:
                raise ScoringError(
                    "invalid_media", f"not valid base64 ({e})", where + ".data_base64"
                ) from None
            most = self.limits.max_image_bytes
            if len(data) > most:
                raise ScoringError(
                    "invalid_media", f"{len(data):,} bytes; an image is at most {most:,}", where
                )
            images[ref] = ContentImage(data, where, url=".data_base64")
        return marked(body.state, images, formats, self.limits)

    # ---- planning (worker threads)

    def plan_systemone(self, body: systemone.SystemOneRequest) -> Planned:
        ids, questions = systemone_questions(body.questions)
        state, images = self._asset_images(body) if body.assets else (body.state, None)
        plan = self.reader.plan([state], questions, systemone_settings(body), ["state"], [images])
        return Planned(plan, body, ids)

    def plan_systemone_batch(self, body: systemone.SystemOneBatchRequest) -> Planned:
        ids, questions = systemone_questions(body.questions)
        if len(body.states) > self.limits.max_inputs:
            most = self.limits.max_inputs
            raise ScoringError("too_many_inputs", f"{len(body.states):,} states; at most {most:,}", "states")
        params = [f"states[{i}]" for i in range(len(body.states))]
        return Planned(self.reader.plan(body.states, questions, systemone_settings(body), params), body, ids)

    def plan_decisions(self, body: openai_decisions.DecisionsRequest) -> Planned:
        questions = openai_questions(body)
        settings = typed.Settings(body.x_orderings, body.x_workload, body.x_prior, body.x_contract)
        state, images = self._input(body)
        return Planned(self.reader.plan([state], questions, settings, ["input"], [images]), body, [])

    def _input(self, body: openai_decisions.DecisionsRequest) -> tuple[str, StateImages | None]:
        """The input as the state every question reads: text as it is, messages' parts joined by blank lines
        and newlines, an image part an IMAGE_MARK where it stands."""
        if isinstance(body.input, str):
            return body.input, None
        found: list[ContentImage] = []
        texts, formats = [], None
        for i, message in enumerate(body.input):
            param = f"input[{i}].content"
            parts = (
                [openai_decisions.InputTextPart(text=message.content)]
                if isinstance(message.content, str)
                else message.content
            )
            pieces = []
            for j, part in enumerate(parts):
                if isinstance(part, openai_decisions.InputImagePart):
                    where = f"{param}[{j}]"
                    formats = self._formats(where)
                    try:
                        found.append(
                            ContentImage(
                                media.decode_data_url(part.image_url, where), where, url=".image_url"
                            )
                        )
                    except media.MediaError as e:
                        raise ScoringError(e.code, str(e), where + ".image_url") from None
                    pieces.append(IMAGE_MARK)
                elif isinstance(part, openai_decisions.InputTextPart):
                    pieces.append(_no_mark(part.text, f"{param}[{j}].text"))
                else:
                    pieces.append(json.dumps(part.data, ensure_ascii=False))
            texts.append("\n".join(pieces))
        _check_count(found, self.limits, "input")
        return "\n\n".join(texts), StateImages(tuple(found), formats) if found else None

    # ---- finishing (finisher threads)

    @property
    def model_name(self) -> str:
        return self.engine.model.name

    def _systemone_reply(self, planned: Planned, answers: list[typed.TypedAnswer], tokens: int):
        workload = planned.plan.settings.workload
        return systemone.SystemOneResponse(
            model=self.model_name,
            answers={qid: systemone_answer(a, workload) for qid, a in zip(planned.ids, answers, strict=True)},
            usage=systemone.SystemOneUsage(input_tokens=tokens),
            x_system_fingerprint=self.engine.fingerprint,
            x_prompt_version=planned.plan.version,
        )

    def finish_systemone(self, planned: Planned, scored: list["Scored"]) -> systemone.SystemOneResponse:
        (answers,) = self.reader.answers(planned.plan, scored)
        return self._systemone_reply(planned, answers, planned.plan.input_tokens)

    def finish_systemone_batch(
        self, planned: Planned, scored: list["Scored"]
    ) -> systemone.SystemOneBatchResponse:
        per_state = self.reader.answers(planned.plan, scored)
        results = [
            self._systemone_reply(planned, answers, planned.plan.state_tokens(i))
            for i, answers in enumerate(per_state)
        ]
        return systemone.SystemOneBatchResponse(
            model=self.model_name,
            results=results,
            total_usage=systemone.SystemOneUsage(input_tokens=planned.plan.input_tokens),
        )

    def finish_decisions(
        self, planned: Planned, scored: list["Scored"]
    ) -> openai_decisions.DecisionsResponse:
        (answers,) = self.reader.answers(planned.plan, scored)
        body = planned.body
        return openai_decisions.DecisionsResponse(
            model=self.model_name,
            answers=[
                openai_answer(q, a, body.x_refusal_below)
                for q, a in zip(body.questions, answers, strict=True)
            ],
            usage=openai_decisions.usage(planned.plan.input_tokens),
            x_system_fingerprint=self.engine.fingerprint,
            x_prompt_version=planned.plan.version,
        )

    # ---- the library's face: Python objects in and out

    def _run(self, body: dict, kind, plan, finish) -> dict:
        planned = plan(convert(body, kind))
        return msgspec.to_builtins(finish(planned, self.engine.score_trees(planned.trees)))

    def systemone(self, body: dict) -> dict:
        """A System One request → its reply."""
        return self._run(body, systemone.SystemOneRequest, self.plan_systemone, self.finish_systemone)

    def systemone_batch(self, body: dict) -> dict:
        """{states: [...], questions: {...}} → {results: [one reply per state], total_usage}."""
        return self._run(
            body, systemone.SystemOneBatchRequest, self.plan_systemone_batch, self.finish_systemone_batch
        )

    def decisions(self, body: dict) -> dict:
        """An OpenAI Decisions request → its reply."""
        return self._run(body, openai_decisions.DecisionsRequest, self.plan_decisions, self.finish_decisions)


@dataclass
class SystemOneBatches:
    """System One batches as `spinf-jax score --systemone` asks them in process (spinf_jax.bulk.in_process):
    a `/v1/systemone/batch` body planned, its plan finished."""

    apis: DecisionApis

    @property
    def engine(self) -> "Engine":
        return self.apis.engine

    def plan(self, body: dict) -> Planned:
        return self.apis.plan_systemone_batch(convert(body, systemone.SystemOneBatchRequest))

    def finish(self, planned: Planned, scored: list["Scored"]) -> systemone.SystemOneBatchResponse:
        return self.apis.finish_systemone_batch(planned, scored)


# ---------------------------------------------------------------------------------------------------------
# System One ↔ typed questions


def systemone_questions(
    asked: dict[str, systemone.SystemOneQuestion],
) -> tuple[list[str], list[typed.TypedQuestion]]:
    """The request's questions as typed questions, with their ids; raises ScoringError naming the field."""
    if not asked:
        raise ScoringError("invalid_request", "questions is empty: ask at least one", "questions")
    ids, out = [], []
    for qid, q in asked.items():
        param = f"questions.{qid}"
        if not qid:
            raise ScoringError("invalid_request", "a question id is empty", "questions")
        out.append(_systemone_question(q, param))
        ids.append(qid)
    return ids, out


def _systemone_question(q: systemone.SystemOneQuestion, param: str) -> typed.TypedQuestion:
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


def systemone_settings(body: systemone.SystemOneRequest | systemone.SystemOneBatchRequest) -> typed.Settings:
    return typed.Settings(body.x_orderings, body.x_workload, body.x_prior, body.x_contract)


def systemone_answer(a: typed.TypedAnswer, workload: str | None) -> systemone.SystemOneAnswer:
    q = a.question

    def by_name(values) -> dict[str, float]:
        return {name: float(x) for name, x in zip(q.names, values, strict=True)}

    extras = {"x_residual": max(0.0, 1.0 - a.option_mass), "x_prompt_sha256": a.prompt_sha256}
    if a.combined is not None:
        extras.update(x_agreement=a.combined.agreement, x_spread=a.combined.spread)
    if a.combined is not None or a.floor is not None:
        extras["x_listed"] = by_name(a.listed)
    if a.floor is not None:
        extras["x_floor"] = by_name(a.floor)
    p = by_name(a.probabilities)
    if a.calibrated is not None:
        extras["x_calibrated"] = systemone.SystemOneCalibrated(
            workload=workload, temperature=a.temperature, probabilities=by_name(a.calibrated)
        )
    if q.kind == "noul":
        return systemone.NoulAnswer(noul=p["true"], **extras)
    if q.kind == "choice":
        return systemone.SystemOneChoiceAnswer(
            choice=a.top, probabilities=p, confidence=a.confidence, **extras
        )
    legend = {str(i): shown.get("description") for i, shown in enumerate(q.shown)}
    return systemone.SystemOneScoreAnswer(
        score=a.expectation, legend=legend, probabilities=p, confidence=a.confidence, **extras
    )


# ---------------------------------------------------------------------------------------------------------
# OpenAI's Decisions API ↔ typed questions


def _openai_text(parts: str | list[openai_decisions.InputPart], param: str) -> str:
    """A question's instructions: text parts as they are, JSON parts as compact JSON, one per line."""
    if isinstance(parts, str):
        return parts
    out = []
    for j, part in enumerate(parts):
        if isinstance(part, openai_decisions.InputImagePart):
            raise ScoringError("unsupported_content", "images are read in the input only", f"{param}[{j}]")
        out.append(
            part.text
            if isinstance(part, openai_decisions.InputTextPart)
            else json.dumps(part.data, ensure_ascii=False)
        )
    return "\n".join(out)


def openai_questions(body: openai_decisions.DecisionsRequest) -> list[typed.TypedQuestion]:
    out = []
    for i, q in enumerate(body.questions):
        param = f"questions[{i}]"
        instructions = _openai_text(q.instructions, f"{param}.instructions")
        if isinstance(q, openai_decisions.PredicateQuestion):
            out.append(typed.noul(instructions, param=param))
        elif isinstance(q, openai_decisions.ChoiceQuestion):
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


def openai_answer(
    q: openai_decisions.DecisionsQuestion, a: typed.TypedAnswer, refusal_below: float
) -> openai_decisions.DecisionsAnswer:
    extras = {"name": q.name, "x_option_mass": a.option_mass, "x_prompt_sha256": a.prompt_sha256}
    if a.combined is not None:
        extras["x_agreement"] = a.combined.agreement
    if a.calibrated is not None:
        extras["x_calibrated"] = [float(x) for x in a.calibrated]
    if a.option_mass < refusal_below:
        return openai_decisions.RefusalAnswer(**extras)
    p = [float(x) for x in a.probabilities]
    if isinstance(q, openai_decisions.PredicateQuestion):
        return openai_decisions.PredicateAnswer(probability=p[0], **extras)
    if isinstance(q, openai_decisions.ChoiceQuestion):
        probabilities = [
            openai_decisions.ChoiceProbability(value=c.value, probability=x)
            for c, x in zip(q.choices, p, strict=True)
        ]
        top = q.choices[a.probabilities.argmax()].value
        return openai_decisions.DecisionsChoiceAnswer(
            choice=top, probabilities=probabilities, confidence=a.confidence, **extras
        )
    probabilities = [
        openai_decisions.ScoreProbability(value=i, label=lv.label, probability=x)
        for i, (lv, x) in enumerate(zip(q.levels, p, strict=True))
    ]
    return openai_decisions.DecisionsScoreAnswer(
        score=a.expectation, probabilities=probabilities, confidence=a.confidence, **extras
    )


# ---------------------------------------------------------------------------------------------------------
# Images in a state


def _no_mark(text: str, param: str) -> str:
    if IMAGE_MARK in text:
        raise ScoringError("invalid_request", "U+FFFC (the object replacement character) marks images", param)
    return text


def marked(state, images: dict[str, ContentImage], formats: MediaFormats, limits: Limits):
    """The state with an IMAGE_MARK for each reference to an image in its strings (System One puts an asset's
    reference, its key in `assets`, where the image stands), and the images in the order the marks stand in
    its text (strings in order, an object's values in its order, as the state is written as JSON)."""
    pattern = re.compile("|".join(re.escape(ref) for ref in sorted(images, key=len, reverse=True)))
    order: list[ContentImage] = []

    def walk(value, param: str):
        if isinstance(value, str):
            _no_mark(value, param)
            return pattern.sub(lambda m: order.append(images[m.group(0)]) or IMAGE_MARK, value)
        if isinstance(value, dict):
            return {k: walk(v, f"{param}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, f"{param}[{i}]") for i, v in enumerate(value)]
        return value

    state = walk(state, "state")
    unused = set(images) - {image.param.removeprefix("assets.") for image in order}
    if unused:
        raise ScoringError(
            "invalid_request", f"asset {sorted(unused)[0]!r} is not referenced in the state", "assets"
        )
    _check_count(order, limits, "state")
    return state, StateImages(tuple(order), formats)


def _check_count(images: list, limits: Limits, param: str) -> None:
    if len(images) > limits.max_images_per_content:
        raise ScoringError(
            "too_many_images", f"{len(images)} images; at most {limits.max_images_per_content}", param
        )

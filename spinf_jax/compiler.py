"""A decoded scoring request (SPEC section 1, spinf_jax.api.ScoreRequest) → token ids, or a ScoringError
naming the API's code and the field.

Decoding (spinf_jax.decoding) has checked the JSON types; this checks the meaning, in three steps: the rules
that need no tokens (one slot per template, placeholders and their values, options, ids, limits) while every
query is expanded into its filled templates, then one tokenizer batch for every distinct string of the
request, then what needs tokens (lengths, option boundaries) while building the immutable CompiledRequest the
engine reads. Knows nothing of the model beyond its tokenizer and, for models that read media, how an image
stands in the content (spinf_jax.media.ImageFormat).
"""

import base64
import binascii
import dataclasses
import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from spinf_jax import api, audio, media, orderings
from spinf_jax.answers import vocabulary
from spinf_jax.audio import AudioFormat
from spinf_jax.calibration import Calibration
from spinf_jax.errors import ScoringError, excerpt
from spinf_jax.layout import (
    MAX_ANSWER_TOKENS,
    MAX_CLOSING_TOKENS,
    MAX_GENERATED_TOKENS,
    SEARCH_WIDTH,
    Extract,
    QuestionKey,
)
from spinf_jax.media import ImageFormat, PatchedImages

if TYPE_CHECKING:
    from spinf_jax.packs.compiled import CompiledPack


class Slot(StrEnum):
    """The template's slot: what the model is asked for there."""

    SCORE = "{?}"
    TEXT = "{*}"
    NUMBER = "{n}"
    AMOUNT = "{$}"


@dataclass(frozen=True)
class Limits:
    max_content_tokens: int = 4096
    # templates x combinations, counted per content (the scoring queries it asks for + its own queries)
    max_questions_per_content: int = 10_000
    max_template_tokens: int = 256  # a filled template, up to its slot
    max_options: int = 1000
    max_option_tokens: int = 5
    max_combinations: int = 1000  # per query
    max_placeholders: int = 5
    max_inputs: int = 10_000
    # Processed tokens per request (contents, questions, floors), charged as the trees are built
    # (spinf_jax.scoring); the compiler's own work is bounded by the body's size.
    max_request_tokens: int = 2_000_000
    # For models that read images. An image file, decoded from its data URL: what a 2 MiB body holds in base64
    # (the hosted API's body limit); Gemma 3 reads every image at 896×896, which a JPEG holds in ~200 KB.
    max_images_per_content: int = 16  # each takes its soft tokens of the content's tokens
    max_image_bytes: int = 1_500_000
    # https:// image URLs are fetched only when allowed (`serve --allow-remote-media`): the server then
    # reaches any address a request names. Each file within max_image_bytes and this many seconds.
    allow_remote_media: bool = False
    remote_media_timeout_s: float = 10.0
    # For models that hear audio (Gemma 4 E2B/E4B). A clip is at most 30 s (what the model reads of one); a
    # content's clips together at most this long (25 soft tokens a second), each file at most this large.
    max_audio_seconds_per_content: float = 120.0
    max_audio_bytes: int = 1_500_000
    # For models that read video as frames (Gemma 4): the frames of a content's videos together (Gemma 4's
    # video processor samples 32 a video), each an image file within max_image_bytes.
    max_video_frames_per_content: int = 32

    def reported(self, formats: "MediaFormats | None" = None) -> dict[str, int | float | bool]:
        """The limits a server reports (/health): those on images, audio and video only for a model that
        reads them (`formats`: how it does; None: text only)."""
        formats = formats or MediaFormats()
        skip = (() if formats.image else IMAGE_LIMITS) + (() if formats.audio else AUDIO_LIMITS)
        skip += () if formats.video else VIDEO_LIMITS
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}


IMAGE_LIMITS = ("max_images_per_content", "max_image_bytes", "allow_remote_media", "remote_media_timeout_s")
VIDEO_LIMITS = ("max_video_frames_per_content",)
AUDIO_LIMITS = ("max_audio_seconds_per_content", "max_audio_bytes")


@dataclass(frozen=True)
class Question:
    """One query x one combination."""

    query_id: str
    values: dict[str, str]  # the combination's placeholder values ({} when none)
    template_ids: tuple[int, ...]
    options: tuple[str, ...]  # option texts as given
    option_ids: tuple[tuple[int, ...], ...]
    extract: Extract | None = None  # an extraction slot's settings (then no options)
    floor: bool = False  # also asked on empty content

    @cached_property
    def key(self) -> QuestionKey:
        """What its scores depend on besides the content (the floor cache's key); built once per question,
        which every content of a request shares."""
        return QuestionKey(self.template_ids, self.option_ids, self.extract)


@dataclass(frozen=True)
class Query:
    id: str
    slot: Slot
    questions: tuple[Question, ...]  # one per combination (per combination and ordering), in order
    workload: str | None = None  # its calibration (spinf_jax.calibration), for a {?} slot
    # With orderings: the option orders each combination is asked in (spinf_jax.orderings), the listed order
    # first; a combination's questions follow each other in this order.
    orders: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class PackAsk:
    """A prompt pack asked of one content: the categories asked, the questions they need, and where the pack
    presents the content in its own way (a wrapper), the wrapped content's tokens (a read of its own)."""

    pack: "CompiledPack"
    categories: tuple[str, ...]
    queries: tuple[Query, ...]
    content_ids: tuple[int, ...] | None  # None: the pack's questions share the content's read
    cells: bool
    media: "MediaParts" = ()  # the wrapped content's


@dataclass(frozen=True)
class ContentImage:
    """An image part of a content, or a frame of a video part: its file, read by the scorer (once per
    distinct file), and its field (`param` + `url`: where errors about it point)."""

    data: bytes
    param: str
    url: str = ".image_url.url"
    frame: bool = False  # a video's frame: read at the video budget (MediaFormats.video)

    @cached_property
    def digest(self) -> str:
        return media.digest(self.data)

    def soft_count(self, fmt: ImageFormat) -> int:
        """How many soft tokens the model reads this image as (from its size: its header is read here, the
        whole file when the engine reads it)."""
        where = self.param + self.url
        try:
            return fmt.soft_count(media.image_size(self.data, where), where)
        except media.MediaError as e:
            raise ScoringError(e.code, str(e), where) from None


@dataclass(frozen=True)
class ContentAudio:
    """An audio part of a content: its file and format, its samples at the model's rate (decoded when the
    request is compiled: their count is the clip's soft-token count), and its field."""

    data: bytes
    format: str  # input_audio.format: "wav" | "mp3"
    param: str
    features: audio.FeatureConfig

    @cached_property
    def digest(self) -> str:
        return media.digest(self.data)

    @cached_property
    def samples(self) -> np.ndarray:
        where = self.param + ".input_audio.data"
        try:
            return audio.read(self.data, self.format, where, self.features)
        except media.MediaError as e:
            raise ScoringError(e.code, str(e), where) from None

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.features.sampling_rate

    def soft_count(self, fmt: AudioFormat) -> int:
        return audio.soft_token_count(len(self.samples), fmt.features)


@dataclass(frozen=True)
class ContentVideo:
    """A video part of a content: its frames (ContentImage, frame=True), `fps` of them a second."""

    frames: tuple[ContentImage, ...]
    fps: float
    param: str

    def stamps(self) -> list[str]:
        """The text before each frame, as Gemma 4's processor writes a video: "mm:ss " (the frame's time in
        whole seconds), frames after the first joined by a space."""
        times = [k / self.fps for k in range(len(self.frames))]
        return [(" " if k else "") + f"{int(t // 60):02d}:{int(t % 60):02d} " for k, t in enumerate(times)]


@dataclass(frozen=True)
class MediaFormats:
    """How the model reads media parts: images (spinf_jax.media.ImageFormat), audio clips
    (spinf_jax.audio.AudioFormat) and, where its images are Gemma 4's, videos as frames; None where it does
    not."""

    image: ImageFormat | None = None
    audio: AudioFormat | None = None

    @cached_property
    def video(self) -> PatchedImages | None:
        """A video's frames: images read at the video budget, for a model with a video token (Gemma 4)."""
        image = self.image
        return image.frames() if isinstance(image, PatchedImages) and image.video_id is not None else None

    @property
    def gap(self) -> str:
        """Text around an image (the image format's; none for audio)."""
        return self.image.gap if self.image is not None else ""


# Media in a content: (the row of the part's first soft token among the content's tokens, the part).
MediaParts = tuple[tuple[int, "ContentImage | ContentAudio"], ...]


@dataclass(frozen=True)
class Content:
    input_id: str
    content_ids: tuple[int, ...]  # tokens(content text), no BOS; an image's tokens where it is
    queries: tuple[Query, ...]
    param: str  # its messages field, which errors about the content name
    packs: tuple[PackAsk, ...] = ()
    media: MediaParts = ()

    def reads(self) -> list[tuple[tuple[int, ...], MediaParts, tuple[Query, ...]]]:
        """The reads of this content: (content tokens, their media, the queries asked of them). The first
        holds its own queries and those of packs that share it; each wrapping pack adds its own."""
        shared = self.queries + tuple(q for ask in self.packs if ask.content_ids is None for q in ask.queries)
        wrapped = [
            (ask.content_ids, ask.media, ask.queries) for ask in self.packs if ask.content_ids is not None
        ]
        return [(self.content_ids, self.media, shared), *wrapped]


@dataclass(frozen=True)
class CompiledRequest:
    model: str | None
    contents: tuple[Content, ...]


def _invalid(param: str | None, message: str) -> ScoringError:
    return ScoringError("invalid_request", message, param)


# ---------------------------------------------------------------------------------------------------------
# Content


# Where an image part is in a content's text (U+FFFC, the object replacement character): media_content_ids
# puts the image's tokens there.
IMAGE_MARK = "\ufffc"


def render_content(
    messages: list[api.Message],
    param: str,
    found: list | None = None,
    limits: Limits | None = None,
    formats: MediaFormats = MediaFormats(),
) -> str:
    """The content's text: every message's text, joined with "\\n". Roles are ignored; no chat template.
    A media part the model reads (`formats`) becomes IMAGE_MARK, the part (ContentImage, ContentAudio)
    appended to `found`; `limits` say whether https:// images are fetched."""
    limits = limits or Limits()
    return "\n".join(
        _message_text(m, f"{param}[{i}]", found, limits, formats) for i, m in enumerate(messages)
    )


def _message_text(message: api.Message, param: str, found, limits: Limits, formats: MediaFormats) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = enumerate(message.content)
    return "\n".join(_part_text(part, f"{param}.content[{k}]", found, limits, formats) for k, part in parts)


def _part_text(part: api.ContentPart, param: str, found, limits: Limits, formats: MediaFormats) -> str:
    if isinstance(part, api.TextPart):
        return part.text
    if isinstance(part, api.AudioPart) and formats.audio is not None:
        found.append(_audio_part(part, param, formats.audio))
        return IMAGE_MARK
    if isinstance(part, api.VideoPart) and formats.video is not None:
        found.append(_video_part(part, param, limits))
        return IMAGE_MARK
    if isinstance(part, api.ImagePart) and formats.image is not None:
        url = (part.image_url or {}).get("url")
        where = param + ".image_url.url"
        if not isinstance(url, str):
            raise _invalid(where, "an image part needs image_url.url: a data:image/... URL")
        try:
            found.append(ContentImage(_image_bytes(url, where, limits), param))
        except media.MediaError as e:
            raise ScoringError(e.code, str(e), where) from None
        return IMAGE_MARK
    kinds = ["text"] + ["images"] * (formats.image is not None) + ["audio"] * (formats.audio is not None)
    kinds += ["video"] * (formats.video is not None)
    reads = " and ".join(kinds) if len(kinds) > 1 else "text only"
    raise ScoringError(
        "unsupported_content",
        f"content parts of type {part.__struct_config__.tag!r} are not supported: this model reads {reads}",
        param,
    )


def _audio_part(part: api.AudioPart, param: str, fmt: AudioFormat) -> ContentAudio:
    """An input_audio part: {"data": base64, "format": "wav" | "mp3"} (OpenAI's form)."""
    given = part.input_audio or {}
    data, kind = given.get("data"), given.get("format")
    if not isinstance(data, str) or not data:
        raise _invalid(param + ".input_audio.data", "an audio part needs input_audio.data: a file in base64")
    if kind not in fmt.formats:
        raise ScoringError(
            "unsupported_media",
            f"input_audio.format {kind!r}: one of {', '.join(map(repr, fmt.formats))}",
            param + ".input_audio.format",
        )
    try:
        return ContentAudio(base64.b64decode(data, validate=True), kind, param, fmt.features)
    except (binascii.Error, ValueError) as e:
        raise ScoringError(
            "invalid_media", f"input_audio.data is not valid base64 ({e})", param + ".input_audio.data"
        ) from None


def _video_part(part: api.VideoPart, param: str, limits: Limits) -> ContentVideo:
    """A video_url part given as its frames: {"frames": [image URLs, as an image part's], "fps": frames a
    second (1 if not given)}. A video file is not decoded here."""
    given = part.video_url or {}
    frames, fps = given.get("frames"), given.get("fps", 1.0)
    if frames is None and "url" in given:
        raise ScoringError(
            "unsupported_media",
            "video files are not decoded: send the video as its frames, video_url.frames: a list of "
            "data:image/...;base64 URLs (and video_url.fps, frames a second)",
            param + ".video_url.url",
        )
    if not isinstance(frames, list) or not frames or not all(isinstance(f, str) for f in frames):
        raise _invalid(
            param + ".video_url.frames", "a video part needs video_url.frames: a list of image URLs"
        )
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not fps > 0:
        raise _invalid(param + ".video_url.fps", "video_url.fps is a number of frames a second above 0")
    parts = []
    for k, url in enumerate(frames):
        where = f"{param}.video_url.frames[{k}]"
        try:
            parts.append(ContentImage(_image_bytes(url, where, limits), where, url="", frame=True))
        except media.MediaError as e:
            raise ScoringError(e.code, str(e), where) from None
    return ContentVideo(tuple(parts), float(fps), param)


def _image_bytes(url: str, param: str, limits: Limits) -> bytes:
    """An image part's file: from its data URL, or fetched from its https:// URL where the server allows."""
    if not url.startswith(("https://", "http://")):
        return media.decode_data_url(url, param)
    if not limits.allow_remote_media:
        raise media.MediaError(
            "remote_media_disabled",
            f"{param}: this server fetches no image URLs (started without --allow-remote-media); send the "
            "image as a data:image/...;base64 URL",
        )
    return media.fetch(url, param, max_bytes=limits.max_image_bytes, timeout_s=limits.remote_media_timeout_s)


def _media_pieces(text: str, parts: tuple, param: str, formats: MediaFormats) -> list[str]:
    """Every text piece media_content_ids tokenises for a content with media: the text around them, the gap
    text, videos' time stamps."""
    stamps = [s for p in parts if isinstance(p, ContentVideo) for s in p.stamps()]
    return [*_text_pieces(text, parts, param), formats.gap, *stamps]


def _text_pieces(text: str, parts: tuple, param: str) -> list[str]:
    """A content's text around its media parts: len(parts) + 1 pieces."""
    pieces = text.split(IMAGE_MARK)
    if len(pieces) != len(parts) + 1:  # the mark was in the text itself
        raise _invalid(
            param, "U+FFFC (the object replacement character) cannot be in the text of a content with images"
        )
    return pieces


def media_content_ids(
    text: str,
    parts: tuple,
    ids: Mapping[str, tuple[int, ...]],
    formats: MediaFormats,
    param: str,
) -> tuple[tuple[int, ...], MediaParts]:
    """The tokens of a content's text with each media part's where it stands, as the model's processor
    expands it: an image as the image format's gap text, its start token, its soft tokens, its end token,
    the gap text; an audio clip as its start token, its soft tokens, its end token; a video as each frame's
    time stamp (ContentVideo.stamps), start token, video tokens and end token. Each piece of text is
    tokenised on its own."""
    if not parts:
        return ids[text], ()
    out, placed = [], []
    pieces = _text_pieces(text, parts, param)
    gap = ids[formats.gap] if formats.gap else ()
    for piece, part in zip(pieces, parts, strict=False):
        if isinstance(part, ContentVideo):
            out += ids[piece]
            fmt = formats.video
            for stamp, frame in zip(part.stamps(), part.frames, strict=True):
                out += [*ids[stamp], fmt.start_id]
                placed.append((len(out), frame))
                out += [fmt.video_id] * frame.soft_count(fmt) + [fmt.end_id]
            continue
        fmt = formats.audio if isinstance(part, ContentAudio) else formats.image
        around = () if isinstance(part, ContentAudio) else gap
        soft_id = fmt.audio_id if isinstance(part, ContentAudio) else fmt.image_id
        out += [*ids[piece], *around, fmt.start_id]
        placed.append((len(out), part))
        out += [soft_id] * part.soft_count(fmt) + [fmt.end_id, *around]
    out += ids[pieces[-1]]
    return tuple(out), tuple(placed)


# ---------------------------------------------------------------------------------------------------------
# Templates

_TEMPLATE_TOKEN = re.compile(r"\{\{|\}\}|\{[^{}]*\}|[{}]")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SLOTS = {slot.value: slot for slot in Slot}


def parse_template(
    template: str, param: str, max_placeholders: int = Limits.max_placeholders
) -> tuple[list[str | tuple[str]], Slot, str]:
    """Literal text (str) and placeholders ((name,)) up to the slot, the slot, and the closing text after it
    ("" when none; only an extraction slot may have one)."""
    parts: list[str | tuple[str]] = []
    literal, names, pos, slot = [], set(), 0, None
    for match in _TEMPLATE_TOKEN.finditer(template):
        literal.append(template[pos : match.start()])
        pos, token = match.end(), match.group()
        if token in ("{{", "}}"):
            literal.append(token[0])
        elif token in ("{", "}"):
            raise _bad_template(
                param, f"unbalanced {token!r} at character {match.start()} (write {token * 2})"
            )
        elif token in _SLOTS:
            if slot is not None:
                hint = " ({n} is the number slot: rename the placeholder)" if slot is Slot.NUMBER else ""
                raise ScoringError(
                    "too_many_slots", f"exactly one slot; found {token} after {slot.value}{hint}", param
                )
            parts.append("".join(literal))
            literal, slot = [], _SLOTS[token]
        elif _NAME.fullmatch(token[1:-1]):
            if slot is not None:
                raise _bad_template(param, f"placeholder {token} after the slot: the closing text is literal")
            parts += ["".join(literal), (token[1:-1],)]
            literal = []
            names.add(token[1:-1])
            if len(names) > max_placeholders:
                raise _bad_template(param, f"at most {max_placeholders} distinct placeholders")
        else:
            raise ScoringError(
                "unknown_slot",
                f"{token} is neither a slot ({{?}}, {{*}}, {{n}}, {{$}}) nor a placeholder (letters, digits "
                "and _)",
                param,
            )
    if slot is None:
        raise _bad_template(param, "the template needs one slot: {?}, {*}, {n} or {$}")
    closing = "".join([*literal, template[pos:]])
    if slot is Slot.SCORE and closing:
        raise _bad_template(
            param, "the {?} slot ends the template (its options follow it); found text after it"
        )
    return [p for p in parts if p != ""], slot, closing


def _bad_template(param: str, message: str) -> ScoringError:
    return ScoringError("invalid_template", message, param)


def _fill(parts: list[str | tuple[str]], values: dict[str, str]) -> str:
    return "".join(p if isinstance(p, str) else values[p[0]] for p in parts)


# ---------------------------------------------------------------------------------------------------------
# Queries: structure first, tokens later


@dataclass
class _Spec:
    """A query that passed the structural checks, before tokenisation."""

    id: str
    slot: Slot
    param: str  # where the query sits, e.g. "scoring.queries[2]"
    combinations: list[dict[str, str]]
    fills: list[str]  # the template filled with each combination (and ordering), up to its slot
    options: list[str]
    closing: str = ""  # an extraction slot's closing text
    extract: Extract | None = None  # its settings, closing_ids not filled in yet
    floor: bool = False  # an extraction slot asked on empty content too
    workload: str | None = None
    orders: list[tuple[int, ...]] | None = None  # with orderings (then fills are combinations x orders)


def _parse_queries(queries: list[api.Query], param: str, limits: Limits, taken: set[str]) -> list[_Spec]:
    """A list of queries; their ids must be new to `taken` and to each other (`taken` is updated)."""
    specs = []
    for j, query in enumerate(queries):
        spec = _parse_query(query, f"{param}[{j}]", limits)
        if spec.id in taken:
            raise _invalid(f"{param}[{j}].id", f"query id {spec.id!r} is used twice")
        taken.add(spec.id)
        specs.append(spec)
    return specs


def _parse_query(query: api.Query, param: str, limits: Limits) -> _Spec:
    parts, slot, closing = parse_template(query.template, param + ".template", limits.max_placeholders)
    names = list(dict.fromkeys(p[0] for p in parts if isinstance(p, tuple)))
    if query.orderings is not None:  # {options} lists the options, in each ordering's order
        if slot is not Slot.SCORE:
            raise _invalid(param + ".orderings", "orderings go with a {?} slot")
        if LISTED not in names:
            raise _bad_template(
                param + ".template", f"orderings need the template to list the options: write {{{LISTED}}}"
            )
        names.remove(LISTED)
    combinations = _combinations(query, names, param, limits)
    options = _options(query.options, slot, param + ".options", limits)
    orders = None
    if query.orderings is not None:
        if problem := orderings.count_error(len(options), query.orderings):
            raise ScoringError("too_many_orderings", problem, param + ".orderings")
        orders = orderings.orders(len(options), query.orderings)
        fills = [_fill(parts, values | {LISTED: _listing(options, order)}) for values in combinations
                 for order in orders]  # fmt: skip
    else:
        fills = [_fill(parts, values) for values in combinations]
    extract = _extraction(query, slot, param)
    if extract is not None and not closing and parts and isinstance(parts[-1], str):
        closing = _IMPLIED_CLOSING.get(parts[-1][-1], "")  # A: "{*} ends at the closing quote
    if query.workload is not None and slot is not Slot.SCORE:
        raise _invalid(param + ".workload", "a workload calibrates the options of a {?} slot")
    return _Spec(
        query.id,
        slot,
        param,
        combinations,
        fills,
        options,
        closing,
        extract,
        bool(query.floor),
        query.workload,
        orders,
    )


# An extraction slot right after an opening quote or bracket, with no closing text of its own, ends at the
# matching one: SPEC's `A: "{*}` asks for the text between the quotes.
_IMPLIED_CLOSING = {'"': '"', "'": "'", "“": "”", "‘": "’", "«": "»", "(": ")", "[": "]", "`": "`"}


_KINDS = {Slot.TEXT: "text", Slot.NUMBER: "number", Slot.AMOUNT: "amount"}
_EXTRACTION_FIELDS = ("mode", "max_answers", "max_tokens", "floor")


def _extraction(query: api.Query, slot: Slot, param: str) -> Extract | None:
    """An extraction slot's settings from the query's fields (which a {?} query must not have)."""
    if slot is Slot.SCORE:
        for name in _EXTRACTION_FIELDS:
            if getattr(query, name) is not None:
                raise _invalid(
                    f"{param}.{name}", f"{name} goes with an extraction slot ({{*}}, {{n}}, {{$}})"
                )
        return None
    generate = query.mode == "generate"
    if generate and query.max_answers is not None:
        raise _invalid(
            param + ".max_answers", 'a generated slot has one answer: max_answers goes with "search"'
        )
    max_answers = _in_range(query.max_answers, 5, SEARCH_WIDTH, param + ".max_answers")
    bound = MAX_GENERATED_TOKENS if generate else MAX_ANSWER_TOKENS
    max_tokens = _in_range(query.max_tokens, 64 if generate else 16, bound, param + ".max_tokens")
    return Extract(_KINDS[slot], (), max_answers, max_tokens, generate)


def _in_range(value: int | None, default: int, most: int, param: str) -> int:
    if value is None:
        return default
    if not 1 <= value <= most:
        raise ScoringError("out_of_range", f"{value} is out of range: 1 to {most}", param)
    return value


LISTED = "options"  # the placeholder that lists a query's options, with orderings


def _listing(options: list[str], order: tuple[int, ...]) -> str:
    """The options as {options} lists them: in this order, each without its surrounding spaces, joined by
    ", " (" billing", " shipping" → "billing, shipping")."""
    return ", ".join(options[i].strip() for i in order)


def _combinations(query: api.Query, names: list[str], param: str, limits: Limits) -> list[dict[str, str]]:
    """The query's placeholder values, one dict per combination in order, keys in the template's order."""
    given, values = query.combinations, query.values
    if values is not None:
        for name in values:
            if name not in names:
                raise _unknown(f"{param}.values.{name}", f"the template has no placeholder {{{name}}}")
        if given != "all":
            raise _invalid(param + ".values", 'values go with "combinations": "all"')
    if given is None:
        if names:
            raise _unknown(param + ".template", f"placeholder {{{names[0]}}} has no value: give combinations")
        return [{}]
    if given == "all":
        return _grid(values, names, param, limits)
    if len(given) > limits.max_combinations:
        raise _too_many_combinations(param, len(given), limits)
    return [_named_values(c, names, f"{param}.combinations[{j}]") for j, c in enumerate(given)]


def _named_values(combination: dict[str, str], names: list[str], param: str) -> dict[str, str]:
    """One combination's values, exactly the template's placeholders, in the template's order."""
    for name in combination:
        if name not in names:
            raise _unknown(f"{param}.{name}", f"the template has no placeholder {{{name}}}")
    for name in names:
        if name not in combination:
            raise _unknown(param, f"no value for placeholder {{{name}}}")
    return {name: combination[name] for name in names}


def _grid(
    values: dict[str, list[str]] | None, names: list[str], param: str, limits: Limits
) -> list[dict[str, str]]:
    """combinations "all": itertools.product over the placeholders in the template's order."""
    if values is None:
        raise _invalid(param + ".values", 'combinations "all" needs values: {name: [values]}')
    for name in names:
        if name not in values:
            raise _unknown(param + ".values", f"no values for placeholder {{{name}}}")
    lists = [values[name] for name in names]
    count = math.prod(map(len, lists))
    if count > limits.max_combinations:
        raise _too_many_combinations(param, count, limits)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*lists)]


def _unknown(param: str, message: str) -> ScoringError:
    return ScoringError("unknown_placeholder", message, param)


def _too_many_combinations(param: str, count: int, limits: Limits) -> ScoringError:
    return ScoringError(
        "too_many_combinations",
        f"{count} combinations; at most {limits.max_combinations} per query",
        param + ".combinations",
    )


def _options(options: list[str] | None, slot: Slot, param: str, limits: Limits) -> list[str]:
    if slot is not Slot.SCORE:
        if options is not None:
            raise _invalid(param, f"options go with a {{?}} slot; a {slot.value} slot extracts its answer")
        return []
    if options is None:
        raise _invalid(param, "a {?} template needs options")
    if len(options) > limits.max_options:
        raise ScoringError(
            "too_many_options", f"{len(options)} options; at most {limits.max_options} per query", param
        )
    seen: dict[str, str] = {}
    for j, option in enumerate(options):
        if not option:
            raise ScoringError("invalid_option", "an option must not be empty", f"{param}[{j}]")
        if option.lower() in seen:
            raise ScoringError(
                "duplicate_option",
                f"option {excerpt(option)} repeats {excerpt(seen[option.lower()])} (options are compared "
                "ignoring case)",
                f"{param}[{j}]",
            )
        seen[option.lower()] = option
    return options


# ---------------------------------------------------------------------------------------------------------
# Inputs


@dataclass(eq=False)  # each content its own, even where two are alike (a dict key in compile_request)
class _Input:
    input_id: str
    text: str
    param: str  # its messages field
    specs: list[_Spec]
    media: tuple = ()  # its parts (ContentImage, ContentAudio, ContentVideo) in the order of IMAGE_MARKs


def _render(messages: list[api.Message], param: str, limits: Limits, formats: MediaFormats):
    """A content's text and its media parts (render_content), within the limits on images and audio."""
    found = []
    text = render_content(messages, param, found, limits, formats)
    images = [p for p in found if isinstance(p, ContentImage)]
    clips = [p for p in found if isinstance(p, ContentAudio)]
    frames = [f for p in found if isinstance(p, ContentVideo) for f in p.frames]
    sized = [("an image", p, limits.max_image_bytes) for p in images + frames]  # a frame is an image file
    for kind, part, most in sized + [("an audio clip", p, limits.max_audio_bytes) for p in clips]:
        if len(part.data) > most:
            message = f"{kind} of {len(part.data):,} bytes; at most {most:,}"
            raise ScoringError("invalid_media", message, part.param)
    if len(images) > limits.max_images_per_content:
        raise ScoringError(
            "too_many_images",
            f"{len(images)} images in one content; at most {limits.max_images_per_content}",
            param,
        )
    if len(frames) > limits.max_video_frames_per_content:
        raise ScoringError(
            "too_many_frames",
            f"{len(frames)} video frames in one content; at most {limits.max_video_frames_per_content}",
            param,
        )
    for clip in clips:
        if clip.seconds > formats.audio.max_seconds:
            raise ScoringError(
                "invalid_media",
                f"a clip of {clip.seconds:.1f} s; the model reads at most {formats.audio.max_seconds:g} s of "
                "one clip: send longer audio as several clips",
                clip.param + ".input_audio.data",
            )
    seconds = sum(clip.seconds for clip in clips)
    if seconds > limits.max_audio_seconds_per_content:
        raise ScoringError(
            "too_much_audio",
            f"{seconds:.1f} s of audio in one content; at most {limits.max_audio_seconds_per_content:g} s",
            param,
        )
    return text, tuple(found)


def _parse_inputs(
    request: api.ScoreRequest,
    shared: list[_Spec],
    has_packs: bool,
    limits: Limits,
    pack_questions: int = 0,
    formats: MediaFormats = MediaFormats(),
) -> list[_Input]:
    if request.messages is None and request.inputs is None:
        raise _invalid("messages", "give messages (one content) or inputs (several contents)")
    if request.messages is not None and request.inputs is not None:
        raise _invalid("inputs", "give messages (one content) or inputs (several contents), not both")
    if request.messages is not None:
        if not shared and not has_packs:
            raise _invalid("scoring.queries", "scoring.queries must not be empty")
        text, media = _render(request.messages, "messages", limits, formats)
        inputs = [_Input("0", text, "messages", shared, media)]
        _check_questions(inputs[0], "scoring.queries", limits, pack_questions)
        return inputs
    if len(request.inputs) > limits.max_inputs:
        raise ScoringError(
            "too_many_inputs", f"{len(request.inputs)} inputs; at most {limits.max_inputs}", "inputs"
        )
    by_id = {spec.id: spec for spec in shared}
    inputs, input_ids = [], set()
    for i, item in enumerate(request.inputs):
        param = f"inputs[{i}]"
        input_id = str(i) if item.id is None else item.id
        if input_id in input_ids:
            raise _invalid(param + ".id", f"input ids must be unique; {input_id!r} is used twice")
        input_ids.add(input_id)
        text, media = _render(item.messages, param + ".messages", limits, formats)
        chosen = shared if item.query_ids is None else _choose(item.query_ids, by_id, param + ".query_ids")
        own = (
            []
            if item.queries is None
            else _parse_queries(item.queries, param + ".queries", limits, set(by_id))
        )
        if not chosen and not own and not has_packs:
            raise _invalid(param, f"{param} has no queries: give scoring.queries or the input's own queries")
        inputs.append(_Input(input_id, text, param + ".messages", chosen + own, media))
        _check_questions(inputs[-1], param, limits, pack_questions)
    return inputs


def _choose(query_ids: list[str], by_id: dict[str, _Spec], param: str) -> list[_Spec]:
    chosen = {}
    for k, query_id in enumerate(query_ids):
        if query_id not in by_id:
            raise ScoringError("unknown_query", f"scoring.queries has no query {query_id!r}", f"{param}[{k}]")
        if query_id in chosen:
            raise _invalid(f"{param}[{k}]", f"query id {query_id!r} is listed twice")
        chosen[query_id] = by_id[query_id]
    return list(chosen.values())


def _check_questions(item: _Input, param: str, limits: Limits, pack_questions: int) -> None:
    count = sum(len(spec.fills) for spec in item.specs) + pack_questions
    if count > limits.max_questions_per_content:
        raise ScoringError(
            "too_many_questions",
            f"{count} questions (templates x combinations, packs' included) for one content; at most "
            f"{limits.max_questions_per_content}",
            param,
        )


def _check_workload(spec: _Spec, calibration: Calibration | None, scoring: api.Scoring) -> None:
    if spec.workload is None:
        return
    if calibration is None or spec.workload not in calibration.workloads:
        known = ", ".join(sorted(calibration.workloads)) if calibration else "none: serve with --calibration"
        raise ScoringError(
            "unknown_workload", f"no calibration for workload {spec.workload!r} (loaded: {known})",
            spec.param + ".workload",
        )  # fmt: skip
    if calibration.workloads[spec.workload].rule == "floor_lift" and scoring.empty_floor is False:
        raise _invalid(
            "scoring.empty_floor",
            f"workload {spec.workload!r} chooses by lift over the floor: leave empty_floor on",
        )


def _resolve_packs(refs: list[api.PackRef], loaded: Mapping[str, "CompiledPack"]) -> list[tuple]:
    """The packs a request names → (compiled pack, categories asked, their questions, cells wanted) each."""
    seen = set()
    for i, ref in enumerate(refs):
        if ref.id in seen:
            raise _invalid(f"packs[{i}].id", f"pack {ref.id!r} is listed twice")
        seen.add(ref.id)
    asks = []
    for i, ref in enumerate(refs):
        if ref.id not in loaded:
            known = ", ".join(sorted(loaded)) or "none"
            raise ScoringError("unknown_pack", f"no prompt pack {ref.id!r} is loaded (loaded: {known})",
                               f"packs[{i}].id")  # fmt: skip
        compiled = loaded[ref.id]
        pack = compiled.pack
        if ref.version is not None and ref.version != pack.version:
            raise ScoringError(
                "unknown_pack", f"pack {ref.id!r} is loaded at version {pack.version!r}, not {ref.version!r}",
                f"packs[{i}].version",
            )  # fmt: skip
        categories = [c.id for c in pack.categories] if ref.categories is None else ref.categories
        for j, category in enumerate(categories):
            if category not in {c.id for c in pack.categories}:
                raise _invalid(f"packs[{i}].categories[{j}]", f"pack {ref.id!r} has no category {category!r}")
        if len(set(categories)) != len(categories):
            raise _invalid(f"packs[{i}].categories", "a category is listed twice")
        needed = {cell.question for c in categories for cell in pack.category(c).cells}
        queries = tuple(q for q in compiled.queries if q.id in needed)
        asks.append((compiled, tuple(categories), queries, bool(ref.cells)))
    return asks


# ---------------------------------------------------------------------------------------------------------
# Tokens


def _junction(filled: str) -> str:
    """The end of a filled template that decides how options join it: from its last space after other text.

    No token spans a space that follows other text: byte-level BPE pre-tokenizers split there, and
    SentencePiece vocabularies hold no piece with a space after other characters. So filled + option
    tokenises as the text before that space, then the rest + option, and checking the rest is exact.
    """
    for cut in range(len(filled) - 1, 0, -1):
        if filled[cut] == " " and not filled[cut - 1].isspace():
            return filled[cut:]
    return filled


def _contexts(junction: str, options: list[str]) -> list[str]:
    """Per option, the text before it whose tokens decide whether it joins cleanly.

    Where the option starts with a space and the template ends in text (the convention: "Answer:" + " yes"),
    the joint itself is such a space and one character of context is enough. That keeps a 1,000-combination
    grid with 1,000 options to a few thousand short strings to tokenise instead of a million, and still
    catches a tokenizer that breaks the rule (a SentencePiece dummy prefix makes " yes" alone two tokens).
    """
    at_text = junction != "" and not junction[-1].isspace()
    return [junction[-1] if at_text and option.startswith(" ") else junction for option in options]


def _build_query(
    spec: _Spec, ids: dict[str, tuple[int, ...]], needs_text: bool, empty_floor: bool, limits: Limits
) -> Query:
    """Token-level checks of one query (option lengths, template lengths, option boundaries, the closing
    text's length) → Query."""
    extract = spec.extract
    if extract is not None:
        closing_ids = ids[spec.closing] if spec.closing else ()
        if len(closing_ids) > MAX_CLOSING_TOKENS:
            raise ScoringError(
                "closing_too_long",
                f"the closing text {spec.closing!r} is {len(closing_ids)} tokens; at most "
                f"{MAX_CLOSING_TOKENS}",
                spec.param + ".template",
            )
        extract = replace(extract, closing_ids=closing_ids)
    floor = spec.floor if extract is not None else empty_floor
    option_ids = tuple(ids[option] for option in spec.options)
    for j, (option, tokens) in enumerate(zip(spec.options, option_ids, strict=True)):
        if not tokens:
            raise ScoringError(
                "invalid_option", f"option {excerpt(option)} has no tokens", f"{spec.param}.options[{j}]"
            )
        if len(tokens) > limits.max_option_tokens:
            raise ScoringError(
                "option_too_long",
                f"option {excerpt(option)} is {len(tokens):,} tokens; at most {limits.max_option_tokens}",
                f"{spec.param}.options[{j}]",
            )
    questions, checked = [], set()  # checked: junctions whose options all join cleanly
    per_combination = len(spec.orders) if spec.orders else 1
    for n, filled in enumerate(spec.fills):
        values = spec.combinations[n // per_combination]
        template_ids = ids[filled]
        where = f" (values {values})" if values else ""
        if len(template_ids) > limits.max_template_tokens:
            raise ScoringError(
                "template_too_long",
                f"the filled template{where} is {len(template_ids)} tokens; "
                f"at most {limits.max_template_tokens}",
                spec.param + ".template",
            )
        # Without BOS, the floor (empty content + template) would have no token to read the option from.
        if needs_text and not template_ids:
            raise _bad_template(spec.param + ".template", f"this model needs text before the slot{where}")
        junction = _junction(filled)
        if junction not in checked:
            contexts = _contexts(junction, spec.options)
            for j, (option, tokens, context) in enumerate(
                zip(spec.options, option_ids, contexts, strict=True)
            ):
                if ids[context + option] != ids[context] + tokens:
                    raise ScoringError(
                        "option_boundary",
                        f"option {option!r} merges with the end of the template {filled[-20:]!r}{where}: "
                        "their tokens together differ from their tokens apart. End the template without a "
                        'space and start the option with one ("Answer:{?}" with " yes").',
                        f"{spec.param}.options[{j}]",
                    )
            checked.add(junction)
        # Each ordering is scored on the content; the floor is the listed order's.
        asked_floor = floor and n % per_combination == 0
        questions.append(
            Question(spec.id, values, template_ids, tuple(spec.options), option_ids, extract, asked_floor)
        )
    return Query(spec.id, spec.slot, tuple(questions), spec.workload, tuple(spec.orders or ()))


def _tokenize(tokenizer, contents: list[str], specs: list[_Spec]) -> dict[str, tuple[int, ...]]:
    """Tokens of every distinct string the request needs, in one batch (the tokenizer runs it in parallel)."""
    wanted = dict.fromkeys(contents)
    for spec in specs:
        wanted.update(dict.fromkeys(spec.fills))
        wanted.update(dict.fromkeys(spec.options))
        if spec.closing:
            wanted[spec.closing] = None
        for junction in dict.fromkeys(map(_junction, spec.fills)):
            for context, option in zip(_contexts(junction, spec.options), spec.options, strict=True):
                wanted[context] = wanted[context + option] = None
    texts = list(wanted)
    return dict(zip(texts, map(tuple, tokenizer.encode_batch(texts)), strict=True))


# ---------------------------------------------------------------------------------------------------------


def compile_request(
    request: api.ScoreRequest,
    tokenizer,
    limits: Limits = Limits(),
    packs: Mapping[str, "CompiledPack"] | None = None,
    calibration: Calibration | None = None,
    formats: MediaFormats = MediaFormats(),
) -> CompiledRequest:
    """Check a decoded scoring request (spinf_jax.decoding) against SPEC section 1 and tokenise it, with the
    prompt packs it names among `packs` (spinf_jax.packs.compiled) and the workloads its queries name among
    `calibration`'s, media parts read as `formats` says (by default the model reads text only); raises
    ScoringError."""
    asks = _resolve_packs(request.packs or [], packs or {})
    if request.scoring is None and not asks:
        raise _invalid("scoring", 'a scoring block is required: {"queries": [...]}')
    scoring = request.scoring or api.Scoring()
    shared = _parse_queries(scoring.queries or [], "scoring.queries", limits, set())
    pack_questions = sum(len(q.questions) for _, _, queries, _ in asks for q in queries)
    inputs = _parse_inputs(request, shared, bool(asks), limits, pack_questions, formats)

    # A scoring query that no input asks for is checked for structure but never tokenised.
    used = list({id(spec): spec for item in inputs for spec in item.specs}.values())
    for spec in used:
        _check_workload(spec, calibration, scoring)
    wrapped = [p.presentation for p, *_ in asks if not p.presentation.bare]
    texts = {item: [item.text, *(w.prefix + item.text + w.suffix for w in wrapped)] for item in inputs}
    pieces = [  # a content with media is tokenised piece by piece between its parts (media_content_ids)
        piece
        for item, strings in texts.items()
        for text in strings
        for piece in (_media_pieces(text, item.media, item.param, formats) if item.media else [text])
    ]
    ids = _tokenize(tokenizer, pieces, used)

    def content(item: _Input, text: str) -> tuple[tuple[int, ...], MediaParts]:
        return media_content_ids(text, item.media, ids, formats, item.param)

    read = {item: content(item, item.text) for item in inputs}
    for item in inputs:
        if len(read[item][0]) > limits.max_content_tokens:
            raise ScoringError(
                "content_too_long",
                f"the content is {len(read[item][0])} tokens; at most {limits.max_content_tokens}",
                item.param,
            )
    needs_text = not tokenizer.prefix()
    empty_floor = scoring.empty_floor is not False
    queries = {id(spec): _build_query(spec, ids, needs_text, empty_floor, limits) for spec in used}
    for spec in used:
        if spec.slot in (Slot.NUMBER, Slot.AMOUNT) and not vocabulary(tokenizer).can_mask_numbers():
            raise ScoringError(
                "extraction_unsupported",
                f"this model's tokenizer has no digit tokens to keep a {spec.slot.value} answer to a number",
                spec.param + ".template",
            )

    def pack_asks(item: _Input) -> tuple[PackAsk, ...]:
        asked = []
        for pack, categories, qs, cells in asks:
            w = pack.presentation
            own = (None, ()) if w.bare else content(item, w.prefix + item.text + w.suffix)
            asked.append(PackAsk(pack, categories, qs, own[0], cells, own[1]))
        return tuple(asked)

    contents = tuple(
        Content(item.input_id, read[item][0], tuple(queries[id(spec)] for spec in item.specs), item.param,
                pack_asks(item), read[item][1])
        for item in inputs
    )  # fmt: skip
    return CompiledRequest(request.model, contents)

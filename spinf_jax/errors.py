"""Every error code the API answers with, defined once: its HTTP status and what it means.

Raise them as `ScoringError(code, message, param)`: the status comes from here, and a code that is not here
fails loudly where it is raised. docs/api.md's table is checked against this one (tests/test_errors.py), and
so is every code the source raises.
"""

CODES: dict[str, tuple[int, str]] = {
    # The request's meaning (SPEC section 1)
    "invalid_json": (400, "the body is not valid JSON"),
    "invalid_request": (400, "a field is missing, of the wrong type, or contradicts another"),
    "invalid_template": (400, "a template's slot or braces are malformed, or nothing precedes the slot"),
    "unknown_placeholder": (400, "a placeholder without values, or values for no placeholder"),
    "too_many_combinations": (400, "more than 1,000 combinations in one query"),
    "invalid_option": (400, "an empty option, or one with no tokens"),
    "too_many_options": (400, "more than 1,000 options in one query"),
    "duplicate_option": (400, "two options equal ignoring case"),
    "option_too_long": (400, "an option of more than 5 tokens"),
    "option_boundary": (400, "an option merges with the end of its template: their tokens differ apart"),
    "template_too_long": (400, "a filled template of more than 256 tokens"),
    "unsupported_content": (400, "a content part this model cannot read (image, audio, ...)"),
    "invalid_media": (
        400,
        "an image URL that is neither data:image/...;base64 nor https://, or a corrupt or oversized file",
    ),
    "unsupported_media": (400, "a data URL or remote file of a type that is not an image"),
    "remote_media_disabled": (400, "an https:// image URL on a server started without --allow-remote-media"),
    "media_unreachable": (400, "an https:// image that could not be fetched, or not in time"),
    "too_many_images": (400, "more than 16 images in one content"),
    "too_much_audio": (400, "more than 120 s of audio in one content"),
    "too_many_frames": (400, "more than 32 video frames in one content"),
    "content_too_long": (400, "a content of more than 4,096 tokens"),
    "question_too_large": (400, "a content with one of its questions is larger than the largest bucket"),
    "too_many_questions": (400, "more than 10,000 questions (templates × combinations) for one content"),
    "too_many_inputs": (400, "more than 10,000 inputs"),
    "unknown_query": (400, "query_ids names a query that scoring.queries does not have"),
    "too_many_tokens": (400, "the request would process more than 2,000,000 tokens"),
    "unknown_pack": (400, "no prompt pack of that id is loaded"),
    "scoring_required": (400, "a chat completion without a scoring block: this server does not chat"),
    "streaming_unsupported": (400, "a chat completion with stream true: scores come whole, never streamed"),
    "too_many_slots": (400, "a template with more than one slot"),
    "unknown_slot": (400, "a {...} that is neither a slot ({?}, {*}, {n}, {$}) nor a placeholder name"),
    "closing_too_long": (400, "an extraction slot's closing text of more than 16 tokens"),
    "out_of_range": (400, "max_answers (1-8) or max_tokens (1-32 searched, 1-128 generated) out of range"),
    "extraction_unsupported": (400, "a {n} or {$} slot on a model whose tokenizer has no digit tokens"),
    # Decisions (SPEC section 5)
    "option_count": (
        400,
        "a decision of fewer than 2 or more than 16 options (255 choices, 10 score levels)",
    ),
    "duplicate_option_id": (400, "two options of a decision with one id"),
    "empty_state": (400, "a decision's state is empty"),
    "too_many_orderings": (400, '"all" orderings of more than 4 options'),
    "unknown_workload": (400, "a workload the server's calibration file does not have"),
    "unknown_contract": (400, "an x_contract that is not one of the prompt contracts the server reads"),
    "question_type_unsupported": (
        400,
        "a System One `box` question: this server answers noul, choice, score",
    ),
    "decisions_unsupported": (501, "the model cannot read a lettered answer as one token after the prompt"),
    # Access, routing and the server's state
    "invalid_api_key": (401, "missing or wrong API key"),
    "model_not_found": (404, "the model named is not served here"),
    "not_found": (404, "no such route"),
    "profiling_off": (404, "POST /v1/admin/profile on a server started without --profile-dir"),
    "method_not_allowed": (405, "the route does not take that method"),
    "request_timeout": (408, "the body did not arrive within 30 s"),
    "request_too_large": (413, "the body is over 2 MB (checked while reading)"),
    "profile_running": (409, "a profile is being taken: one at a time"),
    "concurrency_limit": (429, "the queue is full: retry after Retry-After seconds"),
    "warming_up": (503, "the model is loading and compiling"),
    "shutting_down": (503, "the server is stopping and did not get to this request"),
    "model_failed": (503, "the model failed to load"),
    "out_of_memory": (503, "the device ran out of memory during the pass"),
    "deadline_exceeded": (
        504,
        "not answered within the server's request deadline (serve --request-deadline)",
    ),
    "internal_error": (500, "the server failed to answer (a bug): the envelope, never a stack trace"),
}


# A refusal's message at most this long: one that quotes the request (an option, a template) says which part
# with an excerpt (`excerpt`), and a message that still runs over is cut, so a 1 MB field is never echoed.
MAX_MESSAGE = 1_000


def excerpt(value: object, most: int = 60) -> str:
    """repr(value), its middle elided past `most` characters (and then the value's length said)."""
    text = repr(value)
    if len(text) <= most:
        return text
    length = len(value) if isinstance(value, str) else len(text)
    return f"{text[: most // 2]}…{text[-most // 2 :]} ({length:,} characters)"


class ScoringError(Exception):
    """A request the API refuses; `code`, `message` and `param` go to the client as they are (the message
    cut at MAX_MESSAGE characters)."""

    def __init__(self, code: str, message: str, param: str | None = None):
        if code not in CODES:
            raise ValueError(f"error code {code!r} is not defined in spinf_jax.errors.CODES")
        if len(message) > MAX_MESSAGE:
            message = message[:MAX_MESSAGE] + "… (cut)"
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.status = CODES[code][0]

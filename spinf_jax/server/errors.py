"""Every failure answers in the API's envelope: {"error": {type, code, message, param}, "request_id"}. The
id is the request's x-request-id header and its log line's (server/app.py), and the code is noted for that
line too."""

import asyncio
import uuid
from collections.abc import Awaitable

from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.openapi import ResponseSpec

from spinf_jax import api
from spinf_jax.errors import CODES, ScoringError

_TYPES: dict[int, api.ErrorType] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    501: "not_supported_error",
    503: "overloaded_error",
}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 400: "invalid_request"}


class ApiError(ScoringError):
    """A refusal of the HTTP layer (auth, routing, the server's state), with an optional Retry-After."""

    def __init__(self, code: str, message: str, param: str | None = None, retry_after: int | None = None):
        super().__init__(code, message, param)
        self.retry_after = retry_after


def request_id(scope) -> str:
    """The id of an HTTP request (its ASGI scope), made on first use."""
    state = scope.setdefault("state", {})
    if "request_id" not in state:
        state["request_id"] = f"req_{uuid.uuid4().hex}"
    return state["request_id"]


def envelope(
    request: Request, status: int, code: str, message: str, param=None, retry_after=None
) -> Response[api.ErrorEnvelope]:
    request.scope.setdefault("state", {})["error_code"] = code
    headers = {}
    if retry_after is not None:
        headers["retry-after"] = str(retry_after)
        headers["retry-after-ms"] = str(retry_after * 1000)  # what the System One SDK reads first
    if status == 401:  # RFC 9110: a 401 names the scheme that would be accepted
        headers["www-authenticate"] = 'Bearer realm="spinf"'

    error = api.ErrorDetail(type=_TYPES.get(status, "server_error"), code=code, message=message, param=param)
    return Response(
        api.ErrorEnvelope(error=error, request_id=request_id(request.scope)),
        status_code=status,
        headers=headers,
    )


def error_responses(*statuses: int) -> dict[int, ResponseSpec]:
    """The envelope's entries in the OpenAPI document, each naming its codes; all of CODES' statuses when
    none are given."""
    statuses = statuses or tuple(sorted({status for status, _ in CODES.values()}))
    return {
        status: ResponseSpec(
            api.ErrorEnvelope,
            generate_examples=False,
            description=", ".join(code for code, (s, _) in CODES.items() if s == status),
        )
        for status in statuses
    }


def handle_scoring_error(request: Request, exc: ScoringError) -> Response:
    return envelope(request, exc.status, exc.code, exc.message, exc.param, getattr(exc, "retry_after", None))


def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if status == 413:
        message = "the request body is over the 2 MB limit"
    elif status == 404:
        message = (
            f"no route {request.method} {request.url.path}: GET /schema lists the routes (OpenAPI), "
            "docs/api.md says what each takes"
        )
    else:
        message = exc.detail if isinstance(exc.detail, str) and exc.detail else "request refused"
    # Other refusals of the HTTP layer keep their status, under the code of their class.
    code = _HTTP_CODES.get(status, "invalid_request" if status < 500 else "internal_error")
    return envelope(request, status, code, message)


def handle_unexpected(request: Request, exc: Exception) -> Response:
    """Anything else: a 500 in the envelope, never a stack trace; out of device memory is a 503."""
    text = str(exc)
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return envelope(
            request, *_coded("out_of_memory"), "the device ran out of memory; retry later", retry_after=5
        )
    return envelope(request, *_coded("internal_error"), f"the server failed to answer: {type(exc).__name__}")


class ClientGone(Exception):
    """The client hung up before its answer: nothing to send (answered 499 for the logs)."""


async def unless_client_leaves[T](request: Request, work: Awaitable[T], deadline: float | None = None) -> T:
    """`work`'s result; if the client hangs up first, `work` is cancelled (a plan the runner has not started
    is dropped, a large one's slices not launched yet too, a replica's request is closed: abandoned work
    delays nobody) and ClientGone is raised. Past `deadline` seconds it is cancelled as well, and answered
    deadline_exceeded."""

    async def client_left():
        # The body has been read, so the next ASGI message is http.disconnect: when the client hangs up,
        # or after the response has been sent.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    answer, left = asyncio.ensure_future(work), asyncio.ensure_future(client_left())
    await asyncio.wait({answer, left}, timeout=deadline, return_when=asyncio.FIRST_COMPLETED)
    if answer.done():
        left.cancel()
        return answer.result()
    answer.cancel()
    if left.done():
        raise ClientGone
    left.cancel()
    raise ScoringError(
        "deadline_exceeded",
        f"not answered within {deadline:g} s of its arrival (the server's --request-deadline); a smaller "
        "request, or one sent when the queue is shorter, fits in it",
    )


def _coded(code: str) -> tuple[int, str]:
    return CODES[code][0], code


EXCEPTION_HANDLERS = {
    ScoringError: handle_scoring_error,
    HTTPException: handle_http_exception,
    ClientGone: lambda *_: Response(b"", status_code=499),
    Exception: handle_unexpected,
}

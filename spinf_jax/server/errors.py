"""Every failure answers in the API's envelope: {"error": {type, code, message, param}, "request_id"}."""

import uuid

from litestar import Request, Response
from litestar.exceptions import HTTPException

from spinf_jax.compiler import ScoringError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    501: "not_supported_error",
    503: "overloaded_error",
}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 400: "invalid_request"}


class ApiError(Exception):
    def __init__(
        self, status: int, code: str, message: str, param: str | None = None, retry_after: int | None = None
    ):
        super().__init__(message)
        self.status, self.code, self.message, self.param, self.retry_after = (
            status,
            code,
            message,
            param,
            retry_after,
        )


def request_id(request: Request) -> str:
    state = request.scope.setdefault("state", {})
    if "request_id" not in state:
        state["request_id"] = f"req_{uuid.uuid4().hex}"
    return state["request_id"]


def envelope(
    request: Request, status: int, code: str, message: str, param=None, retry_after=None
) -> Response:
    headers = {"x-request-id": request_id(request)}
    if retry_after is not None:
        headers["retry-after"] = str(retry_after)
    error = {"type": _TYPES.get(status, "server_error"), "code": code, "message": message, "param": param}
    return Response({"error": error, "request_id": request_id(request)}, status_code=status, headers=headers)


def handle_api_error(request: Request, exc: ApiError) -> Response:
    return envelope(request, exc.status, exc.code, exc.message, exc.param, exc.retry_after)


def handle_scoring_error(request: Request, exc: ScoringError) -> Response:
    return envelope(request, exc.status, exc.code, exc.message, exc.param)


def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if status == 413:
        message = "the request body is over the 2 MB limit"
    else:
        message = exc.detail if isinstance(exc.detail, str) and exc.detail else "request refused"
    return envelope(request, status, _HTTP_CODES.get(status, "http_error"), message)


def handle_unexpected(request: Request, exc: Exception) -> Response:
    """Anything else: a 500 in the envelope, never a stack trace; out of device memory is a 503."""
    text = str(exc)
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return envelope(
            request, 503, "out_of_memory", "the device ran out of memory; retry later", retry_after=5
        )
    return envelope(request, 500, "internal_error", f"the server failed to answer: {type(exc).__name__}")


EXCEPTION_HANDLERS = {
    ApiError: handle_api_error,
    ScoringError: handle_scoring_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}

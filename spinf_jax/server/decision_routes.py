"""The decision APIs' routes: System One (`/v1/systemone`, `/v1/systemone/batch`) and OpenAI's Decisions API
(`/v1/decisions`), with the error shapes their clients parse (the spinf envelope stays on our own routes):

- a request that does not fit the API: 422 `{"detail": [{"loc": ["body", ...], "msg", "type"}]}`;
- anything else: its status with `{"detail": {"error_type", "message"}}`; 401 `authentication_error`, 429
  with `Retry-After` and `retry-after-ms` (the SDKs back off and retry 429 and 5xx: a bad request is never
  a 5xx).
"""

import base64
import re

import anyio.to_thread
from litestar import Request, Response, post
from litestar.exceptions import HTTPException
from litestar.openapi import ResponseSpec
from litestar.params import JSONBody
from msgspec.structs import replace

from spinf_jax import openai_decisions, systemone
from spinf_jax.decision_apis import ALIASES
from spinf_jax.decoding import decode
from spinf_jax.errors import ScoringError
from spinf_jax.server.errors import ClientGone, handle_unexpected

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_STEP = re.compile(r"\[(\d+)\]|\.?([^.\[]+)")


def loc(param: str | None) -> list[str | int]:
    """`questions.refund.criteria` → ["body", "questions", "refund", "criteria"]; `states[2]` → [..., 2]."""
    steps: list[str | int] = ["body"]
    for index, name in _STEP.findall(param or ""):
        steps.append(int(index) if index else name)
    return steps


def _detail(request: Request, status: int, body, retry_after: int | None = None) -> Response:
    headers = {}
    if retry_after is not None:
        headers = {"retry-after": str(retry_after), "retry-after-ms": str(retry_after * 1000)}
    if status == 401:
        headers["www-authenticate"] = 'Bearer realm="spinf"'
    return Response({"detail": body}, status_code=status, headers=headers)


def handle_scoring_error(request: Request, exc: ScoringError) -> Response:
    request.scope.setdefault("state", {})["error_code"] = exc.code
    if exc.status == 400:  # the request's meaning: a validation failure, as FastAPI-shaped clients expect
        item = {"loc": loc(exc.param), "msg": exc.message, "type": exc.code}
        return _detail(request, 422, [item])
    error_type = _ERROR_TYPES.get(exc.status, "api_error")
    return _detail(
        request, exc.status, {"error_type": error_type, "message": exc.message, "code": exc.code},
        getattr(exc, "retry_after", None),
    )  # fmt: skip


def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    message = "the request body is over the 2 MB limit" if status == 413 else str(exc.detail or "refused")
    request.scope.setdefault("state", {})["error_code"] = "request_too_large" if status == 413 else "http"
    return _detail(request, status, {"error_type": _ERROR_TYPES.get(status, "api_error"), "message": message})


def handle_unexpected_error(request: Request, exc: Exception) -> Response:
    """A 500 (or 503 out of device memory) in the detail shape: never a stack trace."""
    envelope = handle_unexpected(request, exc)
    error = envelope.content.error
    return _detail(request, envelope.status_code, {"error_type": "api_error", "message": error.message})


DETAIL_HANDLERS = {
    ScoringError: handle_scoring_error,
    HTTPException: handle_http_exception,
    ClientGone: lambda *_: Response(b"", status_code=499),
    Exception: handle_unexpected_error,
}
_RESPONSES = {
    422: ResponseSpec(dict, generate_examples=False, description='{"detail": [{"loc", "msg", "type"}]}'),
    401: ResponseSpec(dict, generate_examples=False, description='{"detail": {"error_type", "message"}}'),
    404: ResponseSpec(dict, generate_examples=False, description="an unknown model"),
    429: ResponseSpec(dict, generate_examples=False, description="the queue is full: Retry-After"),
    503: ResponseSpec(dict, generate_examples=False, description="loading or overloaded: Retry-After"),
}


async def systemone_multipart(request: Request) -> systemone.SystemOneRequest:
    """A System One body sent as multipart/form-data, as the SDK sends image assets: the JSON as the part
    `request`, each asset's file as the part its entry names (`asset-0`, ...)."""
    form = await request.form()
    raw = form.get("request")
    if raw is None:
        raise ScoringError(
            "invalid_request", 'a multipart body needs its JSON as the part "request"', "request"
        )
    body = decode(await raw.read() if hasattr(raw, "read") else raw.encode(), systemone.SystemOneRequest)
    assets = dict(body.assets or {})
    for ref, asset in assets.items():
        if asset.part is None or asset.data_base64 is not None:
            continue
        upload = form.get(asset.part)
        if upload is None:
            raise ScoringError("invalid_media", f"the body has no part {asset.part!r}", f"assets.{ref}.part")
        content = await upload.read() if hasattr(upload, "read") else upload.encode("latin-1")
        assets[ref] = replace(asset, data_base64=base64.b64encode(content).decode())
    return replace(body, assets=assets or None)


def _check_model(server, model: str | None) -> None:
    if model is not None and model not in ALIASES:
        server.check_model(model)


async def _run(request: Request, body, plan, finish):
    server = request.app.state.server
    server.require_ready()
    _check_model(server, body.model)
    planned = await anyio.to_thread.run_sync(plan, body)
    reply = await server.answer(request, planned, finish)
    if body.model in server.names():  # a served name asked for by name: answered under it
        reply.model = body.model
    return reply


def decision_routes(scoring_route: dict) -> list:
    """The three routes, with the scoring routes' guards (the key, then the queue) and their own errors."""
    route = {**scoring_route, "exception_handlers": DETAIL_HANDLERS, "responses": _RESPONSES}

    @post(
        "/v1/systemone", summary="System One: typed questions about a state (docs/decision-apis.md)", **route
    )
    async def systemone_route(
        request: Request, data: JSONBody[systemone.SystemOneRequest]
    ) -> systemone.SystemOneResponse:
        """Every question is a branch of one read of the state: its answer does not depend on what else is
        asked, under which id or in which order."""
        apis = request.app.state.server.service.apis
        return await _run(request, data, apis.plan_systemone, apis.finish_systemone)

    @post("/v1/systemone/batch", summary="System One over many states, packed into shared passes", **route)
    async def systemone_batch_route(
        request: Request, data: JSONBody[systemone.SystemOneBatchRequest]
    ) -> systemone.SystemOneBatchResponse:
        """Each state's result is bit-identical to asking it alone on /v1/systemone."""
        apis = request.app.state.server.service.apis
        return await _run(request, data, apis.plan_systemone_batch, apis.finish_systemone_batch)

    @post("/v1/decisions", summary="OpenAI's Decisions API: predicate, choice and score questions", **route)
    async def decisions_route(
        request: Request, data: JSONBody[openai_decisions.DecisionsRequest]
    ) -> openai_decisions.DecisionsResponse:
        """Answers in question order; a question whose options hold under half the model's probability is
        answered as a refusal."""
        apis = request.app.state.server.service.apis
        return await _run(request, data, apis.plan_decisions, apis.finish_decisions)

    return [systemone_route, systemone_batch_route, decisions_route]

"""The Litestar app: thin handlers over the engine. JAX never runs on the event loop: requests are compiled
on worker threads and scored by the engine thread (runner.Runner); handlers only await futures."""

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from importlib.metadata import version

import anyio.to_thread
import jax
from litestar import Litestar, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.params import JSONBody

from spinf_jax import api
from spinf_jax.decoding import decode
from spinf_jax.engine import Engine
from spinf_jax.packer import Buckets, default_sizes
from spinf_jax.scoring import Scorer
from spinf_jax.server.errors import EXCEPTION_HANDLERS, ApiError, error_responses
from spinf_jax.server.metrics import Metrics
from spinf_jax.server.runner import QueueFull, Runner

MAX_BODY = 2 * 1024 * 1024


@dataclass
class Settings:
    model: str
    precision: str = "bf16"
    buckets: tuple[int, ...] | None = None  # None: by backend (packer.default_sizes)
    api_key: str | None = None
    max_queue: int = 64
    max_delay_ms: float = 5.0
    served_names: tuple[str, ...] = ()  # extra names the model answers to (e.g. the hosted service's)


@dataclass
class Server:
    """What the handlers share; the engine appears once it is loaded and compiled."""

    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    engine: Engine | None = None
    scorer: Scorer | None = None
    runner: Runner | None = None
    failure: str | None = None
    ready_at: int | None = None

    def start(self, engine: Engine | None = None) -> None:
        threading.Thread(target=self._load, args=(engine,), name="spinf-load", daemon=True).start()

    def _load(self, engine: Engine | None) -> None:
        try:
            s = self.settings
            engine = engine or Engine.load(
                s.model, s.precision, buckets=Buckets(s.buckets or default_sizes())
            )
            engine.on_pass = self.metrics.on_pass
            engine.warmup()
            self.scorer = Scorer(engine)
            self.runner = Runner(self.scorer, s.max_queue, s.max_delay_ms / 1000)
            self.engine = engine
            self.ready_at = int(time.time())
        except Exception as exc:  # noqa: BLE001 - reported by /health and every request
            self.failure = f"{type(exc).__name__}: {exc}"

    def names(self) -> list[str]:
        return [self.engine.model.name, *self.settings.served_names] if self.engine else []

    def require_ready(self) -> Scorer:
        if self.engine is None:
            if self.failure:
                raise ApiError("model_failed", f"the model failed to load: {self.failure}")
            raise ApiError("warming_up", "the model is loading and compiling; retry shortly", retry_after=5)
        return self.scorer


def _server(connection: ASGIConnection) -> Server:
    return connection.app.state.server


class ApiRequest(Request):
    """Decodes a handler's `data` with spinf_jax.decoding, as the library does. Litestar's own decoding
    converts leniently ("false" for false), writes a dict's key as `[...]` in its errors, and answers bytes
    that are not UTF-8 with a 500; the Struct returned here passes its conversion unchanged."""

    async def json(self) -> api.ScoreRequest:
        # Litestar stops reading past request_max_body_size (413)
        return decode(await self.body(), self.route_handler.parsed_data_field.annotation)


async def _refuse_empty_body(request: Request) -> None:
    """Litestar takes an empty body for a missing `data` argument; it is a body that is not JSON."""
    if not await request.body():
        raise ApiError("invalid_json", "the body is empty: send a JSON object")


def _authorize(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """A guard: it runs before the body is read."""
    key = _server(connection).settings.api_key
    if key is None:
        return
    given = connection.headers.get("authorization", "")
    if given.removeprefix("Bearer ").strip() != key and connection.headers.get("x-api-key") != key:
        raise ApiError("invalid_api_key", "missing or wrong API key (Authorization: Bearer <key>)")


async def _score(request: Request, body: api.ScoreRequest) -> api.ScoreResponse:
    server = _server(request)
    scorer = server.require_ready()
    if body.model is not None and body.model not in server.names():
        raise ApiError("model_not_found", f"model {body.model!r} is not served here; see /v1/models", "model")
    plan = await anyio.to_thread.run_sync(scorer.plan, body)
    try:
        future = server.runner.submit(plan)
    except QueueFull:
        raise ApiError(
            "concurrency_limit", "too many requests are waiting; retry shortly", retry_after=1
        ) from None
    response = await asyncio.wrap_future(future)
    if body.model is not None:
        response.model = body.model
    server.metrics.scored(response)
    return response


# What the two scoring routes share: the key checked first, then the body; every error documented.
SCORING_ROUTE = {
    "status_code": 200,
    "guards": [_authorize],
    "before_request": _refuse_empty_body,
    "responses": error_responses(),
}


@post("/v1/score", summary="Score closed questions about one or many contents", **SCORING_ROUTE)
async def score(request: Request, data: JSONBody[api.ScoreRequest]) -> api.ScoreResponse:
    """Each answer is a probability over the options listed, read from one pass over the content."""
    return await _score(request, data)


@post(
    "/v1/chat/completions",
    summary="OpenAI-compatible scoring (send `scoring` in extra_body)",
    **SCORING_ROUTE,
)
async def chat_completions(request: Request, data: JSONBody[api.ChatCompletionRequest]) -> api.ChatCompletion:
    """The scoring request through the OpenAI SDKs. Without `scoring`, `inputs` or `packs` the answer is
    scoring_required: this server scores, it does not chat."""
    if data.scoring is None and data.inputs is None and data.packs is None:
        raise ApiError(
            "scoring_required",
            "this server scores, it does not chat: send a `scoring` block (with the OpenAI SDK: extra_body)",
            "scoring",
        )
    scored = await _score(request, data)
    usage = scored.usage
    return api.ChatCompletion(
        id="chatcmpl-" + scored.id.removeprefix("score-"),
        created=scored.created,
        model=scored.model,
        system_fingerprint=scored.system_fingerprint,
        choices=[],
        results=scored.results,
        warnings=scored.warnings,
        usage=api.ChatUsage(
            prompt_tokens=usage.prompt_tokens,
            prompt_tokens_details=usage.prompt_tokens_details,
            total_tokens=usage.prompt_tokens,
        ),
    )


@get("/v1/models", guards=[_authorize], responses=error_responses(401), summary="The served model(s)")
async def models(request: Request) -> api.ModelList:
    server = _server(request)
    created = server.ready_at or int(time.time())
    return api.ModelList(
        data=[api.ModelCard(id=name, created=created, owned_by="spinf") for name in server.names()]
    )


@get(
    "/health",
    responses={
        503: ResponseSpec(api.Health, generate_examples=False, description="loading, or failed to load")
    },
    summary="Readiness, model, fingerprint, versions and limits",
)
async def health(request: Request) -> Response[api.Health]:
    """200 once the model is loaded and compiled, 503 before (or if it failed)."""
    server = _server(request)
    engine = server.engine
    body = api.Health(
        status="ok" if engine else ("error" if server.failure else "warming_up"),
        ready=engine is not None,
        model=server.settings.model,
        served_names=server.names(),
        precision=server.settings.precision,
        versions=api.Versions(
            spinf_jax=version("spinf-jax"), jax=jax.__version__, backend=jax.default_backend()
        ),
        error=server.failure,
    )
    if engine:
        body.system_fingerprint = engine.fingerprint
        body.buckets = list(engine.buckets.sizes)
        body.limits = {**dataclasses.asdict(server.scorer.limits), "max_body_bytes": MAX_BODY}
    return Response(body, status_code=200 if engine else 503)


@get("/metrics", media_type="text/plain; version=0.0.4", summary="Prometheus metrics")
async def metrics(request: Request) -> str:
    server = _server(request)
    return server.metrics.render(server.runner.depth if server.runner else 0)


def _count_requests(app):
    """ASGI middleware: count every HTTP response by path and status (errors included)."""

    async def middleware(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def record(message):
            if message["type"] == "http.response.start":
                scope["app"].state.server.metrics.request(scope["path"], message["status"])
            await send(message)

        return await app(scope, receive, record)

    return middleware


def create_app(settings: Settings, engine: Engine | None = None) -> Litestar:
    """The app; it loads (or takes) the engine in the background and answers 503 until it is compiled."""
    server = Server(settings)
    app = Litestar(
        route_handlers=[score, chat_completions, models, health, metrics],
        request_class=ApiRequest,
        exception_handlers=EXCEPTION_HANDLERS,
        request_max_body_size=MAX_BODY,
        middleware=[_count_requests],
        openapi_config=OpenAPIConfig(
            title="spinf-jax scoring API", version=version("spinf-jax"), path="/schema"
        ),
        on_startup=[lambda: server.start(engine)],
        on_shutdown=[lambda: server.runner and server.runner.close()],
    )
    app.state.server = server
    return app

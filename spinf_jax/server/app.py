"""The Litestar app: thin handlers over the engine. JAX never runs on the event loop: requests are compiled
on worker threads and scored by the engine thread (runner.Runner); handlers only await futures."""

import asyncio
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from importlib.metadata import version

import anyio.to_thread
import jax
from litestar import Litestar, MediaType, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.logging.config import LoggingConfig
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.spec import Components, SecurityScheme
from litestar.params import JSONBody
from litestar.types import ASGIApp

from spinf_jax import api
from spinf_jax.compiler import MediaFormats
from spinf_jax.decoding import decode
from spinf_jax.engine import Engine, scoring_device
from spinf_jax.loader import random_model
from spinf_jax.packer import Buckets, default_sizes
from spinf_jax.packs.loader import describe
from spinf_jax.progress import PROGRESS, Progress, log
from spinf_jax.runner import QueueFull, Runner
from spinf_jax.server import profiling
from spinf_jax.server.auth import ApiKeys
from spinf_jax.server.decision_routes import decision_routes, systemone_multipart
from spinf_jax.server.encoding import decompressing
from spinf_jax.server.errors import (
    EXCEPTION_HANDLERS,
    ApiError,
    error_responses,
    request_id,
    unless_client_leaves,
)
from spinf_jax.server.memory import check_fits
from spinf_jax.server.metrics import DISCONNECTED, UNMATCHED, Metrics
from spinf_jax.server.schema_page import schema_plugins
from spinf_jax.server.settings import Settings
from spinf_jax.service import Service
from spinf_jax.systemone import SystemOneRequest

MAX_BODY = 2 * 1024 * 1024
# How a key is sent (server/auth.py), for the OpenAPI document; routes that take one list KEYED (the key is
# asked only when the server has one).
SECURITY_SCHEMES = {
    "bearer": SecurityScheme(type="http", scheme="bearer", description="Authorization: Bearer <key>"),
    "x_api_key": SecurityScheme(type="apiKey", name="x-api-key", security_scheme_in="header"),
}
KEYED = [{"bearer": []}, {"x_api_key": []}, {}]
BODY_TIMEOUT_S = 30.0  # from the first byte of the body to the last
REQUESTS = logging.getLogger("spinf_jax.requests")
# What a request's log line says of the work it asked for, beyond its status and time (Server.answer).
SERVED = ("inputs", "questions", "tokens", "queue_ms", "pass_ms")


@dataclass
class Server:
    """What the handlers share; the engine appears once it is loaded and compiled."""

    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    service: Service | None = None  # once loaded and compiled: the server is ready
    runner: Runner | None = None
    failure: str | None = None
    ready_at: int | None = None
    memory_needed: int | None = None  # bytes: the largest pass's peak (Engine.device_bytes_needed)
    profiling: threading.Lock = field(default_factory=threading.Lock)  # held while a profile is taken
    url: str | None = None  # where it is served, for the `ready` line

    def __post_init__(self):
        self.metrics.read_queue_depth(lambda: self.runner.depth if self.runner else 0)

    @property
    def engine(self) -> Engine | None:
        return self.service.engine if self.service else None

    def start(self, engine: Engine | None = None) -> None:
        threading.Thread(target=self._load, args=(engine,), name="spinf-load", daemon=True).start()

    def _load(self, engine: Engine | None) -> None:
        s = self.settings
        # Progress is an info line: serve's --log-level warning hides it with the others.
        progress = Progress() if s.progress and PROGRESS.isEnabledFor(logging.INFO) else None
        try:
            buckets = Buckets(s.buckets or default_sizes())
            if engine is None and s.random_weights:
                model = random_model(s.random_weights, s.model, s.precision)
                engine = Engine(model.with_row_tile(s.row_tile) if s.row_tile else model, buckets)
            engine = engine or Engine.load(
                s.model, s.precision, progress, buckets=buckets, row_tile=s.row_tile
            )
            start = time.perf_counter()
            engine.on_pass = self.metrics.on_pass
            # Ready once the smallest and largest buckets are compiled (with their extraction programs),
            # the others joining as they compile.
            engine.warmup(progress, extraction=s.warm_extraction, background=True)
            self.memory_needed = engine.device_bytes_needed()
            check_fits(self.memory_needed, s.device_memory_cap_gib)
            service = Service.over(engine, packs=s.packs, calibration=s.calibration, limits=s.limits())
            _warn_of_packs_at_another_precision(service, engine)
            self.runner = Runner(
                engine, s.max_queue, s.max_delay_ms / 1000, self.metrics.on_batch, hold_back=s.hold_back
            )
            # Logged before /health says so, so that whoever waits for one finds the other.
            log(PROGRESS, "ready", model=engine.model.name, url=self.url,
                load_s=round(engine.model.load_seconds, 2),
                compile_s=round(time.perf_counter() - start, 2))  # fmt: skip
            self.service = service
            self.ready_at = int(time.time())
        except Exception as exc:  # noqa: BLE001 - reported by /health and every request
            failure = f"{type(exc).__name__}: {exc}"
            log(PROGRESS, "failed", logging.ERROR, error=failure)
            self.failure = failure

    def names(self) -> list[str]:
        return [self.engine.model.name, *self.settings.served_names] if self.engine else []

    def require_ready(self) -> None:
        if self.engine is None:
            if self.failure:
                raise ApiError("model_failed", f"the model failed to load: {self.failure}")
            raise ApiError("warming_up", "the model is loading and compiling; retry shortly", retry_after=5)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names():
            raise ApiError("model_not_found", f"model {model!r} is not served here; see /v1/models", "model")

    async def answer(self, request: Request, plan, finish):
        """Queue a plan (made on a worker thread) for the engine thread and await its response. What it asks,
        how long it waited and how long its pass took go to the request's log line."""
        served = request.scope["state"]["served"]
        served.update(inputs=plan.inputs, questions=plan.questions)
        try:
            ticket = self.runner.submit(plan, finish)
        except QueueFull:
            raise _queue_full(self.runner) from None
        served["tokens"] = ticket.tokens
        try:
            deadline = self.settings.request_deadline_s or None
            return await unless_client_leaves(request, asyncio.wrap_future(ticket), deadline)
        finally:
            served.update(queue_ms=_ms(ticket.queue_s), pass_ms=_ms(ticket.pass_s))


def _warn_of_packs_at_another_precision(service: Service, engine: Engine) -> None:
    """A pack calibrated for this model at other precisions only: its baselines and thresholds were fitted
    on scores this server does not give (the official packs are calibrated at fp32; `serve` runs bf16 by
    default). A warning line at start, with what to do."""
    model, served = engine.model.name, engine.model.precision.value
    for compiled in service.scorer.packs.values():
        pack = compiled.pack
        at = sorted({c.precision for c in pack.calibrated_on if c.model == model and c.precision})
        if at and served not in at:
            log(PROGRESS, "pack_precision", logging.WARNING, pack=pack.id, calibrated_at=",".join(at),
                served_at=served, hint=f"serve --precision {at[0]} for the thresholds it was calibrated "
                "with, or recalibrate it: spinf-jax packs calibrate")  # fmt: skip


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _server(connection: ASGIConnection) -> Server:
    return connection.app.state.server


class ApiRequest(Request):
    """Decodes a handler's `data` with spinf_jax.decoding, as the library does. Litestar's own decoding
    converts leniently ("false" for false), writes a dict's key as `[...]` in its errors, and answers bytes
    that are not UTF-8 with a 500; the Struct returned here passes its conversion unchanged."""

    async def body(self) -> bytes:
        """The body, if it arrives within BODY_TIMEOUT_S: one that stops halfway would hold its connection
        and a worker for as long as the client likes."""
        try:
            return await asyncio.wait_for(super().body(), BODY_TIMEOUT_S)
        except TimeoutError:
            raise ApiError(
                "request_timeout", f"the body did not arrive within {BODY_TIMEOUT_S:g} s"
            ) from None

    async def json(self) -> api.ScoreRequest:
        # Litestar stops reading past request_max_body_size (413)
        kind = self.route_handler.parsed_data_field.annotation
        multipart = self.headers.get("content-type", "").startswith("multipart/form-data")
        if multipart and kind is SystemOneRequest:  # image assets as parts (the System One SDK's way)
            return await systemone_multipart(self)
        return decode(await self.body(), kind)


async def _refuse_empty_body(request: Request) -> None:
    """Litestar takes an empty body for a missing `data` argument; it is a body that is not JSON."""
    if not await request.body():
        raise ApiError("invalid_json", "the body is empty: send a JSON object")


def _authorize(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """A guard: it runs before the body is read."""
    if not connection.app.state.api_keys.admit(connection.headers):
        raise ApiError("invalid_api_key", "missing or wrong API key (Authorization: Bearer <key>)")


def _metrics_behind_key(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """An app-wide guard, there with Settings.metrics_auth: /metrics asks for the key as the API does."""
    if "/metrics" in handler.paths:
        _authorize(connection, handler)


async def _score(request: Request, body: api.ScoreRequest) -> api.ScoreResponse:
    server = _server(request)
    server.require_ready()
    server.check_model(body.model)
    scorer = server.service.scorer
    plan = await anyio.to_thread.run_sync(scorer.plan, body)
    response = await server.answer(request, plan, scorer.finish)
    if body.model is not None:
        response.model = body.model
    server.metrics.scored(response)
    return response


def _queue_full(runner: Runner) -> ApiError:
    return ApiError(
        "concurrency_limit", "too many requests are waiting; retry later", retry_after=runner.retry_after()
    )


def _queue_has_room(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """A guard: a full queue refuses before the body is read (submit checks again, for the race)."""
    runner = _server(connection).runner
    if runner is not None and runner.full:
        raise _queue_full(runner)


# What the scoring routes share: the key checked first, then the queue, then the body; every error
# documented; a log line for every request.
SCORING_ROUTE = {
    "opt": {"logged": True},
    "status_code": 200,
    "guards": [_authorize, _queue_has_room],
    "security": KEYED,
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
    if data.stream:  # a streaming client would otherwise wait for events that never come
        raise ApiError(
            "streaming_unsupported",
            "scores are not streamed: send stream false (or leave it out); the reply comes whole",
            "stream",
        )
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
            completion_tokens=usage.prompt_tokens_details.decode_tokens,
            total_tokens=usage.prompt_tokens + usage.prompt_tokens_details.decode_tokens,
        ),
    )


async def _decide(request: Request, body: api.DecideRequest | api.SharedDecideRequest):
    server = _server(request)
    server.require_ready()
    server.check_model(body.model)
    decider = server.service.decider
    plan = await anyio.to_thread.run_sync(decider.plan, body)
    return await server.answer(request, plan, decider.finish)


@post("/decide", summary="One typed decision over a state (docs/decisions.md)", **SCORING_ROUTE)
async def decide(request: Request, data: JSONBody[api.DecideRequest]) -> api.DecisionResult:
    """The probability of each option, read from its letter at the first position of the model's answer;
    with `orderings`, every ordering of the options is a branch of the same read, combined."""
    return await _decide(request, data)


@post(
    "/decide/shared", summary="Many decisions over one state, read once (docs/decisions.md)", **SCORING_ROUTE
)
async def decide_shared(request: Request, data: JSONBody[api.SharedDecideRequest]) -> api.SharedDecisions:
    """Each decision's result is bit-identical to asking it alone on /decide."""
    return await _decide(request, data)


@get(
    "/v1/models",
    guards=[_authorize],
    security=KEYED,
    responses=error_responses(401),
    summary="The served model(s)",
)
async def models(request: Request) -> api.ModelList:
    server = _server(request)
    created = server.ready_at or int(time.time())
    names = server.names()
    released = time.strftime("%Y-%m-%d", time.gmtime(created))
    return api.ModelList(
        data=[api.ModelCard(id=name, created=created, owned_by="spinf") for name in names],
        models=[
            api.DecisionModelCard(name=name, description="served by spinf-jax", release_date=released)
            for name in names
        ],
    )


@get(
    "/v1/packs",
    guards=[_authorize],
    security=KEYED,
    responses=error_responses(401, 503),
    summary="The prompt packs requests may name (docs/prompt-packs.md)",
)
async def packs(request: Request) -> api.PackList:
    server = _server(request)
    server.require_ready()
    return api.PackList(data=[describe(p.loaded) for p in server.service.packs.values()])


@post(
    "/v1/admin/profile",
    status_code=200,
    guards=[_authorize],
    security=KEYED,
    responses=error_responses(400, 401, 404, 409),
    summary="Trace the served traffic: device kernels and host threads (serve --profile-dir)",
)
async def profile(request: Request, data: JSONBody[api.ProfileRequest]) -> api.ProfileResult:
    """The JAX profiler runs for `seconds` while the server goes on serving; the answer comes when the trace
    is written. One at a time."""
    server = _server(request)
    if server.settings.profile_dir is None:
        raise ApiError("profiling_off", "this server was started without --profile-dir")
    if not server.profiling.acquire(blocking=False):
        raise ApiError("profile_running", "a profile is being taken: ask again when it has ended")
    try:
        # Replicas (serve --devices) share the folder: each names its traces by its process.
        folder = server.settings.profile_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        quiet = server.runner.quiet if server.runner else contextlib.nullcontext
        traced = await anyio.to_thread.run_sync(profiling.trace, folder, data.seconds, quiet)
        return api.ProfileResult(
            trace_dir=str(folder), seconds=round(traced.seconds, 3), held_seconds=round(traced.held, 3)
        )
    finally:
        server.profiling.release()


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
        precision=engine.model.precision.value if engine else server.settings.precision,
        versions=api.Versions(
            spinf_jax=version("spinf-jax"), jax=jax.__version__, backend=jax.default_backend()
        ),
        error=server.failure,
    )
    if engine:
        body.system_fingerprint = engine.fingerprint
        body.fingerprint_parts = engine.fingerprint_parts
        buckets = engine.buckets  # one read: the compile thread may replace it meanwhile
        body.buckets = list(buckets.sizes)
        body.pass_seconds = list(buckets.pass_costs) if buckets.pass_costs else None
        body.compiling = list(engine.compiling) or None
        body.limits = {
            **server.service.scorer.limits.reported(
                MediaFormats(engine.model.image_format, engine.model.audio_format)
            ),
            "max_body_bytes": MAX_BODY,
        }
        body.packs = [describe(p.loaded) for p in server.service.packs.values()]
        calibration = server.settings.calibration
        body.workloads = {n: w.temperature for n, w in calibration.workloads.items()} if calibration else None
        device = scoring_device()
        body.device = f"{device.platform}:{device.id}"
        stats = device.memory_stats() or {}  # None on the CPU
        body.memory = api.DeviceMemory(
            needed_bytes=server.memory_needed,
            in_use_bytes=stats.get("bytes_in_use"),
            peak_bytes=stats.get("peak_bytes_in_use"),
            limit_bytes=stats.get("bytes_limit"),
        )
    return Response(body, status_code=200 if engine else 503)


@get(
    "/metrics", media_type=MediaType.TEXT, sync_to_thread=True, summary="Prometheus metrics (docs/metrics.md)"
)
def metrics(request: Request) -> Response[bytes]:
    """Collected on a worker thread: the process and device collectors make system calls."""
    body, content_type = _server(request).metrics.exposition(request.headers.get("accept", ""))
    if content_type.startswith("text/"):  # Litestar adds the charset to a text type itself: once is enough
        content_type = content_type.replace("; charset=utf-8", "")
    return Response(body, media_type=content_type)


def _observe_requests(app: ASGIApp, metrics: Metrics) -> ASGIApp:
    """ASGI middleware: count and time every HTTP request by route template and status, errors included; give
    every response its x-request-id; log a line (spinf_jax.requests) for each request to a scoring route and
    each error answered in the envelope. A client that hangs up before the answer (its `receive` gave
    http.disconnect) counts as DISCONNECTED, not as the 500 Litestar answers a body cut short with."""

    async def middleware(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        start = time.perf_counter()
        status = 500  # what the ASGI server answers if the app raises before it starts a response
        disconnected = False
        rid = request_id(scope)
        served = scope["state"]["served"] = dict.fromkeys(SERVED)

        async def watch_for_disconnect():
            nonlocal disconnected
            message = await receive()
            disconnected |= message["type"] == "http.disconnect"
            return message

        async def record_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {
                    **message,
                    "headers": [
                        *message.get("headers", ()),
                        (b"x-request-id", rid.encode()),
                        (b"x-typesafe-request-id", rid.encode()),  # the System One SDK's name for it
                    ],
                }
            await send(message)

        try:
            await app(scope, watch_for_disconnect, record_status)
        finally:
            seconds = time.perf_counter() - start
            outcome = DISCONNECTED if disconnected else str(status)
            path = scope.get("path_template", UNMATCHED)  # set by the router once a route matched
            metrics.request(path, outcome, seconds)
            code, handler = scope["state"].get("error_code"), scope.get("route_handler")
            if code or (handler is not None and handler.opt.get("logged")):
                # A client that hung up was answered nothing: its line says 499, without what nobody got.
                level = logging.ERROR if outcome == "500" else logging.INFO
                log(REQUESTS, "request", level, request_id=rid, method=scope["method"], path=scope["path"],
                    status=int(outcome), error=None if disconnected else code, **served,
                    total_ms=_ms(seconds))  # fmt: skip

    return middleware


def create_app(settings: Settings, engine: Engine | None = None, url: str | None = None) -> Litestar:
    """The app; it loads (or takes) the engine in the background and answers 503 until it is compiled. url:
    where it is served, for the `ready` line."""
    server = Server(settings, url=url)
    app = Litestar(
        route_handlers=[
            score,
            chat_completions,
            decide,
            decide_shared,
            models,
            packs,
            profile,
            health,
            metrics,
            *decision_routes(SCORING_ROUTE),
        ],
        guards=[_metrics_behind_key] if settings.metrics_auth else [],
        request_class=ApiRequest,
        exception_handlers=EXCEPTION_HANDLERS,
        request_max_body_size=MAX_BODY,
        openapi_config=OpenAPIConfig(
            title="spinf-jax scoring API",
            version=version("spinf-jax"),
            path="/schema",
            components=Components(security_schemes=SECURITY_SCHEMES),
            render_plugins=schema_plugins(),
        ),
        # Litestar's own logging config would make the root logger print every library's INFO lines (JAX's
        # "Unable to initialize backend 'tpu'" at start): its exceptions go to the litestar logger alone.
        logging_config=LoggingConfig(configure_root_logger=False),
        on_startup=[lambda: server.start(engine)],
        on_shutdown=[lambda: server.runner and server.runner.close()],
    )
    app.state.server = server
    app.state.api_keys = ApiKeys(settings.api_keys)
    # Litestar's middleware runs after routing and would miss 404s and 405s: wrap the whole handler instead,
    # as Litestar does itself for OpenTelemetry.
    app.asgi_handler = _observe_requests(decompressing(app.asgi_handler, MAX_BODY), server.metrics)
    return app

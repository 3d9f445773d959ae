"""`spinf-jax serve --devices N`: the front. It listens on the public port and hands each request to the ready
replica (spinf_jax.replicas) with the fewest requests in flight; /health and /metrics speak for all of them.

A replica that is busy (429) or not ready (503) passes the request to the next one, and so does one that stops
answering mid-request (its connection lost, or its /health silent: the supervisor marks it stuck, and restarts
it if it stays so): scoring is a pure function of the request, so asking another replica gives the same
bits. Replicas run with the front's own flags, API keys included, and check the key themselves; the front
never starts a JAX backend, so it holds no device memory.
"""

import asyncio
import logging
from dataclasses import dataclass
from importlib.metadata import version

import httpx
import msgspec
from litestar import Litestar, MediaType, Request, Response, get, route
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.logging.config import LoggingConfig

from spinf_jax import api
from spinf_jax.replicas import Replica, Replicas
from spinf_jax.server.app import MAX_BODY
from spinf_jax.server.auth import ApiKeys
from spinf_jax.server.errors import EXCEPTION_HANDLERS, ApiError, unless_client_leaves
from spinf_jax.server.metrics import ReplicaMetrics
from spinf_jax.server.settings import Settings

# What travels from the client to a replica and back; hop-by-hop and length headers are the proxy's own.
FORWARDED = ("authorization", "x-api-key", "content-type", "accept", "x-request-id")
RETURNED = ("content-type", "retry-after", "www-authenticate", "x-request-id")
PASSED_ON = (429, 503)  # answers that another replica may better
# A pass can wait behind a full queue for a minute or more: no read timeout (the replica's own deadline,
# --request-deadline, answers a request that takes too long); a replica that does not take the connection at
# once is not listening, and one that stops answering /health is found stuck by the supervisor, which the
# requests in flight there see within STUCK_CHECK_S.
TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
STUCK_CHECK_S = 0.5


class ReplicaStuck(Exception):
    pass


@dataclass
class Front:
    settings: Settings
    replicas: Replicas
    platform: str  # the replicas' devices: gpu, cpu, ...
    http: httpx.AsyncClient | None = None  # made on the server's event loop (on_startup)

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED}
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        tried: list[Replica] = []
        passed_on = None
        while (replica := self.replicas.pick(skip=tried)) is not None:
            tried.append(replica)
            with self.replicas.using(replica):
                try:
                    answer = await self._unless_stuck(
                        replica, self.http.request(request.method, replica.url + target, content=body,
                                                   headers=headers)
                    )  # fmt: skip
                except httpx.TransportError:
                    self.replicas.lost(replica)
                    continue
                except ReplicaStuck:
                    continue
            if answer.status_code not in PASSED_ON:
                return _relay(answer)
            passed_on = answer
        if passed_on is not None:
            return _relay(passed_on)
        raise self._none_ready()

    @staticmethod
    async def _unless_stuck(replica: Replica, asked):
        """The replica's answer, unless the supervisor marks it stuck first (its /health silent past
        replicas.HEALTH_DEADLINE_S): then the request is dropped there, to be asked of another replica.
        Scoring is pure, so the other's answer is the same bits."""
        answer = asyncio.ensure_future(asked)
        while not answer.done():
            await asyncio.wait({answer}, timeout=STUCK_CHECK_S)
            if not answer.done() and replica.state != "ready":
                answer.cancel()
                raise ReplicaStuck
        return answer.result()

    def _none_ready(self) -> ApiError:
        if self.replicas.starting:
            return ApiError(
                "warming_up", "the replicas are loading and compiling; retry shortly", retry_after=5
            )
        failed = [r for r in self.replicas.members if r.state == "failed"]
        why = f": replica {failed[0].index}: {failed[0].error}" if failed else ""
        return ApiError("model_failed", f"no replica can serve{why}")

    async def health(self) -> Response[api.Health]:
        members = self.replicas.members
        answers = await asyncio.gather(*(self._replica_health(r) for r in members))
        replicas = [
            api.ReplicaHealth(
                index=r.index,
                device=r.device,
                state=r.state,
                in_flight=r.in_flight,
                restarts=r.restarts,
                error=r.error,
                memory=h.memory if h else None,
            )
            for r, h in zip(members, answers, strict=True)
        ]
        served = next((h for r, h in zip(members, answers, strict=True) if h and r.state == "ready"), None)
        if served is not None:
            body = msgspec.structs.replace(served, memory=None, device=None, replicas=replicas)
            return Response(body, status_code=200)
        s = self.settings
        failed = all(r.state == "failed" for r in members)
        body = api.Health(
            status="error" if failed else "warming_up",
            ready=False,
            model=s.model,
            served_names=[],
            precision=s.precision,
            versions=api.Versions(spinf_jax=version("spinf-jax"), jax=version("jax"), backend=self.platform),
            error=self._none_ready().message if failed else None,
            replicas=replicas,
        )
        return Response(body, status_code=503)

    async def _replica_health(self, replica: Replica) -> api.Health | None:
        if replica.state not in ("ready", "starting"):
            return None
        try:
            answer = await self.http.get(f"{replica.url}/health", timeout=5)
            return msgspec.json.decode(answer.content, type=api.Health)
        except (httpx.HTTPError, msgspec.DecodeError):
            return None


def _relay(answer: httpx.Response) -> Response:
    headers = {k: v for k, v in answer.headers.items() if k in RETURNED}
    return Response(answer.content, status_code=answer.status_code, headers=headers)


def _front(connection: ASGIConnection) -> Front:
    return connection.app.state.front


@route(
    ["/", "/{path:path}"],
    http_method=["GET", "POST"],
    include_in_schema=False,
    status_code=200,
    opt={"front": True},
)
async def forward(request: Request) -> Response:
    """Everything but /health and /metrics: the API (keys checked by the replica), /schema, /v1/models."""
    front = _front(request)
    return await unless_client_leaves(request, front.forward(request))


@get("/health", include_in_schema=False)
async def health(request: Request) -> Response[api.Health]:
    return await _front(request).health()


@get("/metrics", media_type=MediaType.TEXT, sync_to_thread=True, include_in_schema=False)
def metrics(request: Request) -> Response[bytes]:
    """The replicas' metrics, each sample labelled with its replica, and the front's gauges of them."""
    body, content_type = request.app.state.metrics.exposition(request.headers.get("accept", ""))
    return Response(body, media_type=content_type)


def _metrics_behind_key(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    if "/metrics" in handler.paths and not connection.app.state.api_keys.admit(connection.headers):
        raise ApiError("invalid_api_key", "missing or wrong API key (Authorization: Bearer <key>)")


def create_front(settings: Settings, replicas: Replicas, platform: str) -> Litestar:
    """The front over `replicas`: it starts them (Replicas.start) as it starts, and stops them as it stops."""
    front = Front(settings, replicas, platform)
    # Litestar's logging setup shows httpx's INFO lines: one for every request the front passes on.
    logging.getLogger("httpx").setLevel(logging.WARNING)

    async def start() -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        front.http = httpx.AsyncClient(timeout=TIMEOUT, limits=limits)
        replicas.start()  # after uvicorn has set up the logs, which tell how each replica starts

    async def stop() -> None:
        await front.http.aclose()
        await asyncio.to_thread(replicas.close)

    app = Litestar(
        route_handlers=[forward, health, metrics],
        guards=[_metrics_behind_key] if settings.metrics_auth else [],
        exception_handlers=EXCEPTION_HANDLERS,
        request_max_body_size=MAX_BODY,
        openapi_config=None,  # /schema is a replica's: the same API
        logging_config=LoggingConfig(configure_root_logger=False),  # as a replica's (server/app.py)
        on_startup=[start],
        on_shutdown=[stop],
    )
    app.state.front = front
    app.state.api_keys = ApiKeys(settings.api_keys)
    app.state.metrics = ReplicaMetrics(replicas, settings.api_keys[:1])
    return app

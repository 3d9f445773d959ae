"""A client for the scoring API: this server or the hosted one, told apart only by base URL and key.

    from spinf_jax.client import Client
    client = Client()  # $SPINF_BASE_URL (default http://127.0.0.1:8000) and $SPINF_API_KEY
    response = client.score({"messages": [...], "scoring": {"queries": [...]}})  # an api.ScoreResponse
    for result in client.score_many(contents, scoring={"queries": [...]}):  # api.InputResult, in order
        ...

`AsyncClient` has the same methods as coroutines (`score_many` is an async iterator). Replies are typed: the
msgspec Structs of spinf_jax.api. A refusal raises ApiError with the API's code, message, param and request
id. 429 and 503 are retried, waiting what Retry-After says (else an exponential backoff with jitter), and so
are dropped connections; other errors are not.

`score_many` packs contents into `inputs` requests under the server's body limit and an input count, and
where a batch is still too large for the server's token limit (too_many_tokens) it is split in two.
"""

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass

import httpx
import msgspec

from spinf_jax import api
from spinf_jax.openai_decisions import DecisionsResponse
from spinf_jax.systemone import SystemOneBatchResponse, SystemOneResponse

DEFAULT_URL = "http://127.0.0.1:8000"
MAX_BODY_BYTES = 2 * 1024 * 1024  # the server's request_max_body_size (the hosted API's too)
RETRIED = (429, 503)


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None, request_id: str | None):
        super().__init__(f"{status} {code}: {message}" + (f" ({param})" if param else ""))
        self.status, self.code, self.message, self.param, self.request_id = (
            status, code, message, param, request_id
        )  # fmt: skip


@dataclass(frozen=True)
class _Settings:
    base_url: str
    headers: dict[str, str]
    timeout: float
    max_retries: int
    batch_inputs: int
    batch_bytes: int


def _settings(base_url, api_key, timeout, max_retries, batch_inputs, batch_bytes) -> _Settings:
    base_url = (base_url or os.environ.get("SPINF_BASE_URL") or DEFAULT_URL).rstrip("/")
    api_key = api_key if api_key is not None else os.environ.get("SPINF_API_KEY")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    return _Settings(base_url, headers, timeout, max_retries, batch_inputs, batch_bytes)


def _wait(response: httpx.Response | None, attempt: int) -> float:
    """Seconds to wait before retry `attempt` (0-based): Retry-After when the server gives it, else 0.5 s
    doubling per attempt, with jitter so that many clients do not come back at once."""
    if response is not None:
        try:
            return max(0.0, float(response.headers["retry-after"]))
        except (KeyError, ValueError):
            pass
    return min(30.0, 0.5 * 2**attempt) * (0.5 + random.random() / 2)


def _raise_for(response: httpx.Response) -> None:
    """An ApiError for a refusal. The envelope is read leniently: another server (or a newer one) may use
    codes and types this version does not know."""
    if response.status_code == 200:
        return
    try:
        envelope = msgspec.json.decode(response.content)
        request_id = envelope.get("request_id") or response.headers.get("x-request-id")
        if "detail" in envelope:  # the decision APIs' shapes: 422 [{loc, msg, type}], else {error_type, ...}
            detail = envelope["detail"]
            if isinstance(detail, list):
                first = detail[0]
                param = ".".join(str(step) for step in first["loc"][1:]) or None
                code, message = str(first["type"]), str(first["msg"])
            else:
                code, message, param = (
                    str(detail.get("code", detail["error_type"])),
                    str(detail["message"]),
                    None,
                )
        else:
            error = envelope["error"]
            code, message, param = str(error["code"]), str(error.get("message", "")), error.get("param")
    except (msgspec.DecodeError, KeyError, TypeError, IndexError):
        code, message, param, request_id = "http_error", response.text[:500], None, None
    raise ApiError(response.status_code, code, message, param, request_id)


def _retryable(error: Exception) -> bool:
    return isinstance(error, httpx.TransportError) or (
        isinstance(error, ApiError) and error.status in RETRIED
    )


# ---------------------------------------------------------------------------------------------------------
# Batching: contents → `inputs` requests


def _content(item: dict | str, index: int) -> dict:
    """A content as an `inputs` entry: a string, {"id", "text"}, or an input as the API takes it."""
    if isinstance(item, str):
        return {"id": str(index), "messages": [{"role": "user", "content": item}]}
    if "messages" in item:
        return {"id": str(index), **item}
    return {"id": str(item.get("id", index)), "messages": [{"role": "user", "content": item["text"]}]}


def batches(
    contents: Iterable[dict | str], template: dict, max_inputs: int, max_bytes: int
) -> Iterator[dict]:
    """Request bodies: `template` (scoring, packs, model) with the contents as `inputs`, as many per body as
    fit under max_inputs and max_bytes (a content too large alone still goes alone: the server answers)."""
    overhead = len(msgspec.json.encode({**template, "inputs": []}))
    batch, size = [], overhead
    for index, item in enumerate(contents):
        entry = _content(item, index)
        entry_size = len(msgspec.json.encode(entry)) + 1
        if batch and (len(batch) == max_inputs or size + entry_size > max_bytes):
            yield {**template, "inputs": batch}
            batch, size = [], overhead
        batch.append(entry)
        size += entry_size
    if batch:
        yield {**template, "inputs": batch}


def _halves(body: dict) -> list[dict]:
    inputs = body["inputs"]
    middle = len(inputs) // 2
    return [{**body, "inputs": inputs[:middle]}, {**body, "inputs": inputs[middle:]}]


def _template(scoring: dict | None, packs: list | None, model: str | None) -> dict:
    template = {"scoring": scoring, "packs": packs, "model": model}
    return {k: v for k, v in template.items() if v is not None}


# ---------------------------------------------------------------------------------------------------------


class _Base:
    """What both clients share: their settings, and an httpx client of the class each uses."""

    _http_class: type

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 600.0,
        max_retries: int = 6,
        batch_inputs: int = 64,
        batch_bytes: int = MAX_BODY_BYTES - 64 * 1024,
        transport=None,  # an httpx transport (sync or async, as the client): for tests and proxies
    ):
        self.settings = _settings(base_url, api_key, timeout, max_retries, batch_inputs, batch_bytes)
        self._http = self._http_class(
            base_url=self.settings.base_url,
            headers=self.settings.headers,
            timeout=timeout,
            transport=transport,
        )


class Client(_Base):
    _http_class = httpx.Client

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def _post(self, path: str, body: dict, kind: type):
        for attempt in range(self.settings.max_retries + 1):
            response = None
            try:
                response = self._http.post(path, content=msgspec.json.encode(body))
                _raise_for(response)
                return msgspec.json.decode(response.content, type=kind)
            except (httpx.TransportError, ApiError) as e:
                if not _retryable(e) or attempt == self.settings.max_retries:
                    raise
                time.sleep(_wait(response, attempt))
        raise AssertionError("unreachable")

    def score(self, body: dict) -> api.ScoreResponse:
        return self._post("/v1/score", body, api.ScoreResponse)

    def decide(self, body: dict) -> api.DecisionResult:
        return self._post("/decide", body, api.DecisionResult)

    def decide_shared(self, body: dict) -> api.SharedDecisions:
        return self._post("/decide/shared", body, api.SharedDecisions)

    def systemone(self, body: dict) -> SystemOneResponse:
        """System One: {state, questions: {id: {type, instructions?, criteria?}}} (docs/decision-apis.md)."""
        return self._post("/v1/systemone", body, SystemOneResponse)

    def systemone_batch(self, body: dict) -> SystemOneBatchResponse:
        """{states: [...], questions: {...}}: one System One reply per state, packed in shared passes."""
        return self._post("/v1/systemone/batch", body, SystemOneBatchResponse)

    def decisions(self, body: dict) -> DecisionsResponse:
        """OpenAI's Decisions API: {input, questions: [predicate | choice | score]}."""
        return self._post("/v1/decisions", body, DecisionsResponse)

    def health(self) -> api.Health:
        return msgspec.json.decode(self._http.get("/health").content, type=api.Health)

    def score_many(
        self,
        contents: Iterable[dict | str],
        scoring: dict | None = None,
        packs: list | None = None,
        model: str | None = None,
        progress: Callable[[api.ScoreResponse], None] | None = None,
    ) -> Iterator[api.InputResult]:
        """Every content's result, in order, from as few requests as the limits allow; `progress` is called
        with each response."""
        s = self.settings
        for body in batches(contents, _template(scoring, packs, model), s.batch_inputs, s.batch_bytes):
            yield from self._score_batch(body, progress)

    def _score_batch(self, body: dict, progress) -> Iterator[api.InputResult]:
        try:
            response = self.score(body)
        except ApiError as e:
            if e.code != "too_many_tokens" or len(body["inputs"]) == 1:
                raise
            for half in _halves(body):
                yield from self._score_batch(half, progress)
            return
        if progress is not None:
            progress(response)
        yield from response.results


class AsyncClient(_Base):
    """Client's methods as coroutines, over httpx.AsyncClient."""

    _http_class = httpx.AsyncClient

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *_) -> None:
        await self.aclose()

    async def _post(self, path: str, body: dict, kind: type):
        for attempt in range(self.settings.max_retries + 1):
            response = None
            try:
                response = await self._http.post(path, content=msgspec.json.encode(body))
                _raise_for(response)
                return msgspec.json.decode(response.content, type=kind)
            except (httpx.TransportError, ApiError) as e:
                if not _retryable(e) or attempt == self.settings.max_retries:
                    raise
                await asyncio.sleep(_wait(response, attempt))
        raise AssertionError("unreachable")

    async def score(self, body: dict) -> api.ScoreResponse:
        return await self._post("/v1/score", body, api.ScoreResponse)

    async def decide(self, body: dict) -> api.DecisionResult:
        return await self._post("/decide", body, api.DecisionResult)

    async def decide_shared(self, body: dict) -> api.SharedDecisions:
        return await self._post("/decide/shared", body, api.SharedDecisions)

    async def systemone(self, body: dict) -> SystemOneResponse:
        return await self._post("/v1/systemone", body, SystemOneResponse)

    async def systemone_batch(self, body: dict) -> SystemOneBatchResponse:
        return await self._post("/v1/systemone/batch", body, SystemOneBatchResponse)

    async def decisions(self, body: dict) -> DecisionsResponse:
        return await self._post("/v1/decisions", body, DecisionsResponse)

    async def health(self) -> api.Health:
        return msgspec.json.decode((await self._http.get("/health")).content, type=api.Health)

    async def score_many(
        self,
        contents: Iterable[dict | str],
        scoring: dict | None = None,
        packs: list | None = None,
        model: str | None = None,
        progress: Callable[[api.ScoreResponse], None] | None = None,
    ) -> AsyncIterator[api.InputResult]:
        s = self.settings
        for body in batches(contents, _template(scoring, packs, model), s.batch_inputs, s.batch_bytes):
            async for result in self._score_batch(body, progress):
                yield result

    async def _score_batch(self, body: dict, progress) -> AsyncIterator[api.InputResult]:
        try:
            response = await self.score(body)
        except ApiError as e:
            if e.code != "too_many_tokens" or len(body["inputs"]) == 1:
                raise
            for half in _halves(body):
                async for result in self._score_batch(half, progress):
                    yield result
            return
        if progress is not None:
            progress(response)
        for result in response.results:
            yield result

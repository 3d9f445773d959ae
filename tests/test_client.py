"""spinf_jax.client against the real server (uvicorn on 127.0.0.1), and its retries and splitting against a
mock transport."""

import asyncio
import json

import httpx
import msgspec
import pytest

from spinf_jax import api
from spinf_jax.client import ApiError, AsyncClient, Client, batches
from spinf_jax.server.app import Settings, create_app
from tests.serving import serving

QUERY = {
    "id": "refund",
    "template": "\n\nIs the customer asking for a refund?\nAnswer:{?}",
    "options": [" yes", " no"],
}
TEXTS = [f"Order {1000 + i}: {'please refund me' if i % 2 else 'thanks, all good'}." for i in range(5)]


@pytest.fixture(scope="module")
def url(gemma_engine):
    with serving(create_app(Settings("spinf/gemma-3-270m", api_keys=("k-1",)), gemma_engine)) as url:
        yield url


def test_typed_results_batched_in_order_equal_one_request(url, monkeypatch):
    monkeypatch.setenv("SPINF_BASE_URL", url)
    monkeypatch.setenv("SPINF_API_KEY", "k-1")
    seen = []
    with Client(batch_inputs=2) as client:
        assert client.health().ready
        results = list(client.score_many(TEXTS, scoring={"queries": [QUERY]}, progress=seen.append))
        inputs = [{"id": str(i), "messages": [{"content": t}]} for i, t in enumerate(TEXTS)]
        whole = client.score({"inputs": inputs, "scoring": {"queries": [QUERY]}})
    assert len(seen) == 3 and all(isinstance(r, api.ScoreResponse) for r in seen)  # 2 + 2 + 1 inputs
    assert [r.input_id for r in results] == ["0", "1", "2", "3", "4"]
    assert results == whole.results  # bits: batches do not change scores


def test_async_client_gives_the_same(url):
    async def run():
        async with AsyncClient(url, "k-1", batch_inputs=3) as client:
            items = [{"id": f"t{i}", "text": t} for i, t in enumerate(TEXTS)]
            return [r async for r in client.score_many(items, scoring={"queries": [QUERY]})]

    results = asyncio.run(run())
    with Client(url, "k-1") as client:
        alone = client.score({"messages": [{"content": TEXTS[3]}], "scoring": {"queries": [QUERY]}})
    assert [r.input_id for r in results] == [f"t{i}" for i in range(5)]
    assert results[3].queries == alone.results[0].queries


def test_refusals_raise_with_the_api_code(url):
    with Client(url, "wrong") as client, pytest.raises(ApiError) as e:
        client.score({"messages": [{"content": "x"}], "scoring": {"queries": [QUERY]}})
    assert (e.value.status, e.value.code) == (401, "invalid_api_key")
    with Client(url, "k-1") as client, pytest.raises(ApiError) as e:
        client.score(
            {"messages": [{"content": "x"}], "scoring": {"queries": [QUERY | {"options": [" yes", ""]}]}}
        )
    assert (e.value.code, e.value.param) == ("invalid_option", "scoring.queries[0].options[1]")
    assert e.value.request_id.startswith("req_")


def _scored(request: httpx.Request) -> httpx.Response:
    """A stand-in server: one result per input, each naming its input."""
    body = json.loads(request.content)
    results = [{"input_id": i["id"], "queries": []} for i in body["inputs"]]
    reply = {"id": "s", "object": "score", "created": 0, "model": "m", "system_fingerprint": "fp",
             "results": results, "warnings": [],
             "usage": {"prompt_tokens": 1, "prompt_tokens_details": {"content_tokens": 1, "query_tokens": 0,
                                                                      "floor_tokens": 0}}}  # fmt: skip
    return httpx.Response(200, content=msgspec.json.encode(reply))


def _refusal(status: int, code: str, **headers) -> httpx.Response:
    error = {"error": {"type": "x", "code": code, "message": code, "param": None}, "request_id": "req_1"}
    return httpx.Response(status, json=error, headers=headers)


def test_429_and_503_are_retried_after_retry_after_and_400_is_not():
    calls = []

    def handler(request):
        calls.append(request)
        if len(calls) == 1:
            return _refusal(429, "concurrency_limit", **{"retry-after": "0"})
        if len(calls) == 2:
            return _refusal(503, "warming_up", **{"retry-after": "0"})
        return _scored(request)

    client = Client("http://x", transport=httpx.MockTransport(handler))
    assert [r.input_id for r in client.score_many(["a", "b"])] == ["0", "1"] and len(calls) == 3
    client = Client(
        "http://x",
        max_retries=1,
        transport=httpx.MockTransport(lambda r: _refusal(429, "concurrency_limit", **{"retry-after": "0"})),
    )
    with pytest.raises(ApiError):
        client.score_many(["a"]).__next__()
    refused = []
    client = Client(
        "http://x",
        transport=httpx.MockTransport(lambda r: refused.append(r) or _refusal(400, "invalid_request")),
    )
    with pytest.raises(ApiError):
        client.score({"messages": [{"content": "a"}]})
    assert len(refused) == 1


def test_a_batch_over_the_token_limit_is_split():
    sizes = []

    def handler(request):
        n = len(json.loads(request.content)["inputs"])
        sizes.append(n)
        return _refusal(400, "too_many_tokens") if n > 2 else _scored(request)

    client = Client("http://x", batch_inputs=8, transport=httpx.MockTransport(handler))
    results = list(client.score_many([f"text {i}" for i in range(7)]))
    assert [r.input_id for r in results] == [str(i) for i in range(7)]
    assert sizes == [7, 3, 1, 2, 4, 2, 2]  # refused batches are halved until each fits


def test_batches_stay_under_the_body_limit():
    contents = ["x" * 1000] * 10
    bodies = list(batches(contents, {"scoring": {"queries": [QUERY]}}, max_inputs=100, max_bytes=3500))
    assert [len(b["inputs"]) for b in bodies] == [3, 3, 3, 1]
    assert all(len(msgspec.json.encode(b)) <= 3500 for b in bodies)

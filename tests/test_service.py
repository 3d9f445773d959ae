"""spinf_jax.service: one model's engine, scorer and decider, built once, as the server, the CLI, Ray's actors
and notebooks build them."""

from spinf_jax.compiler import Limits
from spinf_jax.packs.loader import load_packs
from spinf_jax.service import Service

REFUND = {"id": "refund", "template": "\n\nA refund?\nAnswer:{?}", "options": [" yes", " no"]}
BODY = {"messages": [{"content": "I was charged twice for September."}], "scoring": {"queries": [REFUND]}}


def test_a_service_is_one_engine_with_its_scorer_and_decider(gemma_engine):
    """Service.over hands its limits, packs and calibration to both halves; the engine's own score and
    decide go through its service, built on first use with the official packs and the default limits."""
    limits = Limits(allow_remote_media=True, remote_media_timeout_s=2.0)
    service = Service.over(gemma_engine, packs={}, limits=limits)
    assert service.scorer.engine is service.decider.engine is gemma_engine
    assert service.scorer.limits is service.decider.limits is limits and service.packs == {}
    assert gemma_engine.service is gemma_engine.service and gemma_engine.service.scorer.limits == Limits()
    assert set(gemma_engine.service.packs) == set(load_packs()) != set()
    results = gemma_engine.score(BODY)["results"]
    assert results == gemma_engine.service.score(BODY)["results"] == service.score(BODY)["results"]

"""spinf_jax.service: one model's engine, scorer and decider, built once, as the server, the CLI, Ray's actors
and notebooks build them."""

from spinf_jax.packs.loader import load_packs
from spinf_jax.service import Service
from tests.spec_example import SPEC_REQUEST
from tests.test_decisions import SENTIMENT, _alone


def test_a_service_answers_as_its_engine_does(gemma_engine):
    """Service.over builds the scorer and decider over one engine, with the packs it is given; the engine's
    own score and decide go through its service (the official packs, the default limits): the same bits."""
    assert Service.over(gemma_engine, packs={}).packs == {}
    service = Service.over(gemma_engine)  # the official packs, which the SPEC's example names
    assert service.scorer.engine is service.decider.engine is gemma_engine
    assert service.score(SPEC_REQUEST)["results"] == gemma_engine.score(SPEC_REQUEST)["results"]
    assert (
        service.decide(_alone(SENTIMENT))["probabilities"]
        == gemma_engine.decide(_alone(SENTIMENT))["probabilities"]
    )
    assert set(gemma_engine.service.packs) == set(load_packs()) != set()

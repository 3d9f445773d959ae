import os

import pytest

# Tests run on the CPU with f32 matmuls at full precision, whatever machine they are on.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")


@pytest.fixture(scope="session")
def gemma_engine():
    """The default model (Gemma 3 270M) in fp32, shared by the engine and server tests (it compiles once)."""
    from spinf_jax.engine import Engine
    from spinf_jax.packer import Buckets

    return Engine.load("spinf/gemma-3-270m", "fp32", buckets=Buckets((256, 512, 1024), block=64))


@pytest.fixture(scope="session")
def smollm_engine():
    """SmolLM2-135M-Instruct in fp32: the chat-templated model that decisions are read from."""
    from spinf_jax.engine import Engine
    from spinf_jax.packer import Buckets

    return Engine.load("spinf/smollm2-135m-instruct", "fp32", buckets=Buckets((256, 512, 1024), block=64))


@pytest.fixture(scope="session")
def default_url(gemma_engine):
    """`spinf-jax serve` on the default model (fp32 here, small buckets: the CPU), for the tests that only ask
    it things."""
    from spinf_jax.server.app import Settings, create_app
    from tests.serving import serving

    with serving(create_app(Settings("spinf/gemma-3-270m"), gemma_engine)) as url:
        yield url

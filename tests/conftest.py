import os
from pathlib import Path

import pytest

# Tests run on the CPU with f32 matmuls at full precision, whatever machine they are on.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# One persistent compile cache for the session and the processes it starts: every engine of the same model,
# precision and buckets compiles the same programs, so each program is compiled once and then read from disk
# (JAX keys an entry by the program, the compile options and the versions). Under the checkout, so a fresh
# clone starts cold, as CI does, and a developer's later runs start warm.
COMPILE_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "jax"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(COMPILE_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

import tests.profiles  # noqa: E402, F401 - the Hypothesis profiles, before any test module is read


@pytest.fixture(scope="session")
def gemma_engine():
    """The default model (Gemma 3 270M) in fp32, shared by the engine and server tests (it compiles once)."""
    from tests import engines

    return engines.engine("spinf/gemma-3-270m")


@pytest.fixture(scope="session")
def smollm_engine():
    """SmolLM2-135M-Instruct in fp32: the chat-templated model that decisions are read from."""
    from tests import engines

    return engines.engine("spinf/smollm2-135m-instruct")


@pytest.fixture(scope="session")
def default_url(gemma_engine):
    """`spinf-jax serve` on the default model (fp32 here, small buckets: the CPU), for the tests that only ask
    it things."""
    from spinf_jax.server.app import Settings, create_app
    from tests.serving import serving

    with serving(create_app(Settings("spinf/gemma-3-270m"), gemma_engine)) as url:
        yield url


@pytest.hookimpl(trylast=True)  # after `-m` has deselected what it deselects
def pytest_collection_modifyitems(config, items):
    """A docs file's first example is run by test_the_examples_run too (every example of the file, the slow
    tier): where both are selected, the fast tier's copy is dropped rather than run twice."""
    everything = {item.name for item in items if item.originalname == "test_the_examples_run"}
    twice = [
        item
        for item in items
        if item.originalname == "test_the_first_example_runs"
        and item.name.replace("test_the_first_example_runs", "test_the_examples_run") in everything
    ]
    if twice:
        config.hook.pytest_deselected(items=twice)
        items[:] = [item for item in items if item not in twice]
    items.sort(key=lambda item: LONGEST_FIRST.get(item.path.name, len(LONGEST_FIRST)))  # stable


# xdist (`--dist loadfile --no-loadscope-reorder`) hands whole files to the two workers in collection order,
# the next file to whichever worker is nearly done. With the longest files first the short ones fill in
# around them and both workers end together. xdist's own order (most tests first) gave workers of 691 and
# 761 s in a cold run of the whole suite; this order, simulated on the same run's file times, 726 and 726 s
# (benchmarks/results/test-suite.md, 2026-12-04 "Workers that end together": the file seconds, longest first).
LONGEST_FIRST = {
    name: rank
    for rank, name in enumerate(
        ["test_parity.py", "test_docs.py", "test_extraction.py", "test_layout.py", "test_decisions.py",
         "test_packs.py", "test_engine.py", "test_server.py", "test_limits.py", "test_fuzz.py"]
    )
}  # fmt: skip

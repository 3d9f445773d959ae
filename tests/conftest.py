import collections
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
    _schedule_by_file(items)


def _schedule_by_file(items) -> None:
    """The order in which xdist hands out files (`--dist loadfile --no-loadscope-reorder`). A worker takes
    its next file when two of its tests are left, so a run ends on the files queued last: xdist's own order
    (most tests first) queues the one-test files last, and those are the suite's subprocess and fuzz tests
    (10-70 s each), which left one worker 110 s behind the other (2-core machine, 2026-12-04). Files of one
    or two tests go first here, then most tests first as before; a file's tests keep their order."""

    def file(item) -> str:
        return item.nodeid.split("::")[0]

    count = collections.Counter(map(file, items))
    items.sort(key=lambda item: (count[file(item)] > 2, -count[file(item)], file(item)))

import collections
import gc
import os
import resource
from pathlib import Path

import pytest

# Tests run on the CPU with f32 matmuls at full precision, whatever machine they are on.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# One persistent compile cache for the servers the session starts as processes of their own: they compile the
# same programs, so each is compiled once and then read from disk (JAX keys an entry by the program, the
# compile options and the versions). Under the checkout, so a fresh clone starts cold, as CI does. The test
# workers themselves keep no persistent cache (pytest_configure): writing one, XLA aborted a worker inside
# executable.serialize() in two of three clean runs on 2026-12-07, and pytest-xdist then hung with both
# workers idle until CI's limit (a crashed worker replaced under --dist loadfile).
COMPILE_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "jax"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(COMPILE_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

import tests.profiles  # noqa: E402, F401 - the Hypothesis profiles, before any test module is read


def pytest_configure(config):
    import jax

    jax.config.update("jax_enable_compilation_cache", False)


# XLA keeps each compiled program's machine code in memory mappings of its own, about three per code object,
# for as long as the program lives; a worker that had compiled most of the suite's programs and kept every
# shared engine held 47,698 mappings, near the kernel's limit (vm.max_map_count, 65,530 by default). Past it
# an mmap inside XLA's compiler fails and the worker dies with a segmentation fault in
# backend_compile_and_load, at whichever test compiles then (2026-12-07: 5 of 6 clean runs). So after a test
# file's last test, a worker past half the limit forgets the shared models and engines and JAX's caches; the
# files after it load and compile what they need again.
MAP_LIMIT = Path("/proc/sys/vm/max_map_count")
RELEASED: list[str] = []  # when this process released its programs, said with its peak memory at the end


def _mappings() -> int:
    with open("/proc/self/maps", "rb") as maps:
        return sum(1 for _ in maps)


@pytest.hookimpl(trylast=True)  # after the file's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    if not MAP_LIMIT.exists() or (nextitem is not None and nextitem.path == item.path):
        return
    share = float(os.environ.get("SPINF_TEST_MAPPINGS_SHARE", "0.5"))
    if _mappings() > share * int(MAP_LIMIT.read_text()):
        import jax

        from tests import engines

        before = _mappings()
        engines.release()
        jax.clear_caches()
        gc.collect()
        RELEASED.append(f"after {item.path.name}: {before:,} mappings, {_mappings():,}")


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
    """A docs file's first example is run again where every example of the file runs (in process or in a
    fresh shell, tests/test_docs.py): where both are selected, the fast tier's copy is dropped rather than run
    twice."""
    _leave_out_the_full_tier(config, items)
    everything = {
        item.name.split("[", 1)[1]
        for item in items
        if item.originalname in ("test_the_examples_run", "test_the_examples_run_in_a_fresh_shell")
    }
    twice = [
        item
        for item in items
        if item.originalname == "test_the_first_example_runs" and item.name.split("[", 1)[1] in everything
    ]
    if twice:
        config.hook.pytest_deselected(items=twice)
        items[:] = [item for item in items if item not in twice]
    _schedule_by_file(items)


def _leave_out_the_full_tier(config, items) -> None:
    """Tests marked `full` (the other precisions of the real models, the whole fuzz, ...) run only where the
    `-m` expression names that tier (`pytest -m full`, the release checklist): CI's `pytest` and the fast
    tier's `-m "not slow"` leave them out without saying so."""
    if "full" in (config.option.markexpr or ""):
        return
    full = [item for item in items if item.get_closest_marker("full")]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if item not in full]


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


# Each worker's peak memory, said at the end of the run (CI's log then tells whether a run came near the
# machine's memory): a worker sends its own in `workeroutput`, the controller prints them.
PEAKS: dict[str, tuple[float, float]] = {}
RELEASES: dict[str, list[str]] = {}


def _peak_mib(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # KiB on Linux


def pytest_sessionfinish(session):
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["peak_rss_mib"] = (_peak_mib(resource.RUSAGE_SELF), _peak_mib(resource.RUSAGE_CHILDREN))
        output["released"] = RELEASED


def pytest_testnodedown(node, error):
    if "peak_rss_mib" in getattr(node, "workeroutput", {}):
        PEAKS[node.gateway.id] = node.workeroutput["peak_rss_mib"]
        RELEASES[node.gateway.id] = node.workeroutput.get("released", [])


def pytest_terminal_summary(terminalreporter):
    if not PEAKS:
        PEAKS["main"] = (_peak_mib(resource.RUSAGE_SELF), _peak_mib(resource.RUSAGE_CHILDREN))
        RELEASES["main"] = RELEASED
    for who, (own, child) in sorted(PEAKS.items()):
        line = f"peak RSS {who}: {own:,.0f} MiB; its largest child process {child:,.0f} MiB"
        if RELEASES.get(who):
            line += f"; programs released {'; '.join(RELEASES[who])}"
        terminalreporter.write_line(line)

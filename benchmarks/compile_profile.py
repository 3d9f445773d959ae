"""Where a test run's time goes to JAX: a pytest plugin that records, per test, its wall time and JAX's own
compile events (tracing, lowering to MLIR, XLA's backend compile), and every program the persistent compile
cache was asked for: hit, miss, and each compiled program's name and compile time. Then a summary of the
files it wrote (one per xdist worker).

    PYTHONPATH=benchmarks pytest -p compile_profile            # writes compile-profile-<worker>.json
    python benchmarks/compile_profile.py compile-profile-*.json  # the summary, as markdown

COMPILE_PROFILE_OUT sets the files' prefix (default: compile-profile in the current folder). JAX is imported
only when the session starts, after the rootdir conftest has set JAX's environment (its compile cache folder
is read when JAX is first imported).
"""

import collections
import json
import os
import sys
import time

import pytest

_events = collections.Counter()  # this test's JAX event durations, by event name
_tests = {}  # test id → {"wall": s, event: s}
_programs = []  # [test id, "hit" | "miss" | "compiled", module name, cache key suffix, seconds]
_current = ["<outside a test>"]


def _listen(event: str, duration: float, **_) -> None:
    _events[event.rsplit("/", 1)[-1]] += duration


def pytest_sessionstart(session) -> None:
    import jax.monitoring
    from jax._src import compiler  # no public hook names the program a cache lookup is for

    jax.monitoring.register_event_duration_secs_listener(_listen)
    read, write = compiler._cache_read, compiler._cache_write

    def cache_read(module_name, cache_key, *args, **kwargs):
        start = time.perf_counter()
        executable, compile_time = read(module_name, cache_key, *args, **kwargs)
        kind = "miss" if executable is None else "hit"
        _programs.append([_current[0], kind, module_name, cache_key[-16:], time.perf_counter() - start])
        return executable, compile_time

    def cache_write(cache_key, compile_time_secs, module_name, *args, **kwargs):
        _programs.append([_current[0], "compiled", module_name, cache_key[-16:], compile_time_secs])
        return write(cache_key, compile_time_secs, module_name, *args, **kwargs)

    compiler._cache_read, compiler._cache_write = cache_read, cache_write


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _events.clear()
    _current[0] = item.nodeid
    start = time.perf_counter()
    yield
    _tests[item.nodeid] = {"wall": time.perf_counter() - start, **_events}


def pytest_sessionfinish(session) -> None:
    if not _tests:  # the xdist controller runs no test
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    prefix = os.environ.get("COMPILE_PROFILE_OUT", "compile-profile")
    with open(f"{prefix}-{worker}.json", "w") as f:
        json.dump({"tests": _tests, "programs": _programs}, f)


COMPILING = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")


def summary(paths: list[str]) -> str:
    tests, programs = {}, []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        tests |= data["tests"]
        programs += data["programs"]
    wall = sum(t["wall"] for t in tests.values())
    spent = {e: sum(t.get(e, 0.0) for t in tests.values()) for e in COMPILING}
    compiled = [p for p in programs if p[1] == "compiled"]
    by_key = collections.Counter(p[3] for p in compiled)
    again = sum(p[4] for p in compiled if by_key[p[3]] > 1) - sum(
        min(p[4] for p in compiled if p[3] == key) for key, n in by_key.items() if n > 1
    )
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for p in compiled:
        by_name[p[2]][0] += 1
        by_name[p[2]][1] += p[4]
    per_test = sorted(tests.items(), key=lambda kv: -sum(kv[1].get(e, 0.0) for e in COMPILING))
    lines = [
        f"{len(tests)} tests, {wall:.0f} s in tests: tracing {spent[COMPILING[0]]:.0f} s, lowering "
        f"{spent[COMPILING[1]]:.0f} s, XLA compiling {spent[COMPILING[2]]:.0f} s; {len(compiled)} programs "
        f"compiled ({sum(p[4] for p in compiled):.0f} s), {sum(p[1] == 'hit' for p in programs)} read from "
        f"the cache, {again:.0f} s compiling a program again that another worker had compiled",
        "",
        "| program | compiled | seconds |",
        "|---|---|---|",
        *(
            f"| `{name}` | {n} | {s:.1f} |"
            for name, (n, s) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
        ),
        "",
        "| test | wall | tracing + lowering + compiling |",
        "|---|---|---|",
        *(
            f"| {name} | {t['wall']:.1f} | {sum(t.get(e, 0.0) for e in COMPILING):.1f} |"
            for name, t in per_test[:20]
        ),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1:]))

"""Per-file totals and the slowest tests of a pytest JUnit XML report, as Markdown tables; with --write, the
per-file seconds as JSON for tests/conftest.py, which hands the files to the two workers longest first.

    pytest --junitxml=run.xml
    python benchmarks/test_durations.py run.xml [N] [--write tests/file_seconds.json]

A shared fixture's set-up (a session engine, a test server) is counted in the first test that asks for it."""

import collections
import json
import sys
import xml.etree.ElementTree as ET


def main(path: str, slowest: int = 40, write: str | None = None) -> None:
    cases = [
        (float(c.get("time")), c.get("classname").removeprefix("tests."), c.get("name"))
        for c in ET.parse(path).getroot().iter("testcase")
    ]
    seconds, count = collections.Counter(), collections.Counter()
    for t, module, _ in cases:
        seconds[module] += t
        count[module] += 1
    total = sum(seconds.values())
    print(
        f"{len(cases)} tests, {total:.0f} s in tests\n\n| file | tests | seconds | share |\n|---|---|---|---|"
    )
    for module, t in seconds.most_common():
        print(f"| {module} | {count[module]} | {t:.1f} | {100 * t / total:.1f}% |")
    print(f"\n| the {slowest} slowest | seconds |\n|---|---|")
    for t, module, name in sorted(cases, reverse=True)[:slowest]:
        print(f"| {module}::{name} | {t:.1f} |")
    if write:
        files = {f"tests/{module}.py": round(t, 1) for module, t in sorted(seconds.items())}
        with open(write, "w") as out:
            out.write(json.dumps(files, indent=1) + "\n")


if __name__ == "__main__":
    args = sys.argv[1:]
    written = args[args.index("--write") + 1] if "--write" in args else None
    args = [a for a in args if a not in ("--write", written)]
    main(args[0], *map(int, args[1:2]), write=written)

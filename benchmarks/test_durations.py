"""Per-file totals and the slowest tests of a pytest JUnit XML report, as Markdown tables.

    pytest --junitxml=run.xml; python benchmarks/test_durations.py run.xml [N]

A shared fixture's set-up (a session engine, a test server) is counted in the first test that asks for it."""

import collections
import sys
import xml.etree.ElementTree as ET


def main(path: str, slowest: int = 40) -> None:
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


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))

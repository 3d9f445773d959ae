"""Bulk scoring: a JSON Lines (or CSV) file of contents through the engine (in this process) or a server, into
a JSON Lines file of results, one line per content, in batches that are written and flushed as they finish.

Two kinds of job (`Kind`): SCORING asks every content the scoring API's questions (`inputs` requests), and
SYSTEMONE asks every state a System One question set (`/v1/systemone/batch` requests): a line is then
{"id", "state"} (text, an object or an array) or {"id", "text"}, and a CSV row without a `state` or `text`
column is read as a state of its own, the row as an object; an output line is the state's System One reply
with its "input_id".

An input line is {"id": ..., "text": ...} or {"id": ..., "messages": [...]} (an `inputs` entry of the API; its
own "queries" and "query_ids" are kept). An output line is the content's result ({"input_id", "queries",
"packs"?}) with "request_sha256": the hash of what was asked (the content and the request's scoring, packs
and model), so a restart skips exactly the contents already answered for this request, and a changed
question is asked again. A line that cannot be read, or that the API refuses (a content over the limit, a
bad query of its own), is reported with its line number and skipped; the rest of its batch is scored.
"""

import csv
import hashlib
import json
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from spinf_jax.runner import Runner

Backend = Callable[[dict], object]  # a batch's request body → its response (the Kind's)


@dataclass(frozen=True)
class Kind:
    """What a batch's entries are sent as, and how its response answers each."""

    field: str  # the request's list of contents
    entry: Callable[[dict, str], dict | None]  # a line's item (and its default id) → its entry, or None
    why_not: str  # what a line that gives no entry lacks
    results: Callable[[object], list]
    tokens: Callable[[object], int]

    def body(self, template: dict, entries: list[dict]) -> dict:
        if self.field == "states":
            return {**template, "states": [entry["state"] for entry in entries]}
        return {**template, "inputs": entries}

    def row(self, entry: dict, result) -> dict:
        return {"input_id": entry["id"], **msgspec.to_builtins(result)}


def entry_of(item, default_id: str) -> dict | None:
    """An input line's (or a dataset row's) `inputs` entry; None unless it has text or messages, not both."""
    if not isinstance(item, dict) or ("text" in item) == ("messages" in item):
        return None
    entry = {k: v for k, v in item.items() if k not in ("text", "id")}
    if "text" in item:
        entry["messages"] = [{"role": "user", "content": item["text"]}]
    entry["id"] = str(item.get("id", default_id))
    return entry


def state_of(item, default_id: str) -> dict | None:
    """A line's System One state: its `state`, else its `text`, else (a CSV row, or an object of other
    fields) the item itself without its id."""
    if not isinstance(item, dict):
        return None
    rest = {k: v for k, v in item.items() if k != "id"}
    state = item.get("state", item.get("text", rest))
    return {"id": str(item.get("id", default_id)), "state": state} if state not in ("", {}, None) else None


SCORING = Kind("inputs", entry_of, "an object with text or messages", lambda r: r.results,
               lambda r: r.usage.prompt_tokens)  # fmt: skip
SYSTEMONE = Kind("states", state_of, "an object with a state", lambda r: r.results,
                 lambda r: r.total_usage.input_tokens)  # fmt: skip


@dataclass
class Summary:
    scored: int = 0
    already_done: int = 0
    bad: list[str] = field(default_factory=list)  # "line N: why"
    seconds: float = 0.0
    prompt_tokens: int = 0

    def line(self) -> str:
        rate = self.scored / self.seconds if self.seconds else 0.0
        tokens = f", {self.prompt_tokens:,} tokens" if self.prompt_tokens else ""  # Ray's rows do not say
        return (
            f"scored {self.scored:,} in {self.seconds:.1f} s ({rate:,.1f}/s{tokens}); "
            f"{self.already_done:,} already in the output; {len(self.bad):,} bad lines skipped"
        )


def request_sha256(entry: dict, template: dict) -> str:
    canonical = json.dumps({"input": {k: v for k, v in entry.items() if k != "id"}, "request": template},
                           sort_keys=True, ensure_ascii=False)  # fmt: skip
    return hashlib.sha256(canonical.encode()).hexdigest()


def finished(out: Path) -> set[tuple[str, str]]:
    """(input id, request hash) of every complete line already in the output (a torn last line is not)."""
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            try:
                row = json.loads(line)
                done.add((row["input_id"], row["request_sha256"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return done


def items(path: Path, bad: list[str], on_bad) -> Iterator[tuple[int, object]]:
    """(line number, item) of a JSON Lines file's lines, or of a CSV file's rows (the header is line 1; a row
    is an object of its columns)."""
    with path.open(newline="") as f:
        if path.suffix.lower() == ".csv":
            yield from enumerate(csv.DictReader(f), 2)
            return
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                bad.append(f"line {n}: not JSON ({e})")
                on_bad()


def read_inputs(
    path: Path, bad: list[str], on_bad=lambda: None, kind: Kind = SCORING
) -> Iterator[tuple[int, dict]]:
    """(line number, entry) of each good line; the others are reported into `bad` (and on_bad called)."""
    for n, item in items(path, bad, on_bad):
        entry = kind.entry(item, str(n))
        if entry is None:
            bad.append(f"line {n}: {kind.why_not}")
            on_bad()
            continue
        yield n, entry


def run(
    source: Path,
    out: Path,
    template: dict,
    backend: Backend,
    batch: int = 64,
    progress=None,
    in_flight: int = 1,
    kind: Kind = SCORING,
) -> Summary:
    """Score every content of `source` not already answered in `out` for this request (`template`: scoring,
    packs, model), appending to `out`. With `in_flight` > 1 that many batches are asked at once (a server,
    or the replicas of `serve --devices`); they are written in input order all the same."""
    summary, start = Summary(), time.perf_counter()
    done = finished(out)
    skipped = (lambda: progress.update(1)) if progress is not None else (lambda: None)
    with out.open("a") as sink, ThreadPoolExecutor(in_flight, thread_name_prefix="spinf-bulk") as pool:
        asked: deque[Future[Batch]] = deque()
        pending: list[tuple[int, dict, str]] = []
        for n, entry in read_inputs(source, summary.bad, skipped, kind):
            digest = request_sha256(entry, template)
            if (entry["id"], digest) in done:
                summary.already_done += 1
                skipped()
                continue
            pending.append((n, entry, digest))
            if len(pending) == batch:
                asked.append(pool.submit(score_batch, pending, template, backend, kind=kind))
                pending = []
                if len(asked) == in_flight:  # the oldest is written before another is asked
                    asked.popleft().result().write(sink, summary, progress)
        if pending:
            asked.append(pool.submit(score_batch, pending, template, backend, kind=kind))
        while asked:
            asked.popleft().result().write(sink, summary, progress)
    summary.seconds = time.perf_counter() - start
    # By line number: with batches in flight, a line the API refused is known only when its batch is written.
    summary.bad.sort(key=lambda why: int(why.split(":")[0].removeprefix("line ")))
    return summary


@dataclass
class Batch:
    """What a batch came to, by the number of each input (its line): its output line, or why the API refused
    it."""

    lines: dict[int, str] = field(default_factory=dict)
    bad: dict[int, str] = field(default_factory=dict)
    prompt_tokens: int = 0

    def write(self, sink, summary: Summary, progress) -> None:
        sink.writelines(line for _, line in sorted(self.lines.items()))
        sink.flush()
        summary.scored += len(self.lines)
        summary.bad += [f"line {n}: {why}" for n, why in sorted(self.bad.items())]
        summary.prompt_tokens += self.prompt_tokens
        if progress is not None:
            progress.update(len(self.lines) + len(self.bad))


def score_batch(
    pending, template: dict, backend: Backend, into: Batch | None = None, kind: Kind = SCORING
) -> Batch:
    """One batch of (number, entry, request hash) scored; an input the API refuses is reported and the rest
    asked again."""
    into = Batch() if into is None else into
    pending = list(pending)
    which_input = re.compile(rf"^{kind.field}\[(\d+)\]")
    while pending:
        try:
            response = backend(kind.body(template, [entry for _, entry, _ in pending]))
        except Exception as e:  # noqa: BLE001 - ScoringError in process, ApiError from a server
            if getattr(e, "code", None) == "too_many_tokens" and len(pending) > 1:
                # The batch as a whole is over the request's token limit; each half may not be.
                half = len(pending) // 2
                score_batch(pending[:half], template, backend, into, kind)
                return score_batch(pending[half:], template, backend, into, kind)
            which = which_input.match(getattr(e, "param", None) or "")
            if which is None:
                raise
            n, _, _ = pending.pop(int(which.group(1)))
            into.bad[n] = f"{getattr(e, 'code', 'error')}: {getattr(e, 'message', e)}"
            continue
        for (n, entry, digest), result in zip(pending, kind.results(response), strict=True):
            row = kind.row(entry, result) | {"request_sha256": digest}
            into.lines[n] = json.dumps(row, ensure_ascii=False) + "\n"
        into.prompt_tokens += kind.tokens(response)
        return into
    return into


def in_process(asker, runner=None) -> Backend:
    """A Backend over what plans a request body and finishes its plan (`plan`, `finish`, `engine`): a
    spinf_jax.scoring.Scorer, or spinf_jax.decision_apis.SystemOneBatches. Through `runner` (a
    spinf_jax.runner.Runner over its engine, as the server's), several batches in flight (`run`'s in_flight)
    keep the device busy: while one batch's passes run, the caller's threads plan the next, which the runner
    launches behind them, and its finisher threads answer the last. Without one, each call plans, scores and
    finishes in turn."""

    def ask(body: dict):
        plan = asker.plan(body)
        if runner is None:
            return asker.finish(plan, asker.engine.score_trees(plan.trees))
        return runner.submit(plan, asker.finish).result()

    return ask


@contextmanager
def pipelined(asker) -> Iterator[Backend]:
    """`in_process` through a Runner of its own (the server's batching), closed on leaving: for `run` with
    in_flight ≥ 2."""
    # No queue limit: the caller's in_flight bounds what waits (a server's is for clients it cannot see).
    runner = Runner(asker.engine, max_queue=sys.maxsize)
    try:
        yield in_process(asker, runner)
    finally:
        runner.close()


def count_lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def report(summary: Summary) -> None:
    for problem in summary.bad:
        print(f"spinf-jax score: {problem}", file=sys.stderr)
    print(summary.line(), file=sys.stderr)

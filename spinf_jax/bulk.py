"""Bulk scoring: a JSON Lines file of contents through the engine (in this process) or a server, into a JSON
Lines file of results, one line per content, in batches that are written and flushed as they finish.

An input line is {"id": ..., "text": ...} or {"id": ..., "messages": [...]} (an `inputs` entry of the API; its
own "queries" and "query_ids" are kept). An output line is the content's result ({"input_id", "queries",
"packs"?}) with "request_sha256": the hash of what was asked (the content and the request's scoring, packs
and model), so a restart skips exactly the contents already answered for this request, and a changed
question is asked again. A line that cannot be read, or that the API refuses (a content over the limit, a
bad query of its own), is reported with its line number and skipped; the rest of its batch is scored.
"""

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

from spinf_jax import api
from spinf_jax.runner import Runner

Backend = Callable[[dict], api.ScoreResponse]  # an `inputs` request body → its response
_INPUT_PARAM = re.compile(r"^inputs\[(\d+)\]")


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


def read_inputs(path: Path, bad: list[str], on_bad=lambda: None) -> Iterator[tuple[int, dict]]:
    """(line number, `inputs` entry) of each good line; the others are reported into `bad` (and on_bad
    called)."""
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                bad.append(f"line {n}: not JSON ({e})")
                on_bad()
                continue
            entry = entry_of(item, default_id=str(n))
            if entry is None:
                bad.append(f"line {n}: an object with text or messages")
                on_bad()
                continue
            yield n, entry


def entry_of(item, default_id: str) -> dict | None:
    """An input line's (or a dataset row's) `inputs` entry; None unless it has text or messages, not both."""
    if not isinstance(item, dict) or ("text" in item) == ("messages" in item):
        return None
    entry = {k: v for k, v in item.items() if k not in ("text", "id")}
    if "text" in item:
        entry["messages"] = [{"role": "user", "content": item["text"]}]
    entry["id"] = str(item.get("id", default_id))
    return entry


def run(
    source: Path,
    out: Path,
    template: dict,
    backend: Backend,
    batch: int = 64,
    progress=None,
    in_flight: int = 1,
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
        for n, entry in read_inputs(source, summary.bad, skipped):
            digest = request_sha256(entry, template)
            if (entry["id"], digest) in done:
                summary.already_done += 1
                skipped()
                continue
            pending.append((n, entry, digest))
            if len(pending) == batch:
                asked.append(pool.submit(score_batch, pending, template, backend))
                pending = []
                if len(asked) == in_flight:  # the oldest is written before another is asked
                    asked.popleft().result().write(sink, summary, progress)
        if pending:
            asked.append(pool.submit(score_batch, pending, template, backend))
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


def score_batch(pending, template: dict, backend: Backend, into: Batch | None = None) -> Batch:
    """One batch of (number, entry, request hash) scored; an input the API refuses is reported and the rest
    asked again."""
    into = Batch() if into is None else into
    pending = list(pending)
    while pending:
        body = {**template, "inputs": [entry for _, entry, _ in pending]}
        try:
            response = backend(body)
        except Exception as e:  # noqa: BLE001 - ScoringError in process, ApiError from a server
            if getattr(e, "code", None) == "too_many_tokens" and len(pending) > 1:
                # The batch as a whole is over the request's token limit; each half may not be.
                half = len(pending) // 2
                score_batch(pending[:half], template, backend, into)
                return score_batch(pending[half:], template, backend, into)
            which = _INPUT_PARAM.match(getattr(e, "param", None) or "")
            if which is None:
                raise
            n, _, _ = pending.pop(int(which.group(1)))
            into.bad[n] = f"{getattr(e, 'code', 'error')}: {getattr(e, 'message', e)}"
            continue
        for (n, _, digest), result in zip(pending, response.results, strict=True):
            row = msgspec.to_builtins(result) | {"request_sha256": digest}
            into.lines[n] = json.dumps(row, ensure_ascii=False) + "\n"
        into.prompt_tokens += response.usage.prompt_tokens
        return into
    return into


def in_process(scorer, runner=None) -> Backend:
    """A Backend over a spinf_jax.scoring.Scorer. Through `runner` (a spinf_jax.runner.Runner over the
    scorer's engine, as the server's), several batches in flight (`run`'s in_flight) keep the device busy:
    while one batch's passes run, the caller's threads plan the next, which the runner launches behind them,
    and its finisher threads answer the last. Without one, each call plans, scores and finishes in turn."""

    def score(body: dict) -> api.ScoreResponse:
        plan = scorer.plan(body)
        if runner is None:
            return scorer.finish(plan, scorer.engine.score_trees(plan.trees))
        return runner.submit(plan, scorer.finish).result()

    return score


@contextmanager
def pipelined(scorer) -> Iterator[Backend]:
    """`in_process` through a Runner of its own (the server's batching), closed on leaving: for `run` with
    in_flight ≥ 2."""
    # No queue limit: the caller's in_flight bounds what waits (a server's is for clients it cannot see).
    runner = Runner(scorer.engine, max_queue=sys.maxsize)
    try:
        yield in_process(scorer, runner)
    finally:
        runner.close()


def count_lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def report(summary: Summary) -> None:
    for problem in summary.bad:
        print(f"spinf-jax score: {problem}", file=sys.stderr)
    print(summary.line(), file=sys.stderr)

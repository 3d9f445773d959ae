"""Ray Data (the `ray` extra): spinf-jax as a stage of a Dataset pipeline, an engine per actor, one device
each, across every GPU of a cluster (docs/scale-out.md).

    import ray
    from spinf_jax.ray import Scores

    scored = ray.data.read_json("contents.jsonl").map_batches(
        Scores,
        fn_constructor_kwargs={"model": "spinf/gemma-3-270m", "scoring": {"queries": [...]}},
        batch_size=64, concurrency=8, num_gpus=1,
    )

A row is a content as `spinf-jax score` reads a line: `id`, and `text` or `messages` (with its own `queries`
or `query_ids` if it has them); it may name a `pack` (an id, or a list of ids) to ask besides the stage's.
With `systemone` (a System One question set, or a `/v1/systemone/batch` body without its states) a row is a
state instead, as `spinf-jax score --systemone` reads a line, and its `result` that state's System One reply.
Every column comes back, with `result`, the API's result for the content as JSON (what `spinf-jax score`
writes for it, `request_sha256` included), and `error`, why the API refused the row (else null). An actor's
scores are the bits one device gives, whatever rows share its batch, so a task that Ray retries on another
actor, after a node or an actor is lost, writes the same bits.
"""

import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from spinf_jax import bulk
from spinf_jax.errors import ScoringError


class Scores:
    """The callable class for `Dataset.map_batches`: it loads the model once per actor."""

    def __init__(
        self,
        model: str | None = None,
        precision: str | None = None,
        scoring: dict | list | None = None,
        packs: Sequence[str] = (),
        pack_sources: Sequence[str] = (),
        official_packs: bool = True,
        buckets: Sequence[int] | None = None,
        random_weights: str | None = None,
        systemone: dict | None = None,
    ):
        """`random_weights`: for benchmarks, made-up weights at the shape of this transformers config.json
        with `model`'s tokenizer (as `serve --random-weights`)."""
        from spinf_jax.decision_apis import SystemOneBatches
        from spinf_jax.packs.loader import load_packs
        from spinf_jax.service import Service

        loaded = load_packs(list(pack_sources), official=official_packs)
        service = Service.load(model, precision, buckets=buckets, random_weights=random_weights, packs=loaded)
        if systemone is not None:
            self.kind, self.template = bulk.SYSTEMONE, as_systemone(systemone)
            self.backend = bulk.in_process(SystemOneBatches(service.apis))
        else:
            self.kind, self.template = bulk.SCORING, template(scoring, packs)
            self.backend = bulk.in_process(service.scorer)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        refused: dict[int, str] = {}
        groups: dict[tuple[str, ...], list[tuple[int, dict]]] = {}  # by the packs a row asks besides
        for n, row in enumerate(rows):
            item = {k: _plain(v) for k, v in row.items() if v is not None}
            own = _own_packs(item) if self.kind is bulk.SCORING else ()
            entry = self.kind.entry(item, "")
            if entry is None or not entry["id"]:
                refused[n] = f"a row has an id, and is {self.kind.why_not}"
                continue
            groups.setdefault(own, []).append((n, entry))
        done = bulk.Batch()
        for own, members in groups.items():
            asked = with_packs(self.template, own)
            pending = [(n, entry, bulk.request_sha256(entry, asked)) for n, entry in members]
            try:
                bulk.score_batch(pending, asked, self.backend, done, self.kind)
            except ScoringError as e:  # the request itself (no questions asked, an unknown pack): its rows
                refused |= {n: f"{e.code}: {e.message}" for n, _ in members}
        refused |= done.bad
        results = [done.lines[n].rstrip("\n") if n in done.lines else None for n in range(len(rows))]
        errors = [refused.get(n) for n in range(len(rows))]
        return {**batch, "result": np.array(results, dtype=object), "error": np.array(errors, dtype=object)}


def _own_packs(item: dict) -> tuple[str, ...]:
    """A row's `pack` (an id, or a list of ids), taken out of it."""
    own = item.pop("pack", None)
    return (own,) if isinstance(own, str) else tuple(own or ())


def with_packs(asked: dict, own: tuple[str, ...]) -> dict:
    """The request template with a row's own packs asked too."""
    if not own:
        return asked
    return {**asked, "packs": [*asked.get("packs", []), *({"id": pack} for pack in own)]}


def start_local(actors: int) -> None:
    """A Ray instance in this process for `actors` actors. An actor holds a CPU, and Ray Data's read tasks
    want one of their own: on a small machine N CPU actors would leave the reads none, and the job would wait
    forever, so there are at least N + 1 logical CPUs. Under `uv run` Ray would otherwise pack up the
    working directory and have every worker rebuild the uv environment from it, the one the workers already
    share (the setting is read once, when ray is first imported)."""
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray

    ray.init(num_cpus=max(os.cpu_count() or 1, actors + 1), log_to_driver=False)


def as_systemone(asked: dict) -> dict:
    """A System One question set, or a batch body without its states (questions and x_ fields)."""
    return asked if "questions" in asked else {"questions": asked}


def template(scoring: dict | list | None, packs: Sequence[str]) -> dict:
    """What every content is asked: a scoring block (or its list of queries) and pack ids."""
    asked = {}
    if scoring is not None:
        asked["scoring"] = {"queries": scoring} if isinstance(scoring, list) else scoring
    if packs:
        asked["packs"] = [{"id": pack} for pack in packs]
    return asked


def _plain(value):
    """A value of a numpy batch as JSON-like Python: Arrow's lists and structs come as arrays and dicts."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, np.generic):
        return value.item()
    return value


def score_file(
    source: Path,
    out: Path,
    scores: dict,
    actors: int,
    num_gpus: float,
    batch: int = 64,
    progress=None,
) -> bulk.Summary:
    """`spinf-jax score --ray`: a JSON Lines or Parquet file through `actors` Scores actors (`scores`: their
    constructor's arguments) on the Ray cluster this process is connected to, into the JSON Lines `out` in
    input order, as `spinf-jax score` writes it; contents already in `out` for the same request are skipped
    (as the bulk command does), and rows the API refuses are reported by id."""
    import ray.data

    summary, start = bulk.Summary(), time.perf_counter()
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # the output in input order, as `score` writes it
    read = ray.data.read_parquet if source.suffix == ".parquet" else ray.data.read_json
    dataset = read(str(source))
    if scores.get("systemone") is not None:
        asked, kind = as_systemone(scores["systemone"]), bulk.SYSTEMONE
    else:
        asked, kind = template(scores.get("scoring"), scores.get("packs", ())), bulk.SCORING
    done = bulk.finished(out)
    rows = 0
    if done:  # resuming: what is left (a count reads the input once more, only then)
        rows = dataset.count()
        dataset = dataset.filter(_NotDone(done, asked, kind))
    resources = {"num_gpus": num_gpus} if num_gpus else {"num_cpus": 1}
    # Blocks of a batch each: a small file is one block, which would keep all but one actor idle; a large one
    # is split as it streams, not read whole first.
    dataset = dataset.repartition(target_num_rows_per_block=batch)
    scored = dataset.map_batches(
        Scores, fn_constructor_kwargs=scores, batch_size=batch, concurrency=actors, **resources
    )
    with out.open("a") as sink:
        for row in scored.iter_rows():
            if row["result"] is not None:
                sink.write(row["result"] + "\n")
                summary.scored += 1
            else:
                summary.bad.append(f"id {row.get('id')!r}: {row['error']}")
            if progress is not None:
                progress.update(1)
        sink.flush()
    summary.already_done = max(0, rows - summary.scored - len(summary.bad))
    summary.seconds = time.perf_counter() - start
    return summary


class _NotDone:
    """A row filter: contents not already answered for this request (bulk.finished)."""

    def __init__(self, done: set[tuple[str, str]], asked: dict, kind: bulk.Kind):
        self.done, self.asked, self.kind = done, asked, kind

    def __call__(self, row: dict) -> bool:
        item = {k: _plain(v) for k, v in row.items() if v is not None}
        asked = with_packs(self.asked, _own_packs(item) if self.kind is bulk.SCORING else ())
        entry = self.kind.entry(item, "")
        return entry is None or (entry["id"], bulk.request_sha256(entry, asked)) not in self.done

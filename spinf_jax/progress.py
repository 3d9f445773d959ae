"""Progress and logs: loading and compiling as they go, and `serve`'s line per request.

One choice, made here for all of them, by whether the stream is a terminal: a person reads it (tqdm bars,
`key=value` lines) or a program does (one JSON object per line, the bars replaced by log lines now and then).

Log lines are records of Python's logging under the `spinf_jax` logger, each an event and its fields (`log`),
so any logging configuration can send them elsewhere (a plain formatter prints the key=value line); `serve`
sends them to stderr (spinf_jax.server.protocol). Loading and compiling report only to a Progress passed to
them: a notebook or a test that passes none sees nothing.
"""

import datetime
import json
import logging
import sys
import time
from typing import TextIO

from tqdm import tqdm

PROGRESS = logging.getLogger("spinf_jax.progress")


def log(logger: logging.Logger, event: str, level: int = logging.INFO, **fields) -> None:
    if logger.isEnabledFor(level):
        pairs = "".join(f" {key}={_value(value)}" for key, value in fields.items() if value is not None)
        logger.log(level, "%s%s", event, pairs, extra={"event": event, "fields": fields}, stacklevel=2)


def _value(value) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c in text for c in ' "=') else text


class JsonFormatter(logging.Formatter):
    """{"ts", "level", "event", ...the event's fields}: a JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        line = {
            "ts": when.isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "event": getattr(record, "event", record.getMessage()),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class ReplicaTag(logging.Filter):
    """Adds `replica=N` to each line of a `serve --devices` replica: they share the front's stream."""

    def __init__(self, replica: str):
        super().__init__()
        self.replica = replica

    def filter(self, record: logging.LogRecord) -> bool:
        record.fields = {**getattr(record, "fields", {}), "replica": self.replica}
        record.msg = f"{record.msg} replica={self.replica}"
        return True


class KeyValueFormatter(logging.Formatter):
    """`INFO:     12:00:01 event key=value ...` (uvicorn's prefix, so its lines and ours line up); fields
    without a value are left out."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{record.levelname + ':':<9} {self.formatTime(record, '%H:%M:%S')} {record.getMessage()}"
        return line + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


def formatter(stream: TextIO) -> logging.Formatter:
    """The formatter for log lines written to this stream."""
    return KeyValueFormatter() if stream.isatty() else JsonFormatter()


class Progress:
    """Where loading and compiling report their steps (`Engine.load(..., progress=Progress())`, `warmup`):
    a tqdm bar on a terminal, else a line on the spinf_jax.progress logger every tenth of the way or every
    `every_s` seconds, and one for each step that has fields of its own (a compiled program)."""

    def __init__(self, stream: TextIO | None = None, every_s: float = 5.0):
        self.stream = stream or sys.stderr
        self.every_s = every_s


class Steps:
    """`with Steps(progress, "load", n, "tensor") as step:` then step() as each is done, step(**fields)
    to report a step's own fields; progress None: nothing is reported."""

    def __init__(self, progress: Progress | None, event: str, total: int, unit: str):
        self.progress, self.event, self.total, self.unit = progress, event, total, unit
        self.done = self._logged = 0
        self.start = self._logged_at = time.perf_counter()
        self.bar = None
        if progress is not None and progress.stream.isatty():
            self.bar = tqdm(total=total, desc=event, unit=unit, file=progress.stream)

    def __enter__(self) -> "Steps":
        return self

    def __exit__(self, *_) -> None:
        if self.bar is not None:
            self.bar.close()

    def __call__(self, **fields) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update()
        elif self.progress is not None:
            now = time.perf_counter()
            if (
                fields
                or self.done == self.total
                or self.done - self._logged >= self.total / 10
                or now - self._logged_at >= self.progress.every_s
            ):
                self._logged, self._logged_at = self.done, now
                counts = {f"{self.unit}s_done": self.done, f"{self.unit}s": self.total}
                log(PROGRESS, self.event, **counts, **fields, elapsed_s=round(now - self.start, 2))

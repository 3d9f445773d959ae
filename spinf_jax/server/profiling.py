"""A trace of the serving process (POST /v1/admin/profile) that holds the device back only while the profiler
turns on and off.

Starting or stopping the profiler while the engine thread launched a pass crashed the server on an H100
(2026-12-06), so both happen inside Runner.quiet(). jax.profiler.stop_trace() also writes the trace, and
writing a 10 s trace of busy 12B serving (over 400,000 kernels) took over a minute: held inside quiet(),
every request waited that long. Here the session's stop is held apart from its export, which runs with
launches going on (the export releases the GIL). jax.profiler has no public call that stops without
exporting, hence jaxlib's ProfilerSession."""

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import jax
from jax._src.lib import _profiler

from spinf_jax.progress import PROGRESS, log


@dataclass(frozen=True)
class Traced:
    seconds: float  # the profiler on
    held: float  # no pass launched: the waits for the device to go idle, and the profiler's start and stop
    written: float  # the export, after the device was let go


def trace(folder: Path, seconds: float, quiet=contextlib.nullcontext) -> Traced:
    """Trace the whole process for `seconds` into folder/plugins/profile/<time>/ (an .xplane.pb for XProf or
    TensorBoard, and a .trace.json.gz of Chrome trace events). `quiet` is Runner.quiet where a runner
    launches passes on another thread."""
    start = time.perf_counter()
    with quiet():
        session = _profiler.ProfilerSession(jax.profiler.ProfileOptions())
    traced_from = time.perf_counter()
    try:
        time.sleep(seconds)
    finally:
        stopping = time.perf_counter()
        with quiet():
            traced_to = time.perf_counter()
            xspace = session.stop()
        let_go = time.perf_counter()
    session.export(xspace, str(folder))
    held = (traced_from - start) + (let_go - stopping)
    traced = Traced(traced_to - traced_from, held, time.perf_counter() - let_go)
    log(PROGRESS, "profile", folder=str(folder), traced_s=round(traced.seconds, 2),
        held_s=round(traced.held, 3), written_s=round(traced.written, 2))  # fmt: skip
    return traced

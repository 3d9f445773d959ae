"""One thread owns the device. It gathers the trees of concurrent requests into shared passes: with the device
idle, a request waits for company at most `max_delay` seconds, or until the pending trees fill the largest
bucket; with a batch on the device, what arrives makes the next batch, which is launched behind the running
batch's last pass (Engine.launch's `behind`) just before the device ends that pass (LAUNCH_LEAD), or once it
fills the largest bucket and the device is on that pass: under a steady stream the device goes from batch to
batch without waiting for the host to cut, pack and launch, and the requests that come during the last pass
still make the next one. (Waiting for the device to be done, for more requests to come,
left it idle for that host work between every two batches: at 8 clients of one article each on an H100, the
passes run alone would have taken 85-86% of the wall time; launched behind, 89-90%, and 4.7% more questions a
second; benchmarks/results, 2026-12-06, idle stretches.) This thread does nothing but gather, cut and
launch, and between batches it sleeps on the queue; a waiter thread tells it when the device is on a batch's
last pass and when it is done (_Done), reads the batch's results and hands them to finisher threads, which
build the responses. (Launching a pass holds the thread that launches until the device has taken most of it:
on the H200 at the Gemma 3 12B shape, 458 ms of a 528 ms pass. Answers read on the launching thread went out
most of a pass late.) A batch gathered while the device was busy may launch without its last requests, where
its passes cost less per token without them; they lead the next batch (_split). Scores do not depend on what
shares a pass (see packer), so batching never changes an answer.

It also knows how long the queue will take (tokens waiting over the tokens per second it measured), which is
what a full queue tells clients to wait (Retry-After), and it drops the requests whose clients left. Each
request's future tells how long it waited for its pass and how long that pass took (the request log line)."""

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from spinf_jax.errors import ScoringError

# How long before the device should end a batch's last pass the next batch is launched (behind it): what
# comes until then joins. The host cuts and lays out a batch in a few ms, and the device takes the first
# kernel of a launch 0.6 ms after it begins (benchmarks/results, 2026-12-04). Launched as soon as the device
# was on the last pass, batches of one-article requests from 8 clients settled at 3 articles in 4,096 rows
# (78% useful) on an H100; from a simulation with the passes' measured seconds (runner_hold.py), launched
# this late they take turns at 4,096 and 6,144 rows (93%), however long a launch holds this thread (the old
# way depended on it: launches that held it for under a fifth of their pass left it in the 78% state);
# benchmarks/results, 2026-12-06. On an H100 (2026-12-07) they did: 4,096 and 6,144-row passes, 93% useful,
# 0.94x the library's questions/s (the old runner not run beside it).
LAUNCH_LEAD = 0.01

# A plan is anything with `trees` (spinf_jax.scoring.Plan, spinf_jax.decisions.DecisionPlan); its finish
# turns the plan and its trees' results into the response.
Finish = Callable[[Any, list], Any]
FINISHERS = 2  # threads building responses: they hold the GIL, so more would only interleave


class QueueFull(Exception):
    pass


class _Done:
    """Put on the queue by the waiter thread once the device is on a launch's last pass (finished False) and
    once it has finished it: the engine thread sleeps on the queue alone, woken by a request or by this,
    instead of asking the device every millisecond."""

    def __init__(self, handle, finished: bool = True):
        self.handle, self.finished = handle, finished


@dataclass
class _OnDevice:
    """A launched batch: Engine.launch's handle, an event the waiter thread sets once the device is on the
    batch's last pass (or done), that pass's measured seconds, and when it should end (perf_counter, set
    with `last`)."""

    handle: Any
    last: threading.Event
    last_seconds: float
    ends: float = 0.0


class Ticket(Future):
    """A plan's future, and what the request log says of it: the tokens of its trees, and once its pass has
    run (None before, or if it never ran), the seconds it waited in the queue and those of the pass it
    shared. They are set before the result, so they can be read as soon as it is there."""

    def __init__(self, tokens: int):
        super().__init__()
        self.tokens = tokens
        self.submitted = time.perf_counter()
        self.queue_s: float | None = None
        self.pass_s: float | None = None
        self.stop: Callable[[], None] | None = None  # what cancel() does once it runs (a sliced request)

    def cancel(self) -> bool:
        """As a Future's; a large request already running (_Slices) stops before its next slice."""
        if super().cancel():
            return True
        if self.stop is not None:
            self.stop()
        return False


class Runner:
    def __init__(
        self, engine, max_queue: int = 64, max_delay: float = 0.005, on_batch=None, hold_back: bool = True
    ):
        self.engine = engine
        self.hold_back = hold_back  # whether a batch may leave requests to the next (_split)
        self.on_batch = on_batch  # optional callback(seconds from a batch's launch until the device is done)
        self.max_queue = max_queue
        self.max_delay = max_delay
        self._queue: queue.Queue[tuple[Any, Finish, Ticket] | None] = queue.Queue()
        self._pending = 0  # requests queued, not yet gathered into a pass
        self._held: list[tuple[Any, Finish, Ticket]] = []  # gathered, left for the next batch (_split)
        self._next_slices: list[tuple[Any, Finish, Ticket]] = []  # large requests' next slices (_Slices)
        self._slices_put_off = False  # the next slices waited for a launch of what came meanwhile
        self._tokens_left = 0  # tokens of every request accepted and not yet answered
        self._tokens_per_second: float | None = None  # measured over recent passes
        self._device_free = 0.0  # when the device finished the last batch (perf_counter; the waiter's)
        self._closed = False
        self._lock = threading.Lock()
        self._launching = threading.Lock()  # held by the engine thread through a launch, and by quiet()
        # Responses are built here, off the engine thread: it only gathers, cuts and launches batches.
        self._finishers = ThreadPoolExecutor(FINISHERS, thread_name_prefix="spinf-finish")
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="spinf-wait")  # see _finish
        self._thread = threading.Thread(target=self._loop, name="spinf-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return self._pending

    @property
    def full(self) -> bool:
        return self._pending >= self.max_queue

    def retry_after(self) -> int:
        """Whole seconds until what is accepted now has been scored, at the rate measured (1 before any
        measurement): what a client refused for a full queue should wait."""
        with self._lock:
            tokens, rate = self._tokens_left, self._tokens_per_second
        return max(1, math.ceil(tokens / rate)) if rate else 1

    def submit(self, plan, finish: Finish) -> Ticket:
        """Queue a plan; its future gets finish(plan, its trees' results). Cancel the future to drop the plan
        (a client that left): the runner skips it unless its pass has started. A plan of more trees than
        the largest bucket holds is run a slice at a time (_Slices), each behind what arrived meanwhile."""
        with self._lock:
            if self._closed:
                raise ScoringError("shutting_down", "the server is stopping; retry shortly")
            if self._pending >= self.max_queue:
                raise QueueFull
            self._pending += 1
            ticket = Ticket(sum(len(t) for t in plan.trees))
            self._tokens_left += ticket.tokens
        sliced = _Slices.of(plan, finish, ticket, self.engine.buckets.largest)
        self._queue.put(sliced.next() if sliced is not None else (plan, finish, ticket))
        return ticket

    @contextlib.contextmanager
    def quiet(self):
        """No launch starts inside this, and every batch launched before it has been run and read: the device
        is idle. For what must not overlap device work from another thread: starting or stopping the JAX
        profiler while a pass was being launched crashed the server (a segfault, or a pass failing with
        JaxRuntimeError) on an H100, 2026-12-06. Requests queue meanwhile."""
        with self._launching:
            with contextlib.suppress(RuntimeError):  # closed: its waiter has read every batch
                self._waiter.submit(lambda: None).result()  # the waiter reads batches in launch order
            yield

    def close(self) -> None:
        """Stop after the queued work: what was accepted is answered (or fails with shutting_down if the
        engine thread does not finish in time); nothing is left waiting forever."""
        with self._lock:
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=60)
        if not self._thread.is_alive():  # else it may still launch its last batch
            # The waiter reads the batches still on the device and hands them to the finishers; its thread
            # is left behind only where the device does not answer.
            try:
                self._waiter.submit(lambda: None).result(timeout=60)
            except TimeoutError:
                self._waiter.shutdown(wait=False)
            else:
                self._waiter.shutdown(wait=True)
            self._finishers.shutdown(wait=True)
        stopping = ScoringError("shutting_down", "the server is stopping; retry shortly")
        waiting = self._held + self._next_slices
        for plan, _, ticket in waiting if self._thread.is_alive() else []:  # held, never launched
            if not ticket.done():
                _fail(plan, ticket, stopping)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and not isinstance(item, _Done):
                _fail(item[0], item[2], stopping)

    def _gather(self, batch: list, busy: _OnDevice | None = None) -> tuple[list, bool]:
        """The next batch, after `batch` (the first request, or those held from the last batch), and whether
        `busy` is still on the device. With the device idle: what arrives within max_delay. With a batch on
        the device (`busy`): what arrives until LAUNCH_LEAD before the device should end its last pass (the
        batch is launched behind it then), or until it is done, or once the trees fill the largest bucket,
        until it is on its last pass. Held ones alone wait for company. Never more than fills the largest
        bucket."""
        tokens = sum(ticket.tokens for _, _, ticket in batch)
        held = len(batch)
        deadline = time.monotonic() + self.max_delay
        done = busy is None
        while tokens < self.engine.buckets.largest:
            wait = None if busy is not None else max(0.0, deadline - time.monotonic())
            if busy is not None and len(batch) > held and busy.last.is_set():
                # The device is on the last pass: what comes until just before it ends goes behind it.
                wait = busy.ends - LAUNCH_LEAD - time.perf_counter()
                if wait <= 0 and self._queue.empty():
                    break
                wait = max(wait, 0.0)
            try:  # with a batch on the device: until a request or that batch's _Done comes
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                break
            if isinstance(item, _Done):
                if busy is not None and item.handle is busy.handle and item.finished:
                    done = True
                    break
                continue  # an earlier launch's, or the device on busy's last pass (checked above)
            if item is None:
                self._queue.put(None)  # let the loop see the stop after this batch
                break
            batch.append(item)
            tokens += item[2].tokens
        if not done:
            busy.last.wait()  # each pass in flight holds its temporaries: at most IN_FLIGHT (Engine.launch)
        return batch, not done

    def _loop(self) -> None:
        """Gather a batch while the one before runs and launch it behind that one's last pass, or once that
        one is done where nothing came before. This thread only gathers, cuts and launches: the waiter thread
        reads each batch's results once the device is done and hands them to the finishers (_finish)."""
        on_device = None  # the batch launched last, which may still be on the device
        while True:
            if on_device is None and not self._held and not self._next_slices:
                if (first := self._queue.get()) is None:
                    return
                if isinstance(first, _Done):  # an earlier launch's
                    continue
                held, (batch, running) = [], self._gather([first])
            else:
                held = self._held
                batch, running = self._gather(list(held), busy=on_device)
            # Large requests' next slices go behind what arrived while their last ones ran: in a launch of
            # their own where anything did (whose answers then wait for its own passes, not for a slice's
            # too), else now. Put off once, they go with the next launch whatever it holds, so that a
            # stream of small requests cannot starve a large one.
            if self._next_slices and (not batch or self._slices_put_off):
                batch += self._next_slices
                self._next_slices, self._slices_put_off = [], False
            elif self._next_slices:
                self._slices_put_off = True
            fresh = batch[len(held) :]
            # A cancelled future is a client that left while queued: its plan is dropped here.
            live, dropped = list(held), 0
            for item in fresh:
                if self._runs(item):
                    live.append(item)
                elif not isinstance(item[0], _Slice) or item[0].index == 0:
                    dropped += (item[0].slices.ticket if isinstance(item[0], _Slice) else item[2]).tokens
            with self._lock:
                self._pending -= len(fresh)
                self._tokens_left -= dropped
            # Holding requests back only pays while traffic keeps coming: a batch gathered with the device
            # idle goes whole.
            hold = on_device is not None and self.hold_back and not self._closed
            now, self._held, cuts = self._split(live, len(held)) if hold else (live, [], None)
            if now:
                on_device = self._launch(now, cuts, on_device.handle if running else None)
                self._queue_next_slices(now)
            elif not running:  # nothing to launch (every client left); one still on the device stays busy
                on_device = None

    @staticmethod
    def _runs(item) -> bool:
        """Whether a gathered request is still wanted, its future then running: a request's first slice
        starts it (its client may have left), a later one runs while the request has not failed."""
        plan, _, ticket = item
        if not isinstance(plan, _Slice):
            return ticket.set_running_or_notify_cancel()
        ticket.set_running_or_notify_cancel()  # the slice's own, never cancelled
        if plan.index == 0:
            return plan.slices.ticket.set_running_or_notify_cancel()
        return not plan.slices.ticket.done()

    def _queue_next_slices(self, launched: list) -> None:
        """Each launched slice's successor waits for the next batch, which takes it after whatever arrives
        while this one runs: a large request takes turns with the others instead of holding the device for
        all its passes."""
        for plan, _, _ in launched:
            if isinstance(plan, _Slice) and (following := plan.slices.next()) is not None:
                with self._lock:
                    self._pending += 1
                self._next_slices.append(following)

    def _split(self, batch: list, least: int) -> tuple[list, list, Any]:
        """The batch cut in two where its passes cost least per token: its first n requests (never fewer
        than `least`, the ones held last time, so none waits more than one batch longer) are launched, the
        rest lead the next batch, whose new requests fill their passes. With 8 clients sending one article
        each, the batches took turns at 2 and 6 requests, 4,096 + 8,192 rows for 8 requests (77% useful;
        http_throughput-h100-2026-12-05-run12-fine): holding one back turns them into 3 and 5, 4,096 + 6,144
        rows. Of equal costs per token, the longer prefix wins. Also the engine's cut of the whole batch
        (Engine.cut), which launching the first part lays out its passes from; None where nothing was cut."""
        if len(batch) <= max(least, 1):
            return batch, [], None
        try:
            cuts = self.engine.cut([tree for plan, _, _ in batch for tree in plan.trees])
        except Exception:  # noqa: BLE001 - a tree that fits no bucket: launching the batch reports it
            return batch, [], None
        ends = list(accumulate(len(plan.trees) for plan, _, _ in batch))  # trees up to each request
        tokens = list(accumulate(ticket.tokens for _, _, ticket in batch))

        def per_token(n: int) -> tuple[float, int]:
            return cuts.cost[ends[n - 1]] / max(1, tokens[n - 1]), -n

        n = min(range(max(least, 1), len(batch) + 1), key=per_token)
        return batch[:n], batch[n:], cuts

    def _launch(self, batch: list[tuple[Any, Finish, Ticket]], cuts, behind) -> _OnDevice | None:
        with self._launching:
            start = time.perf_counter()
            try:
                trees = [tree for plan, _, _ in batch for tree in plan.trees]
                cuts = cuts or self.engine.cut(trees)
                handle = self.engine.launch(trees, cuts, behind)
            except Exception as exc:  # noqa: BLE001 - every waiting request gets the failure, the thread lives on
                self._answer(batch, exc, start, time.perf_counter())
                return None
            on_device = _OnDevice(handle, threading.Event(), cuts.last_seconds(len(trees)))
            self._waiter.submit(self._finish, batch, on_device, start)
            return on_device

    def _finish(self, batch: list[tuple[Any, Finish, Ticket]], on_device: _OnDevice, start: float) -> None:
        """On the waiter thread, one batch after another: tell the engine thread when the device is on the
        batch's last pass and when it is done, then read the results and hand them to the finishers."""
        handle = on_device.handle
        with contextlib.suppress(Exception):  # a device failure: collect raises it, for the batch's requests
            handle.wait(leaving=1)
            on_device.ends = time.perf_counter() + on_device.last_seconds
            on_device.last.set()
            self._queue.put(_Done(handle, finished=False))
            handle.wait()
        on_device.last.set()  # again, for a failure: the engine thread must not wait on it forever
        self._queue.put(_Done(handle))
        # The device began the batch once it was launched and the batch before was done.
        begin, done = max(start, self._device_free), time.perf_counter()
        self._device_free = done
        if self.on_batch:
            self.on_batch(done - begin)
        try:
            scored = self.engine.collect(handle)
        except Exception as exc:  # noqa: BLE001 - every request of the batch gets the failure
            scored = exc
        self._answer(batch, scored, begin, done)

    def _answer(self, batch: list[tuple[Any, Finish, Ticket]], scored, begin: float, done: float) -> None:
        """Each request's results to a finisher, or the failure (an exception for `scored`) to each. The
        device had the batch from `begin` to `done`."""
        seconds = done - begin
        self._measured(sum(ticket.tokens for _, _, ticket in batch), seconds)
        offset = 0
        for plan, finish, ticket in batch:
            ticket.queue_s, ticket.pass_s = begin - ticket.submitted, seconds
            if isinstance(plan, _Slice):  # the request's log line: its first wait, and all its passes
                plan.slices.timed(begin, seconds)
            if isinstance(scored, Exception):
                _fail(plan, ticket, scored)
                continue
            mine = scored[offset : offset + len(plan.trees)]
            offset += len(plan.trees)
            self._finishers.submit(_settle, ticket, finish, plan, mine)

    def _measured(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._tokens_left -= tokens
            rate = tokens / max(seconds, 1e-6)
            # A moving average over the last few batches: one slow first pass (compilation) or one tiny batch
            # should not set the estimate alone.
            old = self._tokens_per_second
            self._tokens_per_second = rate if old is None else 0.7 * old + 0.3 * rate


class _Slice:
    """Some consecutive trees of a large plan, queued as a plan of their own (it has `trees`)."""

    def __init__(self, slices: "_Slices", index: int, trees: list):
        self.slices, self.index, self.trees = slices, index, trees


class _Slices:
    """A plan whose trees fill more than the largest bucket, cut into slices of at most that many tokens
    (each at least one tree) that take turns with other requests: the runner queues a slice's successor
    only once the slice is launched, so a request that arrives meanwhile goes first. Scores do not depend on
    what shares a pass, so the answer is the same bits as the plan's run whole. The request's ticket gets
    finish(plan, every tree's results) once the last slice is read; a slice that fails fails it, and a
    cancelled ticket (a client that left) stops what is not launched yet."""

    def __init__(self, plan, finish: Finish, ticket: Ticket, cut: list[list]):
        self.plan, self.finish, self.ticket = plan, finish, ticket
        self.cut = cut
        self.results: list[list | None] = [None] * len(cut)
        self.queued = 0
        self.pass_s = 0.0
        self.lock = threading.Lock()
        ticket.stop = lambda: self.failed(
            CancelledError("abandoned: its client left, or its deadline passed")
        )

    @classmethod
    def of(cls, plan, finish: Finish, ticket: Ticket, largest: int) -> "_Slices | None":
        if ticket.tokens <= largest:
            return None
        cut, tokens = [[]], 0
        for tree in plan.trees:
            if cut[-1] and tokens + len(tree) > largest:
                cut.append([])
                tokens = 0
            cut[-1].append(tree)
            tokens += len(tree)
        return cls(plan, finish, ticket, cut) if len(cut) > 1 else None

    def next(self) -> tuple | None:
        """The next slice as a queue item, or None: all are queued, or the request is over."""
        with self.lock:
            if self.queued == len(self.cut) or self.ticket.done():
                return None
            index, self.queued = self.queued, self.queued + 1
        trees = self.cut[index]
        return _Slice(self, index, trees), self._settle_slice, Ticket(sum(map(len, trees)))

    def _settle_slice(self, piece: "_Slice", scored: list):
        """A slice's finish (on a finisher thread): kept until every slice is in, then the request's."""
        with self.lock:
            self.results[piece.index] = scored
            complete = all(r is not None for r in self.results)
        if complete and not self.ticket.done():
            _settle(self.ticket, self.finish, self.plan, [r for part in self.results for r in part])

    def timed(self, begin: float, seconds: float) -> None:
        with self.lock:
            if self.ticket.queue_s is None:
                self.ticket.queue_s = begin - self.ticket.submitted
            self.pass_s += seconds
            self.ticket.pass_s = self.pass_s

    def failed(self, exc: Exception) -> None:
        with self.lock:
            self.queued = len(self.cut)  # no more slices
        if not self.ticket.done():
            self.ticket.set_exception(exc)


def _fail(plan, ticket: Ticket, exc: Exception) -> None:
    """A queued or launched item's failure, to its request: a slice's goes to the request it is part of."""
    if isinstance(plan, _Slice):
        plan.slices.failed(exc)
    if not ticket.done():
        ticket.set_exception(exc)


def _settle(ticket: Ticket, finish: Finish, plan, scored: list) -> None:
    try:
        ticket.set_result(finish(plan, scored))
    except Exception as exc:  # noqa: BLE001 - the request answers with it
        ticket.set_exception(exc)

"""One thread owns the device. It gathers the trees of concurrent requests into shared passes: a request
waits for company at most `max_delay` seconds, or until the pending trees fill the largest bucket. Scores do
not depend on what shares a pass (see packer), so batching never changes an answer."""

import queue
import threading
import time
from concurrent.futures import Future

from spinf_jax.scoring import Plan, Scorer


class QueueFull(Exception):
    pass


class Runner:
    def __init__(self, scorer: Scorer, max_queue: int = 64, max_delay: float = 0.005):
        self.scorer = scorer
        self.engine = scorer.engine
        self.max_queue = max_queue
        self.max_delay = max_delay
        self._queue: queue.Queue[tuple[Plan, Future] | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="spinf-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        return self._pending

    def submit(self, plan: Plan) -> Future:
        with self._lock:
            if self._pending >= self.max_queue:
                raise QueueFull
            self._pending += 1
        future: Future = Future()
        self._queue.put((plan, future))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _gather(self, first: tuple[Plan, Future]) -> list[tuple[Plan, Future]]:
        batch, tokens = [first], sum(len(t) for t in first[0].trees)
        deadline = time.monotonic() + self.max_delay
        while tokens < self.engine.buckets.largest:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)  # let the loop see the stop after this batch
                break
            batch.append(item)
            tokens += sum(len(t) for t in item[0].trees)
        return batch

    def _loop(self) -> None:
        while (first := self._queue.get()) is not None:
            batch = self._gather(first)
            with self._lock:
                self._pending -= len(batch)
            trees = [tree for plan, _ in batch for tree in plan.trees]
            try:
                scored = self.engine.score_trees(trees)
            except Exception as exc:  # noqa: BLE001 - every waiting request gets the failure, the thread lives on
                for _, future in batch:
                    future.set_exception(exc)
                continue
            start = 0
            for plan, future in batch:
                mine = scored[start : start + len(plan.trees)]
                start += len(plan.trees)
                try:
                    future.set_result(self.scorer.finish(plan, mine))
                except Exception as exc:  # noqa: BLE001
                    future.set_exception(exc)

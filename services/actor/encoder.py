"""Encodes the sessions' fragments off the event loop: one thread, in the order they were cut.

No gRPC and no asyncio here. The event loop cuts a session's fragment (sessions.py) and submits its
arrays, which it never writes again (the session goes on in fresh ones); this thread serializes
them with `encode_fragment` (one copy, made with the GIL released: bytes.join would hold it through
a 15 MB copy and stall the loop just the same) and hands each
payload on, in submission order, so fragments reach the pusher in seq order (the buffer dedupes by
(actor, seq)). The actor's handoff is `loop.call_soon_threadsafe(pusher.enqueue, ...)`, as for the
rollout thread's fragments. `close` (the shutdown flush) returns once everything submitted has been
handed on. At most `max_pending` fragments wait: past that, `submit` blocks its caller until one is
done, so an encoder that cannot keep up slows the sessions (as encoding on the loop did) instead of
holding their arrays without bound.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from services.common.protocol.fragments import EncodedFragment, encode_fragment
from services.common.stats import Metrics

log = logging.getLogger(__name__)

Job = tuple[dict[str, Any], Callable[[EncodedFragment], None]]
# The one copy of the payload made with the GIL released (bytes.join holds it: fragments.join_releasing_gil).
ENCODE = functools.partial(encode_fragment, release_gil=True)


class FragmentEncoder:
    """A single in-order worker: `submit(fields, then)` runs `then(encode(**fields))` on its thread.

    The thread starts with the first submit and ends at `close`, after the jobs submitted before it;
    a submit after `close` starts a new one. A job that raises is logged, counted as dropped (in
    `metrics`) and skipped (a bug: its fragment is lost, the ones after it still go)."""

    def __init__(self, encode: Callable[..., EncodedFragment] = ENCODE, name: str = "fragment-encoder",
                 max_pending: int = 16, metrics: Metrics | None = None):
        self._encode, self._name, self.max_pending = encode, name, max_pending
        self.metrics = metrics   # a fragment that fails to encode is counted there as dropped
        self._cond = threading.Condition()
        self._submitted = self._finished = 0
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()   # the running thread's
        self._thread: threading.Thread | None = None
        self._closed: threading.Thread | None = None   # the last thread closed (may still be finishing)

    def submit(self, fields: dict[str, Any], then: Callable[[EncodedFragment], None]) -> None:
        """Encode `fields` (encode_fragment's keyword arguments) after everything submitted before, then
        call `then` with the result, on this encoder's thread. The arrays in `fields` are read there:
        the caller must not write them any more. Blocks while `max_pending` are pending."""
        with self._cond:
            self._cond.wait_for(lambda: self._submitted - self._finished < self.max_pending)
            self._submitted += 1
            if self._thread is None:  # a queue of its own, taken up once the closed thread has finished
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._run, args=(self._jobs, self._closed),
                                                name=self._name, daemon=True)
                self._thread.start()
            self._jobs.put((fields, then))

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet done (`then` not yet returned)."""
        with self._cond:
            return self._submitted - self._finished

    def join(self, timeout: float | None = None) -> bool:
        """Block until every job submitted so far is done; False if `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._finished >= self._submitted, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Finish the jobs submitted so far, then end the thread; False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._jobs.put(None)  # after every job submitted before: the queue is FIFO
                self._closed = thread
            closed = self._closed
        if closed is not None:
            closed.join(timeout)
            if closed.is_alive():
                return False
        return self.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _run(self, jobs: queue.SimpleQueue[Job | None], previous: threading.Thread | None) -> None:
        if previous is not None:
            previous.join()  # its jobs were submitted first
        while (job := jobs.get()) is not None:
            fields, then = job
            try:
                then(self._encode(**fields))
            except Exception as err:  # noqa: BLE001 - a bug; the fragments after it still go
                log.exception("encoding fragment seq %s failed (counted as dropped): %s", fields.get("seq"), err)
                if self.metrics is not None:
                    rewards = fields.get("rewards")
                    self.metrics.inc("actor/fragments_dropped_total")
                    self.metrics.inc("actor/samples_dropped_total", int(rewards.size) if rewards is not None else 0)
            finally:
                with self._cond:
                    self._finished += 1
                    self._cond.notify_all()

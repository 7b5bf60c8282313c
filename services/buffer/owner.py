"""Where the buffer's Store does its work: on the event loop, or on one thread that owns the store.

A replay buffer's inserts (validation, dedupe, ring writes, compact-replay frame compares) and batch
cuts (sampling, gathering, encoding) take milliseconds each for Atari-sized data. On the event loop,
every push stream's next read, every batch stream's write and every insert-limit message waits behind
them. With `buffer.store_thread`, one thread owns the Store: the loop hands it each call
(`await owner(fn, ...)`) and goes on reading and writing the network meanwhile. Calls run one at a
time, in the order handed, so the Store stays single-threaded and needs no locks. The checkpoint's
instant of copy (services/buffer/checkpoint.py) runs on that thread too, between two calls.

What it buys, measured on a 16-core machine with Atari-sized DQN fragments (docs/benchmarks.md,
"Buffer event loop"): not more ingest, and not more work in all. The owner's Python work and the
loop's share the GIL, so the process stays within 1.2-1.8 cores whichever thread works; the thread
changes who waits. With pushes and batches at once, pushes got about 60% more through and batches
about 20% less when calls ran in the order handed; with batch cuts, progress reports and insert
limits put ahead of queued inserts (`urgent`, as now), batches got about 27% more through and pushes
about 35% less. Pushes alone: within 10% either way at 1, 4 and 8 pushers, 17-27% fewer with the
thread at 2. It is therefore off by default: turn it on where a replay's learners must not wait
behind a flood of inserts. A FIFO's work is a few references per call and costs more to hand over
than to do (18-26% fewer fragments a second at 4 and 8 pushers), so a FIFO store stays on the loop.
More ingest comes from more shards (`topology.buffers`), each a process with its own GIL.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import Future
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def use_thread(on: bool, replay: bool) -> tuple[bool, str]:
    """(whether the Store gets an owner thread, why) for `buffer.store_thread` = `on`."""
    if not on:
        return False, "buffer.store_thread is off"
    if not replay:
        return False, "buffer.store_thread is on, but a FIFO's work is too small to hand to a thread"
    return True, "buffer.store_thread is on"


class StoreOwner:
    """Runs calls on the Store: inline (`threaded` false) or on its one owner thread. There, `urgent`
    calls (a batch cut, a progress report, an insert limit: what a learner or an actor waits on) run
    before the inserts already queued, each kind in the order handed."""

    def __init__(self, threaded: bool):
        self.threaded = threaded
        self._queues: tuple[deque, deque] = (deque(), deque())   # (urgent, the rest)
        self._ready = threading.Condition()
        self._closed = False
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._work, name="buffer-store", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            with self._ready:
                while not (self._queues[0] or self._queues[1] or self._closed):
                    self._ready.wait()
                if not (self._queues[0] or self._queues[1]):
                    return   # closed, and everything handed has run
                cf, fn, args = (self._queues[0] or self._queues[1]).popleft()
            if not cf.set_running_or_notify_cancel():
                continue   # its caller was cancelled before it started: it never runs
            try:
                cf.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed back to the caller, as an executor does
                cf.set_exception(err)

    def _submit(self, fn: Callable[..., T], args: tuple, urgent: bool) -> Future:
        cf: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the store's owner is closed")
            self._queues[0 if urgent else 1].append((cf, fn, args))
            self._ready.notify()
        return cf

    async def __call__(self, fn: Callable[..., T], *args, urgent: bool = False,
                       orphan: Callable[[T], None] | None = None) -> T:
        """fn(*args), on the owner thread when there is one. If the awaiting task is cancelled, a call
        not started yet never runs; one already running finishes, and `orphan` (on the owner thread)
        gets its result, so that what it did is accounted for (a batch cut for a stream that went away)."""
        if self._thread is None:
            return fn(*args)
        cf = self._submit(fn, args, urgent)
        try:
            return await asyncio.wrap_future(cf)   # (cancelling it cancels `cf` if it has not started)
        except asyncio.CancelledError:
            if orphan is not None and not cf.cancelled():
                cf.add_done_callback(lambda f: f.exception() is None and self.post(orphan, f.result()))
            raise

    def post(self, fn: Callable[..., object], *args) -> None:
        """Run fn(*args) after the calls handed so far, without waiting for it."""
        if self._thread is None:
            fn(*args)
            return
        try:
            self._submit(fn, args, urgent=False)
        except RuntimeError:   # closed: nothing runs on the store any more
            fn(*args)

    def close(self) -> None:
        """Let the calls handed so far finish, then end the thread (idempotent)."""
        if self._thread is None:
            return
        with self._ready:
            self._closed = True
            self._ready.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

"""The buffer's StoreOwner (services/buffer/owner.py): calls on the owner thread run one at a time in
the order handed, urgent ones first; a cancelled caller's call either never runs or has its result
accounted for; and which stores `buffer.store_thread` gives a thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.buffer.owner import StoreOwner, use_thread


async def test_calls_run_on_one_thread_in_the_order_handed():
    owner = StoreOwner(threaded=True)
    seen: list[tuple[int, str]] = []

    def record(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * i

    try:
        results = await asyncio.gather(*(owner(record, i) for i in range(50)))
    finally:
        owner.close()
    assert results == [i * i for i in range(50)]
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {seen[0][1]} and seen[0][1].startswith("buffer-store")


async def test_inline_runs_on_the_loop_thread():
    owner = StoreOwner(threaded=False)
    assert await owner(threading.current_thread) is threading.current_thread()
    owner.close()


async def test_a_cancelled_caller_s_call_runs_to_its_orphan_handler_or_not_at_all():
    owner = StoreOwner(threaded=True)
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []
    orphaned: list[str] = []

    def slow() -> str:
        started.set()
        release.wait(10)
        ran.append("slow")
        return "cut"

    def queued() -> str:
        ran.append("queued")
        return "never"

    running = asyncio.ensure_future(owner(slow, orphan=orphaned.append))
    waiting = asyncio.ensure_future(owner(queued, orphan=orphaned.append))
    await asyncio.to_thread(started.wait, 10)
    running.cancel()
    waiting.cancel()
    for task in (running, waiting):
        with pytest.raises(asyncio.CancelledError):
            await task
    release.set()
    await owner(lambda: None)   # after everything handed before it, the orphan handler included
    owner.close()
    assert ran == ["slow"]            # the call not started never ran
    assert orphaned == ["cut"]        # the one running finished, and its result was handed on


def test_only_a_replay_store_gets_a_thread_and_only_when_asked():
    assert use_thread(True, replay=True)[0]
    assert not use_thread(False, replay=True)[0]
    threaded, why = use_thread(True, replay=False)       # a FIFO stays on the loop: measured slower
    assert not threaded and "FIFO" in why


async def test_urgent_calls_pass_the_inserts_already_queued():
    owner = StoreOwner(threaded=True)
    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    def first() -> None:
        started.set()
        release.wait(10)
        order.append("first")

    try:
        head = asyncio.ensure_future(owner(first))
        await asyncio.to_thread(started.wait, 10)
        inserts = [asyncio.ensure_future(owner(order.append, f"insert {i}")) for i in range(3)]
        cut = asyncio.ensure_future(owner(order.append, "cut", urgent=True))
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(head, cut, *inserts)
    finally:
        owner.close()
    assert order == ["first", "cut", "insert 0", "insert 1", "insert 2"]

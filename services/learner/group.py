"""The learner's group handling: forming a group of learners at its rendezvous (stoppable, and given
up when the membership's size changes meanwhile), and joining it as the membership now says
(services/learner/membership.py, distributed.py). Training generation after generation as an elastic
membership re-forms it is services/learner/loops.py's `learn`."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

from services.common.stats import Metrics
from services.learner.distributed import FormationAbandoned, GradientSync, GroupBroken, Rendezvous
from services.learner.membership import FixedGroup, StatefulSetGroup
from services.learner.trainer import Trainer

log = logging.getLogger(__name__)


class StoppedBeforeGroupFormed(Exception):
    """Asked to stop while waiting for the rest of its group: nothing was trained, nothing to save."""


async def form_group(rendezvous: Rendezvous, world_size: int, stop: asyncio.Event | None,
                     changed: Awaitable[int] | None = None) -> GradientSync:
    """Form a group of `world_size` at `rendezvous` (blocking in a thread until every rank has come)
    unless `stop` is set first (StoppedBeforeGroupFormed) or `changed` (the membership's next size)
    completes first (FormationAbandoned); either way the thread gives up at its next read of the store."""
    # A daemon thread of its own, not the default executor: the event loop's shutdown joins the
    # executor's threads, and this one may stay blocked in gloo's connections for up to
    # gloo_connect_s (services/learner/distributed.py).
    loop = asyncio.get_running_loop()
    forming, abandon = loop.create_future(), threading.Event()

    def settle(set_outcome, value) -> None:
        if not forming.done():
            set_outcome(value)

    def join() -> None:
        try:
            outcome = (forming.set_result, rendezvous.form(world_size, abandon))
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (forming.set_exception, err)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop has closed: the process is ending
            pass

    threading.Thread(target=join, name="join-learner-group", daemon=True).start()
    watch = asyncio.ensure_future(changed) if changed is not None else None

    async def formed() -> GradientSync:
        if watch is not None:
            await asyncio.wait({forming, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not forming.done():   # a new size: give this formation up; its thread answers shortly
                log.info("the group's size is now %d while a group of %d forms: giving it up", watch.result(),
                         world_size)
                abandon.set()
        return await forming

    try:
        # Stopped first: the joining thread gives up, or stays blocked in gloo until its timeout; the
        # process ends without waiting for it (services exit through runtime.exit_process).
        return await _unless_stopped(formed(), stop, f"stopped while waiting for the group of {world_size} "
                                                     f"learners to form")
    finally:
        abandon.set()   # (a formed group is unaffected; a forming one stops at its next read of the store)
        if watch is not None:
            watch.cancel()


async def _unless_stopped(aw, stop: asyncio.Event | None, what: str):
    """`await aw`, or raise StoppedBeforeGroupFormed(what) if `stop` is set first."""
    task = asyncio.ensure_future(aw)
    if stop is None:
        return await task
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():   # stopped, or this coroutine cancelled: nothing may poll on behind it
            task.cancel()
    if not task.done() or task.cancelled():
        raise StoppedBeforeGroupFormed(what)
    return task.result()


async def join(membership: FixedGroup | StatefulSetGroup, build: Callable[[GradientSync | None], Trainer],
               metrics: Metrics, stop: asyncio.Event | None, set_ready=None) -> Trainer:
    """Form this learner's group as its membership now says, and build the group's Trainer from rank 0's
    newest checkpoint. While this learner's rank lies outside the group (a scale-down is removing it) it
    waits, not ready (`set_ready(False)`). A group that fails to form is formed again if the membership
    is elastic; a fixed one raises GroupBroken."""
    while True:
        n = await _unless_stopped(membership.world_size(), stop, "stopped while reading the group's size")
        if membership.rank >= n:
            log.info("rank %d lies outside the group of %d learners (being scaled down): waiting", membership.rank, n)
            metrics.set("learner/group_size", n)
            if set_ready is not None:
                await set_ready(False)
            await _unless_stopped(membership.wait_for_change(n), stop,
                                  f"stopped while rank {membership.rank} was outside the group of {n} learners")
            continue
        sync = None
        try:
            if n > 1:
                changed = membership.wait_for_change(n) if membership.elastic else None
                sync = await form_group(membership.rendezvous, n, stop, changed)
            return await asyncio.to_thread(build, sync)
        except FormationAbandoned:
            continue   # the size changed while this group formed: form one of the new size
        except GroupBroken as err:
            if sync is not None:
                sync.close()
            if not membership.elastic:
                raise
            metrics.inc("learner/group_formation_failures_total")
            log.warning("%s; forming the group again", err)
            await _unless_stopped(asyncio.sleep(1.0), stop, "stopped while forming the group again")
        except BaseException:
            if sync is not None:
                sync.close()
            raise

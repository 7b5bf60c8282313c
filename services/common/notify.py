"""A broadcast wake-up for asyncio tasks: every waiter present at `notify()` wakes once."""

from __future__ import annotations

import asyncio


class Notifier:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    def waiter(self) -> asyncio.Event:
        """The event the next notify() sets: take it before checking state, then await its wait(), and
        a notify() that lands in between is not missed."""
        return self._event

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait for the next notify(); False on timeout.

        asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that arrives
        as the event fires, and a notifier fires often, so a task cancelled at shutdown could live on.
        """
        try:
            async with asyncio.timeout(timeout):
                await self._event.wait()
            return True
        except TimeoutError:
            return False

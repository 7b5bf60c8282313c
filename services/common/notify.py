"""A broadcast wake-up for asyncio tasks: every waiter present at `notify()` wakes once."""

from __future__ import annotations

import asyncio


class Notifier:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait for the next notify(); False on timeout."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
            return True
        except TimeoutError:
            return False

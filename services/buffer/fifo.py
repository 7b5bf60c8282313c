"""FIFO of fresh rollout fragments for on-policy learners (PPO): each fragment is served once.

Bounded in steps; when full, the oldest fragments are evicted and returned so the caller counts
them (on-policy data only gets staler by waiting, so the oldest is the right one to lose).
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

Item = TypeVar("Item")


class RolloutFifo(Generic[Item]):
    def __init__(self, capacity_steps: int):
        self.capacity_steps = capacity_steps
        self.steps = 0
        self._items: deque[tuple[Item, int]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Item, steps: int) -> list[Item]:
        """Append an item holding `steps` steps; return the items evicted to stay within capacity."""
        self._items.append((item, steps))
        self.steps += steps
        return self._evict()

    def put_back(self, items: list[tuple[Item, int]]) -> list[Item]:
        """Return items taken by `take` (oldest first, with their steps) to the front, where they came
        from; return the items evicted to stay within capacity (the oldest: these, if the FIFO filled
        meanwhile)."""
        self._items.extendleft(reversed(items))
        self.steps += sum(n for _, n in items)
        return self._evict()

    def _evict(self) -> list[Item]:
        evicted = []
        while self.steps > self.capacity_steps and len(self._items) > 1:
            old, n = self._items.popleft()
            self.steps -= n
            evicted.append(old)
        return evicted

    def remove_if(self, predicate) -> list[Item]:
        """Remove (and return, oldest first) every item for which `predicate(item)` is true."""
        kept, removed = deque(), []
        for item, n in self._items:
            if predicate(item):
                removed.append(item)
                self.steps -= n
            else:
                kept.append((item, n))
        self._items = kept
        return removed

    def take(self, min_steps: int) -> list[Item] | None:
        """Pop the oldest items until they hold >= min_steps steps; None (and pop nothing) if too few."""
        if self.steps < min_steps or not self._items:
            return None
        out, got = [], 0
        while got < min_steps:
            item, n = self._items.popleft()
            self.steps -= n
            out.append(item)
            got += n
        return out

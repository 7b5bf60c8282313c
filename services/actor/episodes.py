"""The actor's finished episodes: counters, the last-100 return summary, and the GetStats feed.

Local rollouts and external sessions both record into one EpisodeLog. The feed keeps the newest
EPISODES_KEPT episodes as rows of a numpy ring (about 44 bytes each, not protobuf objects), each with
a per-actor index (1, 2, ...) that GetStats callers use as a cursor. GetStats pages through them
(`page`): a reader that polls slowly reads every episode over several pages, and one that fell
further behind than EPISODES_KEPT is told exactly how many it missed (`Page.skipped`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from kuberl.v1 import common_pb2 as pb
from services.common.stats import Metrics

EPISODES_KEPT = 65536       # unread episodes retained per actor (about 2.9 MB)
DEFAULT_PAGE = 4096         # GetStatsRequest.max_episodes = 0
MAX_PAGE = 16384            # larger max_episodes are capped to this (about 0.8 MB of response)

_ROW = np.dtype([("episode_return", np.float64), ("length", np.uint32), ("actor_env_steps", np.uint64),
                 ("policy_version", np.uint64), ("end_unix_s", np.float64), ("policy", np.uint16)])


@dataclass
class Page:
    """One GetStats page of the feed: `episodes` (oldest first), and where it stands."""
    episodes: list[pb.Episode] = field(default_factory=list)
    remaining: int = 0   # retained episodes after the last one returned (the next page)
    skipped: int = 0     # episodes after the cursor that are no longer retained (before the first returned)
    oldest: int = 0      # index of the oldest retained episode; 0 = none retained


class EpisodeLog:
    def __init__(self, metrics: Metrics, kept: int = EPISODES_KEPT):
        self.metrics = metrics
        self.kept = kept
        self.count = 0      # episodes finished; also the index of the newest one
        self._rows = np.zeros(kept, dtype=_ROW)
        self._lock = threading.Lock()
        self._policies: dict[str, int] = {"": 0}   # the policies named, by their number in the rows

    def finish(self, episode_return: float, length: int, actor_env_steps: int, policy_version: int | None,
               now: float | None = None, policy: str = "") -> None:
        """Record one finished episode (any thread); `policy`: the one that played it, of several."""
        with self._lock:
            row = (float(episode_return), int(length), int(actor_env_steps), int(policy_version or 0),
                   time.time() if now is None else float(now), self._policies.setdefault(policy, len(self._policies)))
            self._rows[self.count % self.kept] = row
            self.count += 1
        self.metrics.inc("actor/episodes_total")
        self.metrics.rolling("actor/episode_return", 100).add(episode_return)
        if policy:
            self.metrics.rolling(f"actor/policies/{policy}/episode_return", 100).add(episode_return)

    def page(self, cursor: int, limit: int = DEFAULT_PAGE) -> Page:
        """Up to `limit` retained episodes with index > cursor, oldest first (limit 0 = DEFAULT_PAGE,
        capped at MAX_PAGE)."""
        limit = min(limit or DEFAULT_PAGE, MAX_PAGE)
        with self._lock:
            count = self.count
            oldest = max(1, count - self.kept + 1)
            first = max(cursor + 1, oldest)
            last = min(count, first + limit - 1)
            idx = list(range(first, last + 1))
            rows = self._rows[(np.asarray(idx, dtype=np.int64) - 1) % self.kept].tolist() if idx else []
            names = list(self._policies)
        episodes = [pb.Episode(index=i, episode_return=ret, length=length, actor_env_steps=steps,
                               policy_version=version, end_unix_s=end, policy=names[number])
                    for i, (ret, length, steps, version, end, number) in zip(idx, rows)]
        return Page(episodes=episodes, remaining=max(0, count - max(last, cursor)),
                    skipped=max(0, oldest - 1 - cursor) if count else 0, oldest=oldest if count else 0)

    def after(self, cursor: int) -> list[pb.Episode]:
        """Episodes with index > cursor, oldest first (one page of at most DEFAULT_PAGE)."""
        return self.page(cursor).episodes

    @property
    def episodes(self) -> list[pb.Episode]:
        """Every retained episode, oldest first (for tests and debugging: GetStats pages instead)."""
        out, cursor = [], 0
        while page := self.page(cursor, MAX_PAGE).episodes:
            out.extend(page)
            cursor = page[-1].index
        return out

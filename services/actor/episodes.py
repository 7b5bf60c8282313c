"""The actor's finished episodes: counters, the last-100 return summary, and the GetStats feed.

Local rollouts and external sessions both record into one EpisodeLog. The feed keeps the newest
EPISODES_KEPT episodes, each with a per-actor index that GetStats callers use as a cursor.
"""

from __future__ import annotations

import time
from collections import deque

from kuberl.v1 import common_pb2 as pb
from services.common.stats import Metrics

EPISODES_KEPT = 4096


class EpisodeLog:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.count = 0
        self.episodes: deque[pb.Episode] = deque(maxlen=EPISODES_KEPT)

    def finish(self, episode_return: float, length: int, actor_env_steps: int, policy_version: int | None) -> None:
        """Record one finished episode (any thread; appends are atomic)."""
        self.count += 1
        self.episodes.append(pb.Episode(
            index=self.count, episode_return=float(episode_return), length=int(length),
            actor_env_steps=actor_env_steps, policy_version=int(policy_version or 0), end_unix_s=time.time()))
        self.metrics.inc("actor/episodes_total")
        self.metrics.rolling("actor/episode_return", 100).add(episode_return)

    def after(self, cursor: int) -> list[pb.Episode]:
        """Episodes with index > cursor, oldest first."""
        return [e for e in list(self.episodes) if e.index > cursor]

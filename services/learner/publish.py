"""The newest published weights, shared by every SubscribeWeights stream.

Each version is encoded once into chunk messages; a subscriber that was busy writing gets, when it
is ready, only whatever is newest then. No per-subscriber queue exists, so no backlog can form.
"""

from __future__ import annotations

from kuberl.v1 import common_pb2 as pb
from services.common.notify import Notifier


class WeightsHub:
    def __init__(self) -> None:
        self.version: int | None = None
        self.chunks: list[pb.Weights] = []
        self.closed = False
        self._changed = Notifier()

    def publish(self, chunks: list[pb.Weights]) -> None:
        self.version, self.chunks = chunks[0].version, chunks
        self._changed.notify()

    def close(self) -> None:
        self.closed = True
        self._changed.notify()

    async def differing_from(self, held: int | None) -> list[pb.Weights] | None:
        """Wait until the newest version differs from `held` (None = holds nothing) and return its
        chunks; None once the hub is closed. "Differs", not "newer": a learner restored from an
        older checkpoint must still reach subscribers that hold a later, lost version."""
        while not self.closed:
            if self.chunks and self.version != held:
                return self.chunks
            await self._changed.wait()
        return None

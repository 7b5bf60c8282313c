"""The buffer's core: validate and dedupe fragments, store them, cut batches, account for all of it.

Free of gRPC and asyncio. `insert` raises TensorError (naming the field) for a fragment it refuses
and stores nothing of it; `next_batch` returns None when it cannot cut a batch yet and records why
(`warming up`, `paced`, `empty`). Every sample accepted is either stored, served, or counted as
evicted: none disappears silently.
"""

from __future__ import annotations

import enum
from collections import OrderedDict

from kuberl.v1 import common_pb2 as pb
from services.buffer.fifo import RolloutFifo
from services.buffer.replay import ReplayRing
from services.common.config import ExperimentConfig
from services.common.fragments import ALGORITHM_CODES, decode_fragment
from services.common.stats import Metrics
from services.common.tensors import encode

SEQ_WINDOW = 4096
MAX_ACTORS_TRACKED = 65536


class Outcome(enum.Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"


class SeqWindow:
    """The seqs seen from one actor: exact within the last SEQ_WINDOW, everything older counts as seen."""

    def __init__(self) -> None:
        self.high = -1
        self._recent: set[int] = set()

    def seen(self, seq: int) -> bool:
        return seq in self._recent or seq <= self.high - SEQ_WINDOW

    def add(self, seq: int) -> None:
        self._recent.add(seq)
        self.high = max(self.high, seq)
        if len(self._recent) > 2 * SEQ_WINDOW:
            self._recent = {s for s in self._recent if s > self.high - SEQ_WINDOW}


class Store:
    def __init__(self, cfg: ExperimentConfig, metrics: Metrics):
        self.cfg, self.metrics = cfg, metrics
        self.algorithm = ALGORITHM_CODES[cfg.algorithm]
        self.max_elements = cfg.buffer.max_message_mb * (1 << 20)
        self.replay = ReplayRing(cfg.dqn.buffer_size, seed=cfg.seed) if cfg.algorithm == "dqn" else None
        self.fifo: RolloutFifo[pb.TrajectoryFragment] | None = (
            RolloutFifo(cfg.buffer.fifo_capacity_steps) if cfg.algorithm == "ppo" else None)
        self._actors: OrderedDict[str, SeqWindow] = OrderedDict()
        self.inserted_samples = 0
        self.served_samples = 0
        self.wait_reason = "empty"
        metrics.track_rate("buffer/samples_received_per_s", "buffer/samples_received_total")
        metrics.track_rate("buffer/samples_served_per_s", "buffer/samples_served_total")
        metrics.track_rate("buffer/fragments_received_per_s", "buffer/fragments_received_total")
        for name in ("duplicate", "invalid", "evicted"):
            metrics.inc(f"buffer/fragments_{name}_total", 0)
        metrics.inc("buffer/samples_lost_in_transit_total", 0)

    def high_water(self, actor_id: str) -> int | None:
        window = self._actors.get(actor_id)
        return None if window is None or window.high < 0 else window.high

    def insert(self, msg: pb.TrajectoryFragment) -> Outcome:
        """Validate, dedupe and store one fragment. Raises TensorError (nothing stored) if refused."""
        frag = decode_fragment(msg, algorithm=self.algorithm, max_elements=self.max_elements)
        window = self._actors.get(frag.actor_id)
        if window is not None and window.seen(frag.seq):
            self.metrics.inc("buffer/fragments_duplicate_total")
            return Outcome.DUPLICATE
        if self.replay is not None:
            self.replay.add(frag)  # checks shapes against what is stored before writing anything
        else:
            for old in self.fifo.put(msg, frag.num_samples):
                self.metrics.inc("buffer/fragments_evicted_total")
                self.metrics.inc("buffer/samples_evicted_total", old.num_steps * len(old.env_ids))
        if window is None:
            window = self._actors[frag.actor_id] = SeqWindow()
            if len(self._actors) > MAX_ACTORS_TRACKED:
                self._actors.popitem(last=False)
        self._actors.move_to_end(frag.actor_id)
        window.add(frag.seq)
        self.inserted_samples += frag.num_samples
        self.metrics.inc("buffer/fragments_received_total")
        self.metrics.inc("buffer/samples_received_total", frag.num_samples)
        self.metrics.set("buffer/policy_version_newest", max(frag.policy_version,
                                                              self.metrics.gauges.get("buffer/policy_version_newest", 0)))
        return Outcome.ACCEPTED

    @property
    def size(self) -> int:
        """Samples held: replay occupancy, or steps waiting in the FIFO."""
        return self.replay.size if self.replay is not None else self.fifo.steps

    def next_batch(self, batch_size: int) -> pb.TrainingBatch | None:
        """Cut one batch, or return None and set `wait_reason` when none can be cut yet."""
        batch = pb.TrainingBatch(buffer_inserted_total=self.inserted_samples)
        if self.replay is not None:
            d = self.cfg.dqn
            if self.replay.size < max(d.learning_starts, batch_size):
                self.wait_reason = "warming up"
                return None
            if d.max_replay_ratio and self.served_samples + batch_size > d.max_replay_ratio * self.inserted_samples:
                self.wait_reason = "paced"
                return None
            rows = self.replay.sample(batch_size)
            for name, arr in rows.items():
                encode(arr, getattr(batch.transitions, name))
        else:
            frags = self.fifo.take(batch_size)
            if frags is None:
                self.wait_reason = "empty"
                return None
            batch.rollouts.fragments.extend(frags)
        served = self.batch_samples(batch)
        self.served_samples += served
        batch.buffer_size = self.size
        self.metrics.inc("buffer/samples_served_total", served)
        self.metrics.inc("buffer/batches_served_total")
        return batch

    @staticmethod
    def batch_samples(batch: pb.TrainingBatch) -> int:
        if batch.HasField("transitions"):
            return batch.transitions.rewards.shape[0]
        return sum(f.num_steps * len(f.env_ids) for f in batch.rollouts.fragments)

    def gauges(self) -> dict[str, float]:
        ratio = self.served_samples / self.inserted_samples if self.inserted_samples else 0.0
        return {"buffer/size_samples": self.size, "buffer/samples_per_insert": ratio,
                "buffer/actors_known": len(self._actors)}

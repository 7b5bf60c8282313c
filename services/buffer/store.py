"""The buffer's core: validate and dedupe fragments, store them, cut batches, account for all of it.

Free of gRPC and asyncio. `insert` raises TensorError (naming the field) for a fragment it refuses
and stores nothing of it; `next_batch` returns None when it cannot cut a batch yet and records why
(`warming up`, `paced`, `empty`). Every sample accepted is either stored, served, or counted as
evicted or dropped (with its reason): none disappears silently.

Staleness (docs/architecture.md section 4) is measured against the newest policy version the
learners report:
- PPO: fragments more than `ppo.max_policy_lag` versions behind are dropped before serving
  (`buffer/fragments_dropped_stale_total`), unless `ppo.stale_fragments` is "correct".
- DQN, SAC: the paper's P = B_s / N_s (batch size over replay size) and the replay ratio (samples
  served per sample inserted after the warm-up) are reported.

Balance (services/buffer/limiter.py, docs/rate-limiter.md): batches are held back ("paced") while
serving one more would take the replay ratio above its target, and `insert_limit` tells actors
(Buffer.WatchInsertLimit) how far they may insert before they hold. Inserts that arrive are never
blocked or refused for it.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import OrderedDict

import numpy as np

from kuberl.v1 import common_pb2 as pb
from services.buffer.fifo import RolloutFifo
from services.buffer.compact import CompactReplay
from services.buffer.limiter import RateLimiter
from services.buffer.replay import Replay, ReplayRing
from services.config import ExperimentConfig
from services import algorithms
from services.algorithms import FifoTable, ReplayTable
from services.common.protocol.fragments import DEDUPE_WINDOW, RawFragment, batch_samples, decode_fragment
from services.common.stats import Metrics
from services.common.protocol.tensors import TensorError, encode

SEQ_WINDOW = DEDUPE_WINDOW
LEARNER_EXPIRY_S = 30.0
LEARNER_FORGET_S = 10 * LEARNER_EXPIRY_S   # a learner silent this long is forgotten altogether
MAX_UNREPORTED = 1024                      # learner ids served batches but never reporting, kept at most
MAX_ACTORS_TRACKED = 65536
# A restarted process of one actor id gets a new incarnation; its predecessor's window is kept for
# this many newer incarnations (a zombie or a slow re-send of the old process still dedupes) and
# then forgotten, counted in buffer/dedupe_windows_forgotten_total.
MAX_INCARNATIONS_PER_ACTOR = 4


class Outcome(enum.Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"    # this (actor_id, incarnation, seq) is stored already
    TOO_OLD = "too_old"        # seq more than SEQ_WINDOW behind the incarnation's newest: cannot tell, refused


class SeqWindow:
    """The seqs stored from one incarnation of an actor: exact within the last SEQ_WINDOW seqs.

    A ring of SEQ_WINDOW bits (8 KiB), like IPsec's anti-replay window (RFC 6479): seq s is bit
    s % SEQ_WINDOW while high - SEQ_WINDOW < s <= high, and advancing `high` clears the bits the new
    seqs take over. An actor never has more than its send queue (actor.queue_fragments, which config
    validation keeps <= DEDUPE_WINDOW) unacknowledged, so a re-send always lands inside the window;
    anything older is refused as TOO_OLD and counted, never acknowledged as stored. Worst case
    MAX_ACTORS_TRACKED x MAX_INCARNATIONS_PER_ACTOR windows; a few thousand actors hold tens of MB."""

    def __init__(self) -> None:
        self.high = -1
        self._bits = np.zeros(SEQ_WINDOW // 8, np.uint8)

    def _has(self, seq: int) -> bool:
        pos = seq % SEQ_WINDOW
        return bool(self._bits[pos >> 3] & (1 << (pos & 7)))

    def outcome(self, seq: int) -> Outcome:
        if seq > self.high:
            return Outcome.ACCEPTED
        if seq <= self.high - SEQ_WINDOW:
            return Outcome.TOO_OLD
        return Outcome.DUPLICATE if self._has(seq) else Outcome.ACCEPTED

    def add(self, seq: int) -> None:
        if seq > self.high:
            if seq - self.high >= SEQ_WINDOW:
                self._bits[:] = 0
            elif seq - self.high <= 8:  # the usual step of 1: plain integer work
                bits = self._bits
                for s in range(self.high + 1, seq + 1):
                    pos = s % SEQ_WINDOW
                    bits[pos >> 3] = int(bits[pos >> 3]) & ~(1 << (pos & 7)) & 0xFF
            else:  # the positions of seqs high+1..seq held seqs a window older: clear them
                pos = np.arange(self.high + 1, seq + 1) % SEQ_WINDOW
                np.bitwise_and.at(self._bits, pos >> 3, ~(np.left_shift(1, pos & 7)).astype(np.uint8))
            self.high = seq
        pos = seq % SEQ_WINDOW
        self._bits[pos >> 3] = int(self._bits[pos >> 3]) | (1 << (pos & 7))

    @property
    def recent(self) -> list[int]:
        seqs = np.arange(max(0, self.high - SEQ_WINDOW + 1), self.high + 1)
        pos = seqs % SEQ_WINDOW
        return seqs[(self._bits[pos >> 3] >> (pos & 7)) & 1 == 1].tolist()

    @classmethod
    def of(cls, high: int, recent) -> SeqWindow:
        w = cls()
        w.high = int(high)
        for seq in recent:  # seqs a window or more behind `high` (an older checkpoint's) are gone
            if w.high - SEQ_WINDOW < int(seq) <= w.high:
                pos = int(seq) % SEQ_WINDOW
                w._bits[pos >> 3] |= np.uint8(1 << (pos & 7))
        return w


def shard_table(table: ReplayTable | FifoTable, shards: int, batch_size: int) -> ReplayTable | FifoTable:
    """What one of `shards` buffer shards keeps (services/common/net/shards.py). A replay's capacity and
    warm-up are the experiment's: each shard holds its share of them (rounded up, and a warm-up of at
    least one batch), so the run replays as much history, and starts learning as soon, with any number
    of shards. A FIFO's capacity bounds what one shard holds unserved, so each keeps all of it."""
    if shards <= 1 or not isinstance(table, ReplayTable):
        return table
    return dataclasses.replace(table, capacity=-(-table.capacity // shards),
                               learning_starts=max(batch_size, -(-table.learning_starts // shards)))


class Store:
    def __init__(self, cfg: ExperimentConfig, metrics: Metrics):
        self.cfg, self.metrics = cfg, metrics
        self.algorithm = algorithms.get(cfg.algorithm)
        self.extras = self.algorithm.extras(cfg)   # what this run's fragments carry beyond the common fields
        self.max_elements = cfg.buffer.max_message_mb * (1 << 20)
        # How the algorithm wants its fragments kept and served (services/algorithms/base.py).
        self.table = shard_table(self.algorithm.table(cfg), cfg.topology.buffers, self.algorithm.batch_size(cfg))
        replay = isinstance(self.table, ReplayTable)
        self.limiter = RateLimiter(ratio=self.table.replay_ratio if replay else 1.0,
                                   warmup=self.table.learning_starts if replay else 0,
                                   batch_size=self.algorithm.batch_size(cfg), prefetch=cfg.buffer.batch_prefetch,
                                   fifo=not replay)
        self.largest_fragment = 0  # samples of the largest fragment stored: the limiter's slack
        # Its layout (ReplayRing or CompactReplay) is chosen at the first insert, or by a restore.
        self.replay: Replay | None = (ReplayRing(self.table.capacity, seed=cfg.seed, n_step=self.table.n_step,
                                                 gamma=self.table.gamma)
                                      if isinstance(self.table, ReplayTable) else None)
        self.fifo: RolloutFifo[pb.TrajectoryFragment | RawFragment] | None = (
            RolloutFifo(self.table.capacity_steps) if isinstance(self.table, FifoTable) else None)
        # actor_id -> incarnation -> window, both least recently used first (dedupe state).
        self._actors: OrderedDict[str, OrderedDict[int, SeqWindow]] = OrderedDict()
        self.inserted_samples = 0
        self.served_samples = 0
        self.wait_reason = "empty"
        self.last_batch_size = 0
        self._layout: dict | None = None
        self._learners: dict[str, tuple[int, int, float]] = {}  # learner_id -> (version, batches consumed, when)
        self._served_to: dict[str, int] = {}                    # learner_id -> batches served
        self.staleness = metrics.histogram("buffer/staleness")
        metrics.add_gauges(self.gauges)
        metrics.track_rate("buffer/samples_received_per_s", "buffer/samples_received_total")
        metrics.track_rate("buffer/samples_served_per_s", "buffer/samples_served_total")
        metrics.track_rate("buffer/fragments_received_per_s", "buffer/fragments_received_total")
        for name in ("duplicate", "too_old", "invalid", "evicted", "dropped_stale"):
            metrics.inc(f"buffer/fragments_{name}_total", 0)
        metrics.inc("buffer/dedupe_windows_forgotten_total", 0)
        metrics.inc("buffer/samples_dropped_stale_total", 0)
        metrics.inc("buffer/paced_seconds_total", 0)
        metrics.inc("buffer/batches_unsent_total", 0)
        metrics.inc("buffer/samples_evicted_early_total", 0)
        metrics.inc("buffer/samples_evicted_total", 0)   # (a replay overwrites its oldest: not an eviction)

    def report_progress(self, learner_id: str, version: int, consumed_batches: int, now: float | None = None) -> None:
        """Record a learner's current policy version and how many batches it has consumed (ReportProgress)."""
        now = time.monotonic() if now is None else now
        previous = self._learners.get(learner_id)
        if previous is not None and consumed_batches < previous[1]:
            # The learner restarted under the same id: what was in flight to it is gone.
            self._served_to[learner_id] = consumed_batches
        if previous is None:
            self._forget_learners(now)
        self._learners[learner_id] = (version, consumed_batches, now)

    def _forget_learners(self, now: float) -> None:
        """Drop learners silent for LEARNER_FORGET_S (restarted learners come back under new ids, so
        a long run would otherwise keep every id it ever saw), and batch counts of ids that never
        reported beyond MAX_UNREPORTED of them."""
        for lid in [lid for lid, (_, _, seen) in list(self._learners.items()) if now - seen > LEARNER_FORGET_S]:
            del self._learners[lid]
            self._served_to.pop(lid, None)
        unreported = [lid for lid in list(self._served_to) if lid not in self._learners]
        for lid in unreported[:max(0, len(unreported) - MAX_UNREPORTED)]:
            del self._served_to[lid]

    def in_flight(self, learner_id: str) -> int:
        """Batches served to `learner_id` that it has not reported consuming (prefetched or in transit)."""
        reported = self._learners.get(learner_id)
        return max(0, self._served_to.get(learner_id, 0) - (reported[1] if reported else 0))

    @property
    def learner_version(self) -> int | None:
        """The version at which what is served now will be consumed, or None before the first report.

        That is the newest reported version plus one per batch already served to that learner but not
        yet consumed (in its prefetch queue or in transit): each batch is one update. Judging
        staleness by the current version alone would ship fragments the learner then has to drop.
        Learners silent for LEARNER_EXPIRY_S are ignored (a restarted learner comes back under a new id).
        """
        live = self._live_learners()
        if not live:
            return None
        return max(self._learners[lid][0] + self.in_flight(lid) for lid in live)

    def _live_learners(self) -> list[str]:
        """The learners that reported within LEARNER_EXPIRY_S."""
        now = time.monotonic()
        # A copy first: the Prometheus thread reads this (gauges) while the event loop adds learners.
        return [lid for lid, (_, _, seen) in list(self._learners.items()) if now - seen <= LEARNER_EXPIRY_S]

    def insert_limit(self) -> int | None:
        """The samples-inserted count below which actors may start a fragment (None: no limit), for
        Buffer.WatchInsertLimit: the insert side of the rate limiter (services/buffer/limiter.py)."""
        live = self._live_learners()
        # FIFO: batches served but not yet trained on (in a learner's prefetch queue or in transit)
        # still count as waiting, or the transport's buffers would let actors run many batches ahead.
        in_flight = sum(self.in_flight(lid) for lid in live) * self.limiter.batch_size
        return self.limiter.insert_limit(self.inserted_samples, self.size + in_flight, self.served_samples,
                                          len(live), self.largest_fragment)

    def in_flight_total(self) -> int:
        """Batches served to live learners that they have not reported consuming yet."""
        return sum(self.in_flight(lid) for lid in self._live_learners())

    def unserve(self, learner_id: str, batch: pb.TrainingBatch) -> None:
        """A batch served to `learner_id` never left (its stream broke, or the learner stopped): it is
        not in flight, and nothing of it is lost. A replay's batch only drew rows the replay still
        holds; a FIFO's fragments go back to its front, to be served to the next learner (or dropped
        as stale, or evicted if the FIFO filled meanwhile, and counted so). Either way the rate
        limiter takes the draw back: it was never trained on."""
        self._served_to[learner_id] = max(0, self._served_to.get(learner_id, 0) - 1)
        self.served_samples = max(0, self.served_samples - batch_samples(batch))
        self.metrics.inc("buffer/batches_unsent_total")
        if self.fifo is not None:
            frags = list(batch.rollouts.fragments)
            self._count_evicted(self.fifo.put_back([(f, f.num_steps * len(f.env_ids)) for f in frags]))

    def _count_evicted(self, fragments) -> None:
        for old in fragments:
            self.metrics.inc("buffer/fragments_evicted_total")
            self.metrics.inc("buffer/samples_evicted_total", old.num_steps * len(old.env_ids))

    def high_water(self, actor_id: str, incarnation: int) -> int | None:
        """The newest seq stored from this incarnation of `actor_id`, or None if none is."""
        window = self._actors.get(actor_id, {}).get(incarnation)
        return None if window is None or window.high < 0 else window.high

    def _window(self, actor_id: str, incarnation: int) -> SeqWindow:
        """The dedupe window of (actor_id, incarnation), made if new; forgets the oldest beyond the bounds."""
        incarnations = self._actors.get(actor_id)
        if incarnations is None:
            incarnations = self._actors[actor_id] = OrderedDict()
            if len(self._actors) > MAX_ACTORS_TRACKED:
                _, gone = self._actors.popitem(last=False)
                self.metrics.inc("buffer/dedupe_windows_forgotten_total", len(gone))
        self._actors.move_to_end(actor_id)
        window = incarnations.get(incarnation)
        if window is None:
            window = incarnations[incarnation] = SeqWindow()
            if len(incarnations) > MAX_INCARNATIONS_PER_ACTOR:
                incarnations.popitem(last=False)
                self.metrics.inc("buffer/dedupe_windows_forgotten_total")
        incarnations.move_to_end(incarnation)
        return window

    def insert(self, msg: pb.TrajectoryFragment | RawFragment) -> Outcome:
        """Validate, dedupe and store one fragment. Raises TensorError (nothing stored) if refused.

        A RawFragment (the push path) is validated on views of its bytes and stored as those bytes:
        nothing of its payload is copied until a batch is cut.
        """
        frag = decode_fragment(msg, algorithm=self.algorithm.code, extras=self.extras.steps,
                               start_extras=self.extras.start, max_elements=self.max_elements)
        window = self._actors.get(frag.actor_id, {}).get(frag.incarnation)
        outcome = Outcome.ACCEPTED if window is None else window.outcome(frag.seq)
        if outcome is not Outcome.ACCEPTED:
            self.metrics.inc(f"buffer/fragments_{outcome.value}_total")
            return outcome
        if self.replay is not None:
            if self.replay.data is None:
                self.replay = self._replay_for(frag)
            early = self.replay.evicted_early
            self.replay.add(frag)  # checks shapes against what is stored before writing anything
            self.metrics.inc("buffer/samples_evicted_early_total", self.replay.evicted_early - early)
        else:
            self._check_layout(frag)
            self._count_evicted(self.fifo.put(msg, frag.num_samples))
        self._window(frag.actor_id, frag.incarnation).add(frag.seq)
        self.inserted_samples += frag.num_samples
        self.largest_fragment = max(self.largest_fragment, frag.num_samples)
        self.metrics.inc("buffer/fragments_received_total")
        self.metrics.inc("buffer/samples_received_total", frag.num_samples)
        self.metrics.set("buffer/policy_version_newest", max(frag.policy_version,
                                                              self.metrics.gauges.get("buffer/policy_version_newest", 0)))
        return Outcome.ACCEPTED

    def _replay_for(self, frag) -> Replay:
        """The replay layout for a first fragment, by `buffer.compact_replay` (docs/architecture.md
        section 2, "Replay storage"): frames stored once where they are stacks that shift."""
        mode = self.cfg.buffer.compact_replay
        compact = mode != "never" and CompactReplay.suits(frag, always=mode == "always")
        cls = CompactReplay if compact else ReplayRing
        return self.replay if type(self.replay) is cls else self.replay.replaced_by(cls)

    def restore_replay(self, arrays: dict[str, np.ndarray], state: dict) -> None:
        """Take over a checkpoint's replay (services/buffer/checkpoint.py) in the layout it was saved
        in. Raises ValueError, changing nothing, if it does not restore, or if `buffer.compact_replay`
        asks for the other layout (which would need every stack converted)."""
        compact = state.get("kind") == CompactReplay.kind
        mode = self.cfg.buffer.compact_replay
        if state.get("size") and mode == ("never" if compact else "always"):
            raise ValueError(f"it holds a {'compact' if compact else 'plain (obs and next_obs)'} replay and "
                             f"buffer.compact_replay is {mode!r}: set it to 'auto' to restore this checkpoint")
        cls = CompactReplay if compact else ReplayRing
        ring = self.replay if type(self.replay) is cls else cls(self.replay.capacity, n_step=self.replay.n_step,
                                                                gamma=self.replay.gamma)
        early = ring.evicted_early
        ring.restore(arrays, state)
        self.replay = ring
        self.metrics.inc("buffer/samples_evicted_early_total", ring.evicted_early - early)

    def dedupe_state(self) -> dict[str, np.ndarray]:
        """The dedupe windows as flat arrays (no pickle), for a buffer checkpoint: one row per
        (actor_id, incarnation), least recently used first, and every window's recent seqs
        concatenated (`recent_counts` says how many belong to each row)."""
        rows = [(a, inc, w) for a, incs in self._actors.items() for inc, w in incs.items()]
        recent = [w.recent for _, _, w in rows]
        return {"actor_ids": np.array([a for a, _, _ in rows], dtype=np.str_),
                "incarnations": np.array([inc for _, inc, _ in rows], dtype=np.uint64),
                "highs": np.array([w.high for _, _, w in rows], dtype=np.int64),
                "recent_counts": np.array([len(r) for r in recent], dtype=np.int64),
                "recent": np.array([s for r in recent for s in r], dtype=np.int64)}

    def restore_dedupe_state(self, state: dict[str, np.ndarray]) -> None:
        """Replace the dedupe windows with those of `dedupe_state()` (raises ValueError if inconsistent)."""
        ids, incs, highs, counts = (state[k] for k in ("actor_ids", "incarnations", "highs", "recent_counts"))
        recent = state["recent"]
        if not len(ids) == len(incs) == len(highs) == len(counts) or int(counts.sum()) != len(recent):
            raise ValueError("dedupe state: array lengths disagree")
        self._actors = OrderedDict()
        offsets = np.concatenate([[0], np.cumsum(counts)])
        for i, (actor_id, inc, high) in enumerate(zip(ids.tolist(), incs.tolist(), highs.tolist())):
            window = SeqWindow.of(high, recent[offsets[i]:offsets[i + 1]].tolist())
            self._actors.setdefault(str(actor_id), OrderedDict())[int(inc)] = window

    def evict_all(self) -> int:
        """Empty the replay (a drained shard's, services/buffer/drain.py): a fresh ring of the same
        capacity, the dedupe windows and counters kept. Returns the samples it held."""
        held = self.size
        if self.replay is not None and held:
            t = self.table
            self.replay = ReplayRing(t.capacity, seed=self.cfg.seed, n_step=t.n_step, gamma=t.gamma)
        return held

    @property
    def size(self) -> int:
        """Samples held: replay occupancy, or steps waiting in the FIFO."""
        return self.replay.size if self.replay is not None else self.fifo.steps

    def next_batch(self, batch_size: int, learner_id: str = "") -> pb.TrainingBatch | None:
        """Cut one batch for `learner_id`, or return None and set `wait_reason` when none can be cut yet."""
        batch = pb.TrainingBatch(buffer_inserted_total=self.inserted_samples)
        self.last_batch_size = batch_size
        version = self.learner_version
        if learner_id in self._learners and self.in_flight(learner_id) > self.cfg.buffer.batch_prefetch:
            # A learner that reports its progress is served at most batch_prefetch + 1 batches ahead of
            # what it has trained on: the transport's buffers would take many more, which then go
            # stale, and in a group would starve the other members (the rate limiter counts on it).
            self.wait_reason = "prefetched"
            return None
        if self.replay is not None:
            d = self.table
            if self.replay.size < max(d.learning_starts, batch_size):
                self.wait_reason = "warming up"
                return None
            if not self.limiter.can_sample(self.inserted_samples, self.served_samples, batch_size):
                self.wait_reason = "paced"
                return None
            rows = self.replay.sample(batch_size)
            for name, arr in rows.items():
                encode(arr, getattr(batch.transitions, name))
            if version is not None:
                self.staleness.observe(version - rows["policy_version"])
        else:
            self._drop_stale(version)
            frags = self.fifo.take(batch_size)
            if frags is None:
                self.wait_reason = "empty"
                return None
            for f in frags:  # raw bytes are merged as they came: one parse, no re-encoding
                if isinstance(f, RawFragment):
                    batch.rollouts.fragments.add().MergeFromString(f.data)
                else:
                    batch.rollouts.fragments.append(f)
            if version is not None:
                self.staleness.observe([version - f.policy_version for f in frags],
                                       [f.num_steps * len(f.env_ids) for f in frags])
        served = batch_samples(batch)
        self.served_samples += served
        self._served_to[learner_id] = self._served_to.get(learner_id, 0) + 1
        batch.buffer_size = self.size
        self.metrics.inc("buffer/samples_served_total", served)
        self.metrics.inc("buffer/batches_served_total")
        return batch

    def _check_layout(self, frag) -> None:
        """PPO: every fragment must match the first one's per-step obs/action shapes and dtypes."""
        layout = {"obs": (frag.obs.shape[2:], frag.obs.dtype), "actions": (frag.actions.shape[2:], frag.actions.dtype)}
        if self._layout is None:
            self._layout = layout
            return
        for name, (shape, dtype) in layout.items():
            want_shape, want_dtype = self._layout[name]
            if (shape, dtype) != (want_shape, want_dtype):
                raise TensorError(name, f"{dtype.name} {list(shape)} per step differs from this buffer's "
                                        f"{want_dtype.name} {list(want_shape)}")

    def _drop_stale(self, version: int | None) -> None:
        p = self.table
        if version is None or p.max_policy_lag is None or p.stale_fragments != "drop":
            return
        for f in self.fifo.remove_if(lambda f: version - f.policy_version > p.max_policy_lag):
            self.metrics.inc("buffer/fragments_dropped_stale_total")
            self.metrics.inc("buffer/samples_dropped_stale_total", f.num_steps * len(f.env_ids))

    def gauges(self) -> dict[str, float]:
        """Occupancy, replay ratio and staleness gauges for GetStats and /metrics."""
        produced = self.inserted_samples - self.limiter.warmup  # the warm-up is not production
        ratio = self.served_samples / produced if produced > 0 else 0.0
        out = {"buffer/size_samples": self.size, "buffer/samples_per_insert": ratio,
               "buffer/samples_produced": max(0, produced),   # what the ratio divides by: shards combine on it
               "buffer/actors_known": len(self._actors)}
        if self.learner_version is not None:
            out["buffer/learner_version"] = self.learner_version
        if (limit := self.insert_limit()) is not None:  # the rate limiter's insert side
            out["buffer/insert_limit_samples"] = limit
        if self.replay is not None:
            d = self.table
            # The paper's staleness P = B_s / N_s: batch size over the number of samples stored.
            out["buffer/staleness_p"] = self.last_batch_size / self.size if self.size else 0.0
            if d.replay_ratio:
                out["buffer/replay_ratio_target"] = d.replay_ratio
                lo, hi = d.replay_ratio * (1 - d.replay_ratio_tolerance), d.replay_ratio * (1 + d.replay_ratio_tolerance)
                out["buffer/replay_ratio_in_band"] = float(self.served_samples > 0 and lo <= ratio <= hi)
        return out

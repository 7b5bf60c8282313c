"""The sections of the role processes: `topology` (how many of each `kuberl up` starts; the planner
scales from there) and the settings each role's process reads of its own, `actor`, `buffer` and `learner`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.common.protocol.fragments import DEDUPE_WINDOW
from services.common.settings import require
from services.common.net.shards import MAX_SHARDS


@dataclass(frozen=True)
class TopologyConfig:
    """How many processes of each role `kuberl up` starts."""
    actors: int = 1                   # actor processes at start (the planner scales from there)
    learners: int = 1                 # learner processes at start; more than one train as a group, averaging gradients
    # Buffer shards: each actor pushes to one, each learner streams from all; a replay's buffer_size
    # and learning_starts are split between them (docs/architecture.md, "Buffer shards").
    buffers: int = 1                  # buffer shards: each actor pushes to one, each learner streams from all

    def __post_init__(self) -> None:
        require(1 <= self.actors <= 256, "actors", self.actors, "must be 1..256")
        require(1 <= self.learners <= 64, "learners", self.learners,
                "must be 1..64 (more than one train as a group, averaging gradients)")
        require(1 <= self.buffers <= MAX_SHARDS, "buffers", self.buffers,
                f"must be 1..{MAX_SHARDS} (buffer shards: each actor pushes to one, each learner streams from all)")


@dataclass(frozen=True)
class ActorConfig:
    """Actor process settings."""
    # The send queue, bounded in fragments and in bytes: at either bound the oldest unsent fragment is
    # dropped (and counted). Both also bound what one push stream has in flight unacknowledged. Sized
    # to ride out a second or more of a stalled stream: 1,024 tiny CartPole fragments are about 1 MB,
    # while 64 MB holds about 60 Atari fragments of 32 steps x 8 envs.
    queue_fragments: int = 1024       # send queue bound in fragments: beyond it the oldest unsent is dropped (counted)
    queue_mb: float = 64.0            # send queue bound in MiB: beyond it the oldest unsent fragment is dropped (counted)
    push_ack_interval_s: float = 2.0  # a push stream is half-closed and acknowledged this often
    torch_threads: int = 1            # torch threads of the actor's policy
    # A user's cap on env steps per second (all of this actor's envs together); 0 = none. Not needed
    # for balance: the buffer's rate limiter holds an actor that outruns the learner (docs/rate-limiter.md).
    max_env_steps_per_s: float = 0.0  # cap on this actor's env steps per second, all its envs together (0 = none)
    # On-policy pacing (FIFO algorithms such as PPO): after cutting this many fragments with one policy
    # version (external mode: all sessions together), wait for the learner's next weights before
    # stepping on, or answering simulators (at most pace_timeout_s, then a fresh quota, counted).
    # Holds an actor that steps faster than the learner trains to what the learner consumes, as a
    # synchronous PPO does, instead of the FIFO evicting what it stepped (and the stepping taking the
    # learner's CPU). The fragments must hold a learner batch. 0 = never wait.
    fragments_per_version: int = 0    # on-policy pacing: fragments per policy version, then wait for weights (0 = never)
    pace_timeout_s: float = 10.0      # the longest wait for new weights under fragments_per_version
    # External simulators (env.mode: external):
    max_sessions: int = 256            # concurrent EnvSession streams; more get RESOURCE_EXHAUSTED
    session_timeout_s: float = 30.0    # a session silent this long is closed (DEADLINE_EXCEEDED)
    session_resume_s: float = 300.0    # a session_id reconnecting within this resumes its episodes
    # Observations and rewards holding NaN or infinity are always refused (services/actor/finite.py).
    # True: observations outside the finite bounds of their space are refused too: a local env's
    # observation_space, a simulator's hello (its BoxSpace low/high, or each Dict key's).
    check_obs_bounds: bool = False    # also refuse observations outside their space's finite bounds (NaN and inf always are)

    def __post_init__(self) -> None:
        require(self.max_sessions >= 1, "max_sessions", self.max_sessions, "must be >= 1")
        require(self.session_timeout_s > 0, "session_timeout_s", self.session_timeout_s, "must be > 0")
        require(self.session_resume_s >= 0, "session_resume_s", self.session_resume_s, "must be >= 0")
        require(self.max_env_steps_per_s >= 0, "max_env_steps_per_s", self.max_env_steps_per_s, "must be >= 0")
        require(self.fragments_per_version >= 0, "fragments_per_version", self.fragments_per_version, "must be >= 0")
        require(self.pace_timeout_s > 0, "pace_timeout_s", self.pace_timeout_s, "must be > 0")
        require(1 <= self.queue_fragments <= DEDUPE_WINDOW, "queue_fragments", self.queue_fragments,
                f"must be 1..{DEDUPE_WINDOW}: a buffer dedupes a re-sent fragment exactly only within the last "
                f"{DEDUPE_WINDOW} seqs of its sender (services/common/protocol/fragments.py)")
        require(self.queue_mb > 0, "queue_mb", self.queue_mb, "must be > 0")
        require(self.push_ack_interval_s > 0, "push_ack_interval_s", self.push_ack_interval_s, "must be > 0")
        require(self.torch_threads >= 1, "torch_threads", self.torch_threads, "must be >= 1")


@dataclass(frozen=True)
class BufferConfig:
    """Buffer process settings."""
    max_message_mb: int = 64          # largest fragment accepted / batch sent, MiB
    fifo_capacity_steps: int = 8192   # PPO: steps held before the oldest fragment is evicted (counted)
    # Batches a learner holds queued beside the one it trains on; the buffer serves a learner that
    # reports its progress no more than this many batches beyond the one it trains on.
    batch_prefetch: int = 2           # batches a learner may hold queued beside the one it trains on
    # DQN: where the replay ring (with its dedupe windows and counters) is checkpointed, periodically
    # and at shutdown, and restored from at start, so a restarted buffer keeps its experience.
    # None = off. `kuberl buffer --checkpoint-dir` overrides it. PPO's FIFO is never checkpointed.
    # Costs: docs/reliability.md, "Buffer checkpoints".
    checkpoint_dir: str | None = None  # DQN, SAC: where the replay is checkpointed and restored from (null: not kept)
    checkpoint_interval_s: float = 300.0  # between replay checkpoints; one is also written at shutdown
    keep_checkpoints: int = 2         # newest replay checkpoints kept; an unreadable newest falls back
    # DQN: how the replay ring keeps stacked frames (docs/architecture.md section 2, "Replay storage").
    # "auto": each frame once when the first fragment's observations are uint8 frame stacks that
    # move on by one frame a step (Atari: ~7.4 KB a transition instead of 56 KB), else obs and next_obs
    # as they came; "always": frames once for any observation with a stack axis; "never": as they came.
    # A checkpoint restores in the layout it was saved in; "always"/"never" refuse one of the other.
    compact_replay: str = "auto"      # replay keeps stacked frames once (auto: for uint8 frame stacks), always or never
    # DQN, SAC: the replay's Store works on a thread of its own (services/buffer/owner.py), so the event
    # loop goes on reading pushes and writing batches meanwhile, and batch cuts pass queued inserts.
    # It shifts the GIL-bound work toward learners rather than adding to it: off by default
    # (docs/benchmarks.md, "Buffer event loop"). A FIFO (PPO) always works on the loop.
    store_thread: bool = False        # DQN, SAC: the replay works on a thread of its own, off the event loop

    def __post_init__(self) -> None:
        require(1 <= self.max_message_mb <= 1024, "max_message_mb", self.max_message_mb, "must be 1..1024")
        require(self.compact_replay in ("auto", "always", "never"), "compact_replay", self.compact_replay,
                "must be 'auto' (frames stored once for stacked uint8 frames), 'always' or 'never'")
        require(self.fifo_capacity_steps >= 1, "fifo_capacity_steps", self.fifo_capacity_steps, "must be >= 1")
        require(self.batch_prefetch >= 1, "batch_prefetch", self.batch_prefetch, "must be >= 1")
        require(self.checkpoint_dir is None or self.checkpoint_dir.strip() != "", "checkpoint_dir",
                self.checkpoint_dir, "must be a directory path, or left out (null) to keep the replay in memory "
                "only (a restarted buffer then starts empty)")
        require(self.checkpoint_interval_s >= 1, "checkpoint_interval_s", self.checkpoint_interval_s,
                "must be >= 1 second: each replay checkpoint copies and writes the whole ring")
        require(self.keep_checkpoints >= 1, "keep_checkpoints", self.keep_checkpoints,
                "must be >= 1 (2 or more lets a restart fall back when the newest cannot be read)")


@dataclass(frozen=True)
class LearnerConfig:
    """Learner process settings."""
    publish_interval_updates: int = 1  # K: publish weights every K updates
    checkpoint_interval_s: float = 60.0  # seconds between checkpoints; one is also written at shutdown
    keep_checkpoints: int = 3         # newest learner checkpoints kept
    torch_threads: int = 1            # torch threads of the learner
    device: str = "cpu"               # cpu | cuda | cuda:N | auto (cuda when torch sees a GPU, else cpu)

    def __post_init__(self) -> None:
        require(self.publish_interval_updates >= 1, "publish_interval_updates",
                self.publish_interval_updates, "must be >= 1")
        require(self.checkpoint_interval_s > 0, "checkpoint_interval_s", self.checkpoint_interval_s, "must be > 0")
        require(self.keep_checkpoints >= 1, "keep_checkpoints", self.keep_checkpoints, "must be >= 1")
        require(self.torch_threads >= 1, "torch_threads", self.torch_threads, "must be >= 1")
        require(self.device in ("cpu", "auto") or re.fullmatch(r"cuda(:\d+)?", self.device) is not None,
                "device", self.device, "must be 'cpu', 'cuda', 'cuda:N' or 'auto' (cuda when available)")

"""The learner's core: decode batches, measure staleness, update, encode weights, checkpoint.

Blocking and free of gRPC/asyncio: main.py calls it from worker threads. One lock serialises
updates, weight snapshots and the copy of the state a checkpoint takes, so a checkpoint never sees a
half-applied update; the checkpoint's disk write runs after the lock is released, so a slow disk
does not stall training.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import torch

from kuberl.v1 import common_pb2 as pb
from services import algorithms
from services.config import ExperimentConfig
from services.common.protocol.fragments import batch_samples
from services.common.models.nets import is_image, policy_spec, to_numpy
from services.common.protocol.spaces import spec_to_dict
from services.common.stats import Metrics
from services.common.protocol.tensors import NonFiniteError
from services.common.protocol.weights import encode_weights
from services.learner import checkpoint
from services.learner.distributed import GradientSync, GroupBroken

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: ExperimentConfig, metrics: Metrics, checkpoint_dir: str | Path,
                 sync: GradientSync | None = None, policy: str | None = None):
        """`sync`: this learner's membership of a group of learners (None: it trains alone). Rank 0
        restores the latest checkpoint and broadcasts its state, so the group starts equal. `policy`:
        the one it trains, of a run of several (config `policies`): its agents' spaces."""
        self.cfg, self.metrics, self.checkpoint_dir, self.sync = cfg, metrics, Path(checkpoint_dir), sync
        self.policy = cfg.policy(policy)
        self.spec = policy_spec(cfg, self.policy)
        self.algorithm = algorithms.get(cfg.algorithm)
        self.algo = self._new_algo()
        if self.algo.device.type == "cuda" and not is_image(self.spec):
            # As SB3 warns for PPO without a CNN: measured on an H200, SAC's 64x64 MLPs updated at half
            # the rate of one CPU thread there (docs/benchmarks.md, "GPU"), each update a few dozen tiny kernels.
            log.warning("training on %s without a CNN (observations %s): small MLPs are often faster on "
                        "the CPU; learner.device: cpu", self.algo.device, list(self.spec.obs_shape))
        self.lock = threading.Lock()
        # Serialises checkpoint writes (which run outside `lock`): the periodic one may still be on
        # disk when the shutdown one starts, and they must land in the order their snapshots were taken.
        self.write_lock = threading.Lock()
        self.writes_checkpoints = sync is None or sync.rank == 0
        self.interrupted = False  # a group update failed part-way: the state may be half-applied
        if self.writes_checkpoints and (restored := checkpoint.restore_latest(self.checkpoint_dir,
                                                                              self._apply_checkpoint)):
            log.info("restored %s at version %d", restored[0], self.algo.version)
        if sync is not None:
            state = sync.broadcast_state(self.algo.state_dict() if sync.rank == 0 else None)
            if sync.rank != 0:
                self.algo.load_state_dict(state)
                log.info("took rank 0's state at version %d", self.algo.version)
        metrics.set("learner/group_size", sync.world_size if sync else 1)
        metrics.set("learner/rank", sync.rank if sync else 0)
        metrics.set("learner/policy_version", self.version)
        metrics.track_rate("learner/updates_per_s", "learner/updates_total")
        metrics.track_rate("learner/samples_per_s", "learner/samples_total")
        for name in ("fragments_dropped_stale", "samples_dropped_stale", "fragments_corrected", "batches_skipped",
                     "batches_consumed", "samples_consumed", "samples", "train_seconds", "batches_invalid",
                     "batches_nonfinite", "gradient_steps_skipped_nonfinite", "weights_refused_nonfinite",
                     "checkpoints_refused_nonfinite"):
            metrics.inc(f"learner/{name}_total", 0)
        self.lag = metrics.histogram("learner/policy_lag")  # observed by the algorithm as it trains

    def _new_algo(self):
        """The algorithm's learner part at its seeded initialisation (the same on every call)."""
        torch.manual_seed(self.cfg.seed)
        return self.algorithm.learner(self.cfg, self.spec, self.metrics, self.sync)

    def _apply_checkpoint(self, state: dict) -> None:
        """Load a checkpoint's state; if it does not fit (another model, missing keys), the algorithm
        may be half-loaded, so it is rebuilt fresh before the error goes on to the next fallback."""
        held = state.get("policy")
        if held is not None and held != self.policy:   # (a checkpoint of another policy of the run)
            raise ValueError(f"it holds policy {held!r}, this learner trains {self.policy!r}")
        try:
            self.algo.load_state_dict(state["algo"])
        except BaseException:
            self.algo = self._new_algo()
            raise

    @property
    def version(self) -> int:
        return self.algo.version

    def train(self, batch: pb.TrainingBatch) -> None:
        """Decode, validate and train on one batch (blocking). A malformed batch, or one holding NaN or
        infinity (services/algorithms/checks.py), is counted and skipped.

        Every batch taken off the stream counts as consumed (`learner/batches_consumed_total`), trained
        on or not: the buffer subtracts it from what it has in flight to this learner.
        """
        started = time.perf_counter()
        try:
            self._train(batch)
        except GroupBroken:
            self.interrupted = True
            raise
        finally:
            # Busy time: samples_total / train_seconds_total is what this learner could consume if it
            # never waited for data (the planner's per-learner rate TR_L).
            self.metrics.inc("learner/train_seconds_total", time.perf_counter() - started)

    def _train(self, batch: pb.TrainingBatch) -> None:
        self.metrics.inc("learner/batches_consumed_total")
        self.metrics.inc("learner/samples_consumed_total", batch_samples(batch))
        try:
            data = self.algo.decode(batch)
        except (ValueError, KeyError) as err:  # NaN or infinity in it (NonFiniteError), or malformed
            nonfinite = isinstance(err, NonFiniteError)
            self.metrics.inc("learner/batches_nonfinite_total" if nonfinite else "learner/batches_invalid_total")
            log.error("skipping %s batch %d: %s", "non-finite" if nonfinite else "malformed", batch.batch_id, err)
            if self.sync is not None:  # the group's gradient steps go on: join them with nothing
                with self.lock:
                    self._empty_update()
            return
        with self.lock:
            before = self.version
            learned = self.algo.learn(data)
            if learned is None:  # nothing usable (e.g. every fragment too stale; counted by the algorithm)
                self.metrics.inc("learner/batches_skipped_total")
                if self.sync is not None:
                    self._empty_update()
                return
            samples, stats = learned
            self.metrics.inc("learner/updates_total", self.version - before)
            self.metrics.set("learner/gradient_steps", self.algo.gradient_steps)
        self.metrics.inc("learner/samples_total", samples)
        self.metrics.inc("learner/batches_total")
        self.metrics.set("learner/policy_version", self.version)
        self.metrics.set("learner/buffer_size_samples", batch.buffer_size)
        for k, v in stats.items():
            self.metrics.set(f"learner/{k}", v)

    def _empty_update(self) -> None:
        """Take part in the group's update with no data (weight 0); the version moves with the group's."""
        before = self.version
        self.algo.empty_update()
        self.metrics.inc("learner/updates_total", self.version - before)
        self.metrics.set("learner/policy_version", self.version)

    def weights(self) -> list[pb.Weights] | None:
        """The current policy as Weights chunks (blocking); None, logged and counted, if a tensor of it
        holds NaN or infinity: actors must never act with it (the newest published version stands)."""
        with self.lock:
            version, arrays = self.version, to_numpy(self.algo.policy)
        bad = next((k for k, a in arrays.items() if a.dtype.kind == "f" and not np.isfinite(a).all()), None)
        if bad is not None:
            self.metrics.inc("learner/weights_refused_nonfinite_total")
            log.error("not publishing version %d: its tensor %s holds NaN or infinity", version, bad)
            return None
        return encode_weights(version, arrays)

    def checkpoint(self) -> Path | None:
        """Write a checkpoint of the current state (blocking). In a group only rank 0 writes (the others
        hold the same state); they return None. A state holding NaN or infinity is never written
        (logged, counted, None): the last checkpoint stands, and a restart resumes from it."""
        if not self.writes_checkpoints:
            return None
        if self.interrupted:  # PPO may have taken some of an update's steps: keep the last whole checkpoint
            log.warning("not checkpointing: a group update was interrupted part-way; the last checkpoint stands")
            return None
        with self.write_lock:
            with self.lock:  # a copy of the state between two updates; the disk write runs without the lock
                version, state = self.version, checkpoint.snapshot({"algo": self.algo.state_dict(),
                                                                    "config": self.cfg.to_dict(),
                                                                    "policy": self.policy,
                                                                    # kuberl serve/export need no env
                                                                    "spaces": spec_to_dict(self.spec)})
            if (bad := checkpoint.nonfinite(state["algo"], "algo")) is not None:  # a restart must never resume it
                self.metrics.inc("learner/checkpoints_refused_nonfinite_total")
                log.error("not checkpointing version %d: %s holds NaN or infinity; the last checkpoint stands",
                          version, bad)
                return None
            started = time.perf_counter()
            try:
                path = checkpoint.save(self.checkpoint_dir, version, state, self.cfg.learner.keep_checkpoints)
            except OSError as err:  # a full or failing disk must not stop training; the last checkpoint stands
                self.metrics.inc("learner/checkpoint_errors_total")
                log.error("checkpoint of version %d to %s failed: %s", version, self.checkpoint_dir, err)
                return None
        self.metrics.inc("learner/checkpoints_total")
        log.info("checkpoint %s (%.2f s)", path, time.perf_counter() - started)
        return path

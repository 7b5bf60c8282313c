"""The learner's core: decode batches, measure staleness, update, encode weights, checkpoint.

Blocking and free of gRPC/asyncio: main.py calls it from worker threads. One lock serialises
updates, weight snapshots and checkpoints, so a checkpoint never sees a half-applied update.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import torch

from kuberl.v1 import common_pb2 as pb
from services.common.config import ExperimentConfig
from services.common.fragments import TRANSITION_FIELDS, decode_fragment
from services.common.nets import env_spec, to_numpy
from services.common.stats import Metrics
from services.common.tensors import decode
from services.common.weights import encode_weights
from services.learner import checkpoint
from services.learner.dqn import DQN
from services.learner.ppo import PPO

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: ExperimentConfig, metrics: Metrics, checkpoint_dir: str | Path):
        self.cfg, self.metrics, self.checkpoint_dir = cfg, metrics, Path(checkpoint_dir)
        torch.manual_seed(cfg.seed)
        spec = env_spec(cfg.env.id, cfg.env.max_episode_steps)
        device = cfg.learner.device
        self.algo = DQN(cfg.dqn, spec, device) if cfg.algorithm == "dqn" else PPO(cfg.ppo, spec, device)
        self.lock = threading.Lock()
        if (path := checkpoint.latest(self.checkpoint_dir)) is not None:
            state = checkpoint.load(path)
            self.algo.load_state_dict(state["algo"])
            log.info("restored %s at version %d", path, self.algo.version)
        metrics.set("learner/policy_version", self.version)
        metrics.track_rate("learner/updates_per_s", "learner/updates_total")
        metrics.track_rate("learner/samples_per_s", "learner/samples_total")
        metrics.inc("learner/batches_invalid_total", 0)

    @property
    def version(self) -> int:
        return self.algo.version

    def train(self, batch: pb.TrainingBatch) -> None:
        """Decode, validate and train on one batch (blocking). A malformed batch is counted and skipped."""
        try:
            if self.cfg.algorithm == "dqn":
                data = {f: decode(getattr(batch.transitions, f), f"transitions.{f}") for f in TRANSITION_FIELDS}
                versions, samples = data.pop("policy_version"), len(data["rewards"])
            else:
                frags = [decode_fragment(m, algorithm=pb.ALGORITHM_PPO) for m in batch.rollouts.fragments]
                versions = np.concatenate([np.full(f.num_samples, f.policy_version) for f in frags])
                samples, data = len(versions), frags
        except (ValueError, KeyError) as err:
            self.metrics.inc("learner/batches_invalid_total")
            log.error("skipping malformed batch %d: %s", batch.batch_id, err)
            return
        with self.lock:
            lag = self.version - versions
            self.metrics.rolling("learner/policy_lag").extend(np.percentile(lag, [0, 25, 50, 75, 100]))
            before = self.version
            stats = self.algo.update(data)
            self.metrics.inc("learner/updates_total", self.version - before)
        self.metrics.inc("learner/samples_total", samples)
        self.metrics.inc("learner/batches_total")
        self.metrics.set("learner/policy_version", self.version)
        self.metrics.set("learner/buffer_size_samples", batch.buffer_size)
        for k, v in stats.items():
            self.metrics.set(f"learner/{k}", v)

    def weights(self) -> list[pb.Weights]:
        """The current policy as Weights chunks (blocking)."""
        with self.lock:
            version, arrays = self.version, to_numpy(self.algo.policy)
        return encode_weights(version, arrays)

    def checkpoint(self) -> Path:
        """Write a checkpoint of the current state (blocking)."""
        with self.lock:
            path = checkpoint.save(self.checkpoint_dir, self.version,
                                   {"algo": self.algo.state_dict(), "config": self.cfg.to_dict()},
                                   self.cfg.learner.keep_checkpoints)
        self.metrics.inc("learner/checkpoints_total")
        log.info("checkpoint %s", path)
        return path

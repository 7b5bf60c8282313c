"""Run directories with a policy in them, made in-process for the tests of `kuberl eval` and `kuberl export`.

`train` runs the actor's, the buffer's and the learner's cores (Rollout, Store, Trainer) in one loop,
without processes or gRPC, and leaves what `kuberl up` leaves for these commands: config.yaml and
checkpoints/ckpt-*.pt written by the learner's own checkpoint code. `untrained` writes the learner's
seeded initialisation as a checkpoint (version 0).
"""

from __future__ import annotations

from pathlib import Path

import torch

from services import algorithms
from services.actor.rollout import Rollout
from services.buffer.store import Store
from services.config import config_from_dict, dump_config
from services.common.protocol.fragments import RawFragment
from services.common.models.nets import to_numpy
from services.common.stats import Metrics
from services.learner.trainer import Trainer


def _trainer(run: Path, cfg_dict: dict):
    torch.set_num_threads(1)
    cfg = config_from_dict(cfg_dict)
    run.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run / "config.yaml")
    return cfg, Trainer(cfg, Metrics("learner"), run / "checkpoints")


def train(run: Path, cfg_dict: dict, env_steps: int) -> Path:
    """Train for `env_steps` env steps (one actor: on-policy, each batch from the newest weights);
    returns the final checkpoint."""
    cfg, trainer = _trainer(run, cfg_dict)
    rollout = Rollout(cfg, "actor-0", 0, Metrics("actor"))
    store = Store(cfg, Metrics("buffer"))
    batch_size = algorithms.get(cfg.algorithm).batch_size(cfg)
    try:
        while rollout.env_steps < env_steps:
            rollout.policy.offer_weights(trainer.version, to_numpy(trainer.algo.policy))
            store.insert(RawFragment(rollout.collect().payload))
            if (batch := store.next_batch(batch_size, "learner")) is not None:
                trainer.train(batch)
    finally:
        rollout.close()
    return trainer.checkpoint()


def untrained(run: Path, cfg_dict: dict, edit=None) -> Path:
    """The learner's initialisation as checkpoint 0; `edit(algo)` may change its state first."""
    _, trainer = _trainer(run, cfg_dict)
    if edit is not None:
        edit(trainer.algo)
    return trainer.checkpoint()

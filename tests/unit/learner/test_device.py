"""learner.device: cpu, cuda[:N] or auto; a clear error without a GPU; the GPU path where one exists."""

from __future__ import annotations

import pytest
import torch

from services.actor.rollout import Rollout
from services.buffer.store import Store
from services.config import ConfigError, config_from_dict
from services.common.protocol.fragments import RawFragment
from services.common.models.nets import resolve_device
from services.common.stats import Metrics
from services.learner.trainer import Trainer
from tests.unit.actor.test_atari_rollout import config as atari_config

pytest.importorskip("ale_py", reason="ale-py is in the actor extra")


def test_device_setting():
    assert config_from_dict({"learner": {"device": "auto"}}).learner.device == "auto"
    assert config_from_dict({"learner": {"device": "cuda:1"}}).learner.device == "cuda:1"
    with pytest.raises(ConfigError, match=r"^learner.device: 'gpu' is invalid"):
        config_from_dict({"learner": {"device": "gpu"}})
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where torch sees no GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match=r"learner.device: 'cuda' but torch sees no CUDA device"):
        resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU path runs where torch sees one")
@pytest.mark.parametrize("algorithm", ["dqn", "ppo"])
def test_learner_trains_on_uint8_frames_on_the_gpu(tmp_path, algorithm):
    cfg = atari_config(algorithm)
    cfg = config_from_dict({**cfg.to_dict(), "learner": {**cfg.to_dict()["learner"], "device": "cuda"}})
    trainer = Trainer(cfg, Metrics("learner"), tmp_path / "ckpt")
    assert next(trainer.algo.policy.parameters()).is_cuda
    rollout = Rollout(cfg, "gpu-actor", 0, Metrics("actor"))
    store = Store(cfg, Metrics("buffer"))
    try:
        for _ in range(2):
            store.insert(RawFragment(rollout.collect().payload))
    finally:
        rollout.close()
    trainer.train(store.next_batch(8 if algorithm == "dqn" else 12, "learner"))
    assert trainer.version == 1
    assert all(w.data for w in trainer.weights())  # weights come back to the host for actors

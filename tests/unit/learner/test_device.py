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


SMALL = {  # one per algorithm, small enough to run in a second on either device
    "dqn": {"algorithm": "dqn", "env": {"id": "CartPole-v1", "num_envs": 2},
            "dqn": {"hidden_sizes": [16], "batch_size": 8, "learning_starts": 8}},
    "ppo": {"algorithm": "ppo", "env": {"id": "CartPole-v1", "num_envs": 2},
            "ppo": {"rollout_steps": 4, "batch_steps": 8, "num_epochs": 1, "num_minibatches": 2, "hidden_sizes": [16]}},
    "sac": {"algorithm": "sac", "env": {"id": "Pendulum-v1", "num_envs": 2},
            "sac": {"hidden_sizes": [16], "batch_size": 8, "learning_starts": 8}},
}


def _trainer(algorithm: str, device: str, directory) -> Trainer:
    return Trainer(config_from_dict({**SMALL[algorithm], "learner": {"device": device}}), Metrics("learner"), directory)


def _train_once(trainer: Trainer) -> None:
    rollout = Rollout(trainer.cfg, "device-actor", 0, Metrics("actor"))
    store = Store(trainer.cfg, Metrics("buffer"))
    try:
        for _ in range(4):
            store.insert(RawFragment(rollout.collect().payload))
    finally:
        rollout.close()
    before = trainer.version
    trainer.train(store.next_batch(8, "learner"))
    assert trainer.version == before + 1


@pytest.mark.parametrize("algorithm", ["dqn", "ppo", "sac"])
@pytest.mark.parametrize("written, read", [("cpu", "cpu"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_a_checkpoint_moves_between_cpu_and_cuda_and_training_goes_on(tmp_path, algorithm, written, read):
    """Checkpoints are read onto the host (map_location cpu); the learner that restores one must put the
    weights and the optimiser's moments on its own device, or its next step fails mixing devices."""
    if "cuda" in (written, read) and not torch.cuda.is_available():
        pytest.skip("no CUDA device: the GPU path runs where torch sees one")
    writer = _trainer(algorithm, written, tmp_path)
    _train_once(writer)
    assert writer.checkpoint() is not None
    saved = {k: v.detach().cpu().clone() for k, v in writer.algo.policy.state_dict().items()}

    reader = _trainer(algorithm, read, tmp_path)
    assert reader.version == 1
    assert next(reader.algo.policy.parameters()).device.type == read
    for key, value in reader.algo.policy.state_dict().items():
        assert torch.equal(value.cpu(), saved[key]), key
    _train_once(reader)   # the optimiser's state was moved to `read` with the weights
    for optimizer in (v for v in vars(reader.algo).values() if isinstance(v, torch.optim.Optimizer)):
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    assert value.device.type == read

"""A short Pong run through buffer, learner and actor over real gRPC: fragments, batches and weight
updates flow, with fragments and weights both above gRPC's default 4 MiB message limit. No learning
assertion (that would take hours on a CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from kuberl.v1 import actor_pb2_grpc, buffer_pb2_grpc, learner_pb2_grpc
from services.config import config_from_dict
from services.common.envs import spec_of
from services import algorithms
from tests.integration.test_pipeline import _stat_at_least, _stats, _until, stack

pytest.importorskip("ale_py", reason="ale-py is in the actor extra")

GRPC_DEFAULT_LIMIT = 4 * 1024 * 1024
N, T = 4, 40  # obs of one fragment: 41 x 4 x 4 x 84 x 84 bytes = 4.6 MB
PONG = {
    "env": {"id": "ALE/Pong-v5", "num_envs": N},
    "learner": {"checkpoint_interval_s": 3600},
    "actor": {"push_ack_interval_s": 0.2},
}
CONFIGS = {
    "ppo": {**PONG, "algorithm": "ppo", "ppo": {"rollout_steps": T, "batch_steps": T * N, "num_epochs": 1,
                                                "num_minibatches": 2}},
    # The LSTM core on the Nature CNN torso (CleanRL's ppo_atari_lstm.py): fragments carry each env's
    # state at their first step (extras.core_state) and the learner replays their sequences from it.
    "ppo-lstm": {**PONG, "algorithm": "ppo", "ppo": {"rollout_steps": T, "batch_steps": T * N, "num_epochs": 1,
                                                     "num_minibatches": 2, "recurrent": "lstm", "recurrent_size": 128}},
    "dqn": {**PONG, "algorithm": "dqn", "dqn": {"rollout_steps": T, "buffer_size": 1024, "batch_size": 32,
                                                "learning_starts": 320, "replay_ratio": 0.0}},
}


@pytest.mark.parametrize("name", ["ppo", "ppo-lstm", "dqn"])
async def test_pong_fragments_and_weights_above_4mib_flow_through_every_service(tmp_path, name):
    cfg = config_from_dict(CONFIGS[name])
    algorithm = cfg.algorithm
    assert cfg.buffer.max_message_mb * 2**20 > GRPC_DEFAULT_LIMIT
    spec = spec_of(cfg.env)
    fragment_obs_bytes = (T + 1) * N * int(np.prod(spec.obs_shape))
    weight_bytes = sum(p.numel() * 4 for p in algorithms.get(algorithm).acting(cfg, spec, None, None).net.parameters())
    assert fragment_obs_bytes > GRPC_DEFAULT_LIMIT and weight_bytes > GRPC_DEFAULT_LIMIT

    async with stack(cfg, tmp_path / "ckpt", actor_id="pong-actor") as (buffer, learner, actor):
        a = await _until(lambda: _stat_at_least(actor, actor_pb2_grpc.ActorStub, "actor/policy_version", 2), 180)
        b = await _stats(buffer, buffer_pb2_grpc.BufferStub)
        lrn = await _stats(learner, learner_pb2_grpc.LearnerStub)
    # Weights trained on this actor's fragments came back: version 2 needs two updates on served batches.
    assert a["actor/weights_swapped_total"] >= 2
    assert a["actor/bytes_pushed_total"] >= a["actor/fragments_pushed_total"] * fragment_obs_bytes > 0
    assert b["buffer/fragments_received_total"] >= 1 and b["buffer/samples_served_total"] > 0
    assert b["buffer/fragments_invalid_total"] == 0 and a["actor/fragments_dropped_total"] == 0
    assert lrn["learner/updates_total"] >= 2 and lrn["learner/batches_invalid_total"] == 0
    assert lrn["learner/weights_sent_total"] >= 2

"""A learner in a group (services/learner/distributed.py) must make the same collective calls as its
peers whatever data it holds: a fake group records the calls and plays the peers' weights."""

from __future__ import annotations

import numpy as np
import torch

from services.config import config_from_dict
from services.common.stats import Metrics
from services.learner.trainer import Trainer
from tests.unit.learner.test_trainer_staleness import batch_of, msg, ppo_config


class FakeGroup:
    """Rank 1 of 2; the peer contributes `peer_weight` samples with gradient `peer_grad` everywhere."""
    rank, world_size = 1, 2

    def __init__(self, peer_weight: float, peer_grad: float = 1.0):
        self.peer_weight, self.peer_grad = peer_weight, peer_grad
        self.calls: list[float] = []   # this rank's weight per gradient all-reduce

    def broadcast_state(self, state):
        return state if self.rank == 0 else self.state

    def sum(self, t):   # statistics summed over the group (reward normalisation): the peer adds none
        return t

    def average_gradients(self, params, weight):
        self.calls.append(weight)
        total = weight + self.peer_weight
        if total > 0:
            for p in params:
                mine = p.grad if p.grad is not None else torch.zeros_like(p)
                p.grad = (mine * weight + self.peer_grad * self.peer_weight) / total
        return total


def group_trainer(tmp_path, cfg, group: FakeGroup) -> Trainer:
    alone = Trainer(cfg, Metrics("learner"), tmp_path / "rank0")
    group.state = alone.algo.state_dict()
    return Trainer(cfg, Metrics("learner"), tmp_path / "rank1", sync=group)


def test_ppo_without_usable_fragments_still_joins_every_gradient_step_and_moves_with_the_group(tmp_path):
    cfg = ppo_config(num_epochs=2, num_minibatches=4)
    group = FakeGroup(peer_weight=4)
    trainer = group_trainer(tmp_path, cfg, group)
    trainer.train(batch_of(msg(0, 0), msg(1, 0)))
    assert trainer.version == 1
    assert len(group.calls) == 2 * 4 and all(w > 0 for w in group.calls)
    # every fragment too stale (lag 5 > max_policy_lag 1): skipped here, yet all 8 steps are joined with 0
    trainer.algo.version = 6
    group.calls.clear()
    before = [p.detach().clone() for p in trainer.algo.net.parameters()]
    trainer.train(batch_of(msg(2, 0)))
    assert group.calls == [0.0] * 8
    assert trainer.metrics.counters["learner/batches_skipped_total"] == 1
    assert trainer.version == 7, "the peer trained, so the group's version moved here too"
    after = list(trainer.algo.net.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(after, before)), "the peer's gradient was applied"


def test_ppo_in_a_group_takes_num_minibatches_steps_even_with_fewer_samples(tmp_path):
    cfg = ppo_config(num_epochs=1, num_minibatches=4)
    group = FakeGroup(peer_weight=0)
    trainer = group_trainer(tmp_path, cfg, group)
    trainer.train(batch_of(msg(0, 0, steps=1)))   # 2 samples, 4 minibatches: two of them empty
    assert group.calls == [1.0, 1.0, 0.0, 0.0] and trainer.version == 1


def test_dqn_malformed_batch_joins_the_step_with_nothing_and_no_data_anywhere_means_no_step(tmp_path):
    from kuberl.v1 import common_pb2 as pb
    cfg = config_from_dict({"algorithm": "dqn", "env": {"num_envs": 2},
                            "dqn": {"batch_size": 4, "learning_starts": 4, "buffer_size": 64, "hidden_sizes": [8]}})
    group = FakeGroup(peer_weight=0)
    trainer = group_trainer(tmp_path, cfg, group)
    bad = pb.TrainingBatch(batch_id=1, transitions=pb.TransitionBatch())
    trainer.train(bad)
    assert trainer.metrics.counters["learner/batches_invalid_total"] == 1
    assert group.calls == [0.0] and trainer.version == 0, "nobody had data: no step, no new version"
    group.peer_weight = 4
    trainer.train(bad)
    assert group.calls == [0.0, 0.0] and trainer.version == 1, "the peer's step is this learner's step too"


def test_sac_joins_both_rounds_of_an_update_with_nothing_and_steps_with_the_group(tmp_path):
    """SAC averages its critic's gradients, then its policy's and temperature's, in two rounds; a
    learner without a usable batch joins both with weight 0, and nobody having data means no step."""
    from kuberl.v1 import common_pb2 as pb
    cfg = config_from_dict({"algorithm": "sac", "env": {"id": "Pendulum-v1", "num_envs": 2},
                            "sac": {"batch_size": 4, "learning_starts": 4, "buffer_size": 64, "hidden_sizes": [8]}})
    group = FakeGroup(peer_weight=0)
    trainer = group_trainer(tmp_path, cfg, group)
    bad = pb.TrainingBatch(batch_id=1, transitions=pb.TransitionBatch())
    trainer.train(bad)
    assert group.calls == [0.0] and trainer.version == 0, "nobody had data: no critic step, no policy round"
    group.peer_weight = 4
    actor_before = [p.detach().clone() for p in trainer.algo.actor.parameters()]
    trainer.train(bad)
    assert group.calls == [0.0, 0.0, 0.0] and trainer.version == 1, "the peer's two rounds are this learner's too"
    assert any(not torch.equal(a, p) for a, p in zip(actor_before, trainer.algo.actor.parameters()))


def test_only_rank_0_writes_checkpoints_and_rank_1_starts_from_rank_0s_state(tmp_path):
    cfg = ppo_config()
    group = FakeGroup(peer_weight=0)
    trainer = group_trainer(tmp_path, cfg, group)
    assert trainer.checkpoint() is None
    assert not list((tmp_path / "rank1").glob("ckpt-*.pt"))
    ref = group.state["net"]
    assert all(np.array_equal(ref[k].numpy(), v.numpy()) for k, v in trainer.algo.net.state_dict().items())
    assert trainer.metrics.snapshot()["learner/group_size"] == 2 and trainer.metrics.snapshot()["learner/rank"] == 1


def test_an_update_the_group_broke_part_way_is_never_checkpointed(tmp_path):
    from services.learner.distributed import GroupBroken

    class Breaks(FakeGroup):
        rank = 0

        def average_gradients(self, params, weight):
            if self.calls:
                raise GroupBroken("all-reduce across 2 learners failed (a peer is gone?)")
            return super().average_gradients(params, weight)

    group = Breaks(peer_weight=4)
    trainer = Trainer(ppo_config(num_epochs=1, num_minibatches=2), Metrics("learner"), tmp_path / "ck", sync=group)
    assert trainer.checkpoint() is not None        # rank 0 writes while the group is whole
    try:
        trainer.train(batch_of(msg(0, 0), msg(1, 0)))   # the second of two steps fails
    except GroupBroken:
        pass
    else:
        raise AssertionError("the broken all-reduce must end the update")
    assert trainer.version == 0 and trainer.checkpoint() is None
    assert len(list((tmp_path / "ck").glob("ckpt-*.pt"))) == 1

"""ppo.anneal_updates / anneal_clip: the learning rate (and clip range) each update trains at falls
linearly to 0 over the configured updates, as SB3's "lin_" schedules and CleanRL's anneal_lr do, and a
resumed learner continues the schedule where its checkpoint left it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.algorithms.ppo.learner import PPO
from services.config import ConfigError, config_from_dict
from services.common.models.nets import EnvSpec
from services.common.protocol.spaces import Discrete
from tests.unit.fragment_factory import make_fragment

SPEC = EnvSpec((3,), np.dtype(np.float32), Discrete(2))


def ppo(**section) -> PPO:
    cfg = config_from_dict({"algorithm": "ppo", "ppo": {"hidden_sizes": [8], "num_epochs": 1, "num_minibatches": 1,
                                                         "learning_rate": 0.01, "clip_coef": 0.2, **section}})
    torch.manual_seed(0)
    return PPO(cfg.section("ppo"), SPEC)


def test_the_rate_each_update_trains_at_falls_linearly_to_zero_and_stays_there():
    learner = ppo(anneal_updates=4)
    seen = [learner.update([make_fragment(T=4, N=2)])["learning_rate"] for _ in range(6)]
    assert seen == pytest.approx([0.01, 0.0075, 0.005, 0.0025, 0.0, 0.0])
    assert learner.optimizer.param_groups[0]["lr"] == 0.0


def test_without_annealing_the_rate_is_constant():
    learner = ppo()
    assert [learner.update([make_fragment(T=4, N=2)])["learning_rate"] for _ in range(3)] == [0.01] * 3


def test_the_clip_range_anneals_only_when_asked(monkeypatch):
    for anneal_clip, want in ((False, [0.2, 0.2, 0.2]), (True, [0.2, 0.1, 0.0])):
        learner = ppo(anneal_updates=2, anneal_clip=anneal_clip)
        clips = []
        real = learner._loss
        monkeypatch.setattr(learner, "_loss", lambda data, mb, clip: clips.append(clip) or real(data, mb, clip))
        for _ in range(3):
            learner.update([make_fragment(T=4, N=2)])
        assert clips == pytest.approx(want), anneal_clip


def test_a_resumed_learner_continues_the_schedule():
    first = ppo(anneal_updates=4)
    for _ in range(2):
        first.update([make_fragment(T=4, N=2)])
    resumed = ppo(anneal_updates=4)
    resumed.load_state_dict(first.state_dict())
    assert resumed.remaining() == pytest.approx(0.5)
    assert resumed.update([make_fragment(T=4, N=2)])["learning_rate"] == pytest.approx(0.005)


@pytest.mark.parametrize("section, message", [
    ({"anneal_updates": 0}, "ppo.anneal_updates"),
    ({"anneal_clip": True}, "ppo.anneal_clip"),
])
def test_bad_annealing_settings_are_refused_naming_the_key(section, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"algorithm": "ppo", "ppo": section})

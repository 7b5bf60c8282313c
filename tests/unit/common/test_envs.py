"""services/common/envs.py and the Atari networks: preprocessing shapes and dtypes on both backends,
game-name mapping, clear errors, and the Nature CNN over uint8 frames."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.config import AtariConfig, ConfigError, EnvConfig
from services.config import config_from_dict
from services.common.envs import atari_game, make_vector_env, spec_of
from services.algorithms.ppo.networks import ActorCritic
from services.algorithms.dqn.networks import QNetwork
from services.common.models.nets import NatureCNN

pytest.importorskip("ale_py", reason="ale-py is in the actor extra")


@pytest.mark.parametrize("backend", ["ale_vector", "gymnasium"])
def test_atari_preprocessing_gives_stacked_84x84_uint8_frames_and_final_obs(backend):
    cfg = EnvConfig(id="ALE/Pong-v5", num_envs=2, max_episode_steps=30, atari=AtariConfig(backend=backend))
    env = make_vector_env(cfg)
    try:
        obs, _ = env.reset(seed=1)
        assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8
        assert env.single_action_space.n == 6
        ended = None
        for _ in range(40):
            obs, reward, term, trunc, info = env.step(np.zeros(2, dtype=np.int64))
            assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8
            assert reward.shape == (2,) and term.dtype == np.bool_ and trunc.dtype == np.bool_
            if (term | trunc).any():
                ended = info
                break
        assert ended is not None, "max_episode_steps=30 should have cut the episode within 40 steps"
        i = int(np.flatnonzero(term | trunc)[0])
        final = np.asarray(ended["final_obs"][i])
        assert final.shape == (4, 84, 84) and final.dtype == np.uint8
        assert final.any(), "the final frame stack of an ended episode is a real frame, not zeros"
    finally:
        env.close()


def test_frame_stack_shifts_by_one_frame_per_step():
    env = make_vector_env(EnvConfig(id="ALE/Pong-v5", num_envs=1))
    try:
        env.reset(seed=0)
        prev = None
        for _ in range(30):  # past the start, where frames change
            obs, *_ = env.step(np.array([2]))
            if prev is not None:
                np.testing.assert_array_equal(obs[0, :-1], prev[0, 1:])  # oldest dropped, newest appended
            prev = obs
    finally:
        env.close()


def test_spec_and_settings():
    cfg = EnvConfig(id="ALE/Breakout-v5", atari=AtariConfig(frame_stack=2, screen_size=64))
    spec = spec_of(cfg)
    assert spec.obs_shape == (2, 64, 64) and spec.obs_dtype == np.uint8 and spec.num_actions == 4


def test_game_names_and_errors():
    assert atari_game("ALE/Pong-v5") == "pong"
    assert atari_game("ALE/SpaceInvaders-v5") == "space_invaders"
    with pytest.raises(ValueError, match=r"env.id: 'ALE/NoSuchGame-v5' is not an Atari game"):
        make_vector_env(EnvConfig(id="ALE/NoSuchGame-v5"))
    with pytest.raises(ConfigError, match=r"^env.id: 'ALE/Pong-v4' is invalid: Atari ids are ALE/<Game>-v5"):
        config_from_dict({"env": {"id": "ALE/Pong-v4"}})
    with pytest.raises(ConfigError, match=r"^env.atari.backend: 'envpool' is invalid"):
        config_from_dict({"env": {"id": "ALE/Pong-v5", "atari": {"backend": "envpool"}}})
    with pytest.raises(ConfigError, match=r"^env.atari.frame_stack: 0 is invalid"):
        config_from_dict({"env": {"atari": {"frame_stack": 0}}})


def test_nature_cnn_takes_uint8_frames_and_scales_them_inside():
    spec = spec_of(EnvConfig(id="ALE/Pong-v5"))
    frames = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    torso = NatureCNN(spec)
    expected = torso.fc(torso.convs(frames.to(torch.float32) / 255.0))
    torch.testing.assert_close(torso(frames), expected)
    q = QNetwork(spec, (64,))
    assert q(frames).shape == (3, 6)
    ac = ActorCritic(spec, (64,))
    dist, value = ac.dist_and_value(frames)
    assert dist.logits.shape == (3, 6) and value.shape == (3,)
    torch.testing.assert_close(value, ac.value(frames))
    # The Nature architecture: 3 conv layers to 3136 features, then 512.
    assert torso.fc[0].in_features == 64 * 7 * 7 and torso.features == 512


class _DictObs:
    """A Dict-of-Box observation env, made on demand (gymnasium registers ids process-wide)."""

    @staticmethod
    def register() -> str:
        import gymnasium as gym
        from gymnasium import spaces

        class DictEnv(gym.Env):
            observation_space = spaces.Dict({"b": spaces.Box(0, 1, (2,), np.float32),
                                             "a": spaces.Box(0, 255, (1,), np.uint8)})
            action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)

            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                return {"a": np.array([7], np.uint8), "b": np.array([0.5, 0.25], np.float32)}, {}

            def step(self, action):
                return self.reset()[0], 1.0, False, False, {}

        if "kuberl-test/DictObs-v0" not in gym.registry:
            gym.register("kuberl-test/DictObs-v0", entry_point=DictEnv)
        return "kuberl-test/DictObs-v0"


def test_dict_observations_are_flattened_to_float32_in_sorted_key_order():
    from services.common.protocol.spaces import Box

    cfg = config_from_dict({"env": {"id": _DictObs.register(), "num_envs": 2}})
    spec = spec_of(cfg.env)
    assert spec.obs_shape == (3,) and spec.obs_dtype == np.float32 and spec.action == Box.of((2,), -1.0, 1.0)
    envs = make_vector_env(cfg.env)
    obs, _ = envs.reset(seed=0)
    np.testing.assert_array_equal(obs, [[7.0, 0.5, 0.25]] * 2)  # "a" before "b"
    assert obs.dtype == np.float32
    envs.close()

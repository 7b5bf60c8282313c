"""Small gymnasium tasks that show what a space or a feature of kuberl does, registered on import.

Use them by id with the module prefix gymnasium understands, e.g. `env.id: "kuberl_envs:MaskedChoice-v0"`.

- `MaskedChoice-v0`: MultiDiscrete actions with action masks (see MaskedChoice).
- `CartPoleNoVelocity-v1`: CartPole-v1 with the velocities hidden, a task that needs memory (see
  NoVelocity).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces

__all__ = ["MaskedChoice", "NoVelocity"]


class MaskedChoice(gym.Env):
    """Two simultaneous choices (MultiDiscrete [4, 3]) under action masks.

    Each step shows a target value for each choice (one-hot, observation float32 [7]) and allows,
    in `info["action_mask"]` (bool [7], the two choices' columns side by side), the target and each
    other value with probability 1/2. A choice equal to its target earns 0.5; any disallowed value
    ends the episode with reward -5. Episodes last 16 steps, so the best return is 16.

    Why it proves learning: a uniform policy over the allowed values scores about 7 per episode
    (it picks the target of a choice about half the time), so a mean return of 15 means the policy
    reads the targets; and a single disallowed action would cost at least 5 plus the rest of the
    episode, so such a return also means the masks were applied at every step.
    """

    NVEC = (4, 3)
    LENGTH = 16

    def __init__(self):
        self.action_space = spaces.MultiDiscrete(self.NVEC)
        self.observation_space = spaces.Box(0.0, 1.0, (sum(self.NVEC),), np.float32)
        self._t = 0
        self._target = np.zeros(len(self.NVEC), np.int64)
        self._mask = np.ones(sum(self.NVEC), bool)

    def _draw(self) -> tuple[np.ndarray, dict]:
        self._target = np.array([self.np_random.integers(n) for n in self.NVEC])
        obs = np.zeros(sum(self.NVEC), np.float32)
        self._mask = self.np_random.random(sum(self.NVEC)) < 0.5
        start = 0
        for n, target in zip(self.NVEC, self._target):
            obs[start + target] = 1.0
            self._mask[start + target] = True
            start += n
        return obs, {"action_mask": self._mask.copy()}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return self._draw()

    def step(self, action):
        action = np.asarray(action, np.int64)
        offsets = np.concatenate([[0], np.cumsum(self.NVEC)[:-1]])
        if not self._mask[offsets + action].all():
            obs, info = self._draw()
            return obs, -5.0, True, False, info
        reward = 0.5 * float((action == self._target).sum())
        self._t += 1
        obs, info = self._draw()
        return obs, reward, False, self._t >= self.LENGTH, info


gym.register("MaskedChoice-v0", entry_point=MaskedChoice)


class NoVelocity(gym.ObservationWrapper):
    """CartPole-v1 observed through its positions only: the cart's position and the pole's angle
    (float32 [2]), with the two velocities hidden (sb3-contrib's CartPoleNoVel, POPGym's stateless
    CartPole). Rewards, ends and the 500-step limit are CartPole-v1's.

    Why it needs memory: balancing needs the pole's angular velocity, which one observation does not
    hold; a feed-forward policy can only react to the angle, while a recurrent one can difference
    successive angles. docs/recurrent.md gives what each reaches here.
    """

    KEEP = (0, 2)   # x, theta of CartPole's [x, x_dot, theta, theta_dot]

    def __init__(self, env: gym.Env):
        super().__init__(env)
        box = env.observation_space
        assert isinstance(box, spaces.Box)
        self.observation_space = spaces.Box(box.low[list(self.KEEP)], box.high[list(self.KEEP)], dtype=np.float32)

    def observation(self, observation):
        return np.asarray(observation, np.float32)[list(self.KEEP)]


def _cartpole_no_velocity(**kwargs) -> gym.Env:
    return NoVelocity(gym.make("CartPole-v1", **kwargs).unwrapped)


gym.register("CartPoleNoVelocity-v1", entry_point=_cartpole_no_velocity, max_episode_steps=500, reward_threshold=475.0)

"""services/actor/finite.py: a local env's step holding NaN or infinity (or, with actor.check_obs_bounds,
an observation outside its space's bounds) never reaches a fragment: the actor stops with an error
naming env.id, the field and the env index, counted (as SB3's VecCheckNan raises)."""

from __future__ import annotations

import numpy as np
import pytest

from services.actor.finite import BadEnvStep, Check
from services.actor.rollout import Rollout
from services.config import config_from_dict
from services.common.protocol.fragments import RawFragment, decode_fragment
from services.common.models.nets import to_numpy
from services.common.stats import Metrics

T, N = 4, 2


class _Poisoned:
    """An env with a Box[3] observation in [-1, 1] whose odd-seeded copy (env 1 of a vector env reset
    with an even seed) returns `value` at step `at` in `where`: "obs", "reward", "final_obs" (the step
    ends the episode with that observation) or "reset" (its reset observation). Made on demand:
    gymnasium registers ids process-wide."""

    @staticmethod
    def register(where: str, value: float, at: int = 3) -> str:
        import gymnasium as gym

        class PoisonedEnv(gym.Env):
            observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
            action_space = gym.spaces.Discrete(2)

            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                self.poisoned = self.poisoned if seed is None else seed % 2 == 1
                self.t = 0
                return self._obs(where == "reset"), {}

            def _obs(self, bad: bool) -> np.ndarray:
                obs = np.full(3, 0.5, np.float32)
                if bad and self.poisoned:
                    obs[1] = value
                return obs

            def step(self, action):
                self.t += 1
                now = self.t == at
                reward = value if now and where == "reward" and self.poisoned else 1.0
                ended = now and where == "final_obs" and self.poisoned
                return self._obs(now and where in ("obs", "final_obs")), reward, ended, False, {}

        name = f"kuberl-test/Poisoned-{where}-{str(value).replace('.', 'p')}-{at}-v0"
        if name not in gym.registry:
            gym.register(name, entry_point=PoisonedEnv, disable_env_checker=True)  # (its checker warns at a bad reset)
        return name


def rollout(env_id: str, **actor) -> Rollout:
    cfg = config_from_dict({"algorithm": "ppo", "env": {"id": env_id, "num_envs": N},
                            "ppo": {"rollout_steps": T, "batch_steps": 8, "hidden_sizes": [8]}, "actor": actor})
    r = Rollout(cfg, "actor-f", 0, Metrics("actor"))
    r.policy.offer_weights(1, to_numpy(r.policy.net))
    return r


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("where, named", [("obs", "observations[1] of env 1"), ("reward", "rewards of env 1"),
                                          ("final_obs", "info['final_obs'][1] of env 1"),
                                          ("reset", "observations[1] of env 1")])
def test_a_local_env_step_holding_nan_or_infinity_stops_the_actor_naming_the_env(where, named, value):
    r = rollout(_Poisoned.register(where, value, at=T + 2))
    try:
        if where != "reset":
            frag = decode_fragment(RawFragment(r.collect().payload))  # the first T steps are fine
            assert frag.num_steps == T and np.isfinite(frag.obs).all()
        with pytest.raises(BadEnvStep) as err:
            r.collect()
        env_id = r.cfg.env.id
        assert str(err.value) == (f"env.id: {env_id} returned {named} is {float(value)} (NaN and infinity are "
                                  f"refused); the actor stops rather than record it (docs/reliability.md, "
                                  f"non-finite data)")
        assert r.metrics.counters["actor/steps_refused_nonfinite_total"] == 1
        assert r.seq == (0 if where == "reset" else 1)  # nothing more was cut
    finally:
        r.close()


@pytest.mark.parametrize("check", [False, True], ids=["bounds-off", "bounds-on"])
def test_observations_outside_the_envs_bounds_stop_the_actor_only_when_asked(check):
    r = rollout(_Poisoned.register("obs", 2.0, at=2), check_obs_bounds=check)
    try:
        if not check:
            frag = decode_fragment(RawFragment(r.collect().payload))
            assert frag.obs[2, 1, 1] == 2.0 and r.metrics.counters["actor/steps_refused_out_of_bounds_total"] == 0
            return
        with pytest.raises(BadEnvStep) as err:
            r.collect()
        assert "returned observations[1] of env 1 is 2, outside its declared bounds [-1, 1]" in str(err.value)
        assert r.metrics.counters["actor/steps_refused_out_of_bounds_total"] == 1 and r.seq == 0
    finally:
        r.close()


def test_bounds_that_can_never_fail_are_not_checked():
    u8 = np.dtype(np.uint8)
    assert Check.of(None, np.zeros(4), np.full(4, 255.0), u8).low is None              # Atari frames
    assert Check.of(None, np.zeros(4), np.full(4, 200.0), u8).low is not None
    assert Check.of(None, np.full(2, -np.inf), np.full(2, np.inf), np.dtype(np.float32)).low is None
    frames = np.full((2, 4), 255, np.uint8)
    assert Check.of(None, np.zeros(4), np.full(4, 200.0), u8).find(frames).env == 0
    assert Check().find(frames) is None  # integers hold no NaN

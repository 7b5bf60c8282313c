"""ppo.normalize_rewards (services/algorithms/ppo/learner.py, RewardNormalizer): the running discounted
return per env across fragments against a plain loop, the statistics, the scaled rewards the advantages
use, and the statistics through a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.algorithms.ppo.learner import PPO
from services.algorithms.ppo.config import PPOConfig
from services.config import ConfigError, config_from_dict
from services.common.protocol.fragments import build_fragment, decode_fragment
from services.common.models.nets import EnvSpec
from services.common.protocol.spaces import Discrete
from tests.unit.fragment_factory import PPO as PPO_CODE
from tests.unit.fragment_factory import fragment_arrays

SPEC = EnvSpec(obs_shape=(3,), obs_dtype=np.float32, action=Discrete(2))
GAMMA = 0.9


def fragments(seed: int, count: int = 4, T: int = 5, N: int = 2, actor: str = "a"):
    """`count` consecutive fragments of one actor's N envs, random rewards and episode ends."""
    rng = np.random.default_rng(seed)
    out = []
    for seq in range(count):
        ends = rng.random((T, N)) < 0.25
        arrays = fragment_arrays(T, N, (3,), terminated=list(zip(*np.nonzero(ends))))
        arrays["rewards"] = (rng.normal(size=(T, N)) * 7 + 3).astype(np.float32)
        out.append(decode_fragment(build_fragment(actor_id=actor, seq=seq, policy_version=0, algorithm=PPO_CODE,
                                                  env_ids=range(N), incarnation=1, **arrays)))
    return out


def naive_returns(frags) -> np.ndarray:
    """Each env's discounted return at every step, carried from fragment to fragment, reset after an end."""
    N = frags[0].num_envs
    ret, out = [0.0] * N, []
    for f in frags:
        for t in range(f.num_steps):
            for e in range(N):
                ret[e] = ret[e] * GAMMA + float(f.rewards[t, e])
                out.append(ret[e])
                if f.terminated[t, e] or f.truncated[t, e]:
                    ret[e] = 0.0
    return np.array(out)


def learner(**kw) -> PPO:
    return PPO(PPOConfig(gamma=GAMMA, normalize_rewards=True, num_epochs=1, num_minibatches=1, **kw), SPEC)


def test_running_returns_carry_across_fragments_and_give_the_statistics():
    ppo, frags = learner(), fragments(0)
    for f in frags:   # one fragment a batch: the running returns carry over between updates
        ppo.update([f])
    want = naive_returns(frags)
    assert float(ppo.rewards.stats.count) == len(want)
    np.testing.assert_allclose(float(ppo.rewards.stats.mean), want.mean(), rtol=1e-9)
    np.testing.assert_allclose(float(ppo.rewards.stats.var), want.var(), rtol=1e-9)


def test_two_actors_envs_keep_their_own_returns():
    ppo = learner()
    a, b = fragments(1, actor="a"), fragments(2, actor="b")
    for fa, fb in zip(a, b):   # interleaved in one batch each
        ppo.update([fa, fb])
    both = np.concatenate([naive_returns(a), naive_returns(b)])
    np.testing.assert_allclose(float(ppo.rewards.stats.var), both.var(), rtol=1e-9)


def test_the_advantages_use_rewards_divided_by_the_return_std_and_clipped():
    frag = fragments(3, count=1)[0]
    ppo = learner(reward_clip=0.5)
    ppo.update([frag])
    std = float((ppo.rewards.stats.var + ppo.rewards.stats.eps).sqrt())
    plain = PPO(PPOConfig(gamma=GAMMA, num_epochs=1, num_minibatches=1, normalize_rewards=False), SPEC)
    plain.net.load_state_dict(ppo.net.state_dict())
    scaled = decode_fragment(build_fragment(
        actor_id="a", seq=0, policy_version=0, algorithm=PPO_CODE, env_ids=range(frag.num_envs), incarnation=1,
        obs=frag.obs, actions=frag.actions, rewards=np.clip(frag.rewards / std, -0.5, 0.5).astype(np.float32),
        terminated=frag.terminated, truncated=frag.truncated, final_obs=frag.final_obs,
        final_index=frag.final_index, extras=frag.extras))
    for got, want in zip(ppo._advantages(frag, False), plain._advantages(scaled, False)):
        torch.testing.assert_close(got, want)
    assert np.abs(frag.rewards / std).max() > 0.5   # the clip mattered


def test_the_statistics_go_through_a_checkpoint_and_can_be_turned_off():
    ppo = learner()
    ppo.update(fragments(4))
    again = learner()
    again.load_state_dict(ppo.state_dict())
    for key in ("mean", "var", "count"):
        assert torch.equal(getattr(again.rewards.stats, key), getattr(ppo.rewards.stats, key))
    assert PPO(PPOConfig(), SPEC).rewards is not None   # on by default
    off = PPO(PPOConfig(normalize_rewards=False), SPEC)
    assert off.rewards is None and "reward_stats" not in off.state_dict()
    with pytest.raises(ConfigError, match="reward_clip"):
        config_from_dict({"ppo": {"reward_clip": 0}})

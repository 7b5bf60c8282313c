"""services/algorithms/dqn/learner.py td_target and services/algorithms/ppo/learner.py gae against naive loops, plus
one-step smoke tests of DQN.update and PPO.update."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from services.common.config import DQNConfig, PPOConfig
from services.common.nets import EnvSpec
from services.common.spaces import Discrete
from services.algorithms.dqn.learner import DQN, td_target
from services.algorithms.ppo.learner import PPO, gae
from tests.unit.fragment_factory import make_fragment
from tests.unit.fragment_factory import transition_batch as wire_transitions

SPEC = EnvSpec(obs_shape=(4,), obs_dtype=np.float32, action=Discrete(2))


# --- td_target ----------------------------------------------------------------------------------

# Row 0 and 1: the online argmax differs from the target argmax. Row 2 is terminated.
Q_ONLINE = torch.tensor([[1.0, 5.0, 2.0], [3.0, 0.0, 1.0], [0.0, 1.0, 2.0]])
Q_TARGET = torch.tensor([[4.0, 1.0, 0.0], [2.0, 7.0, 1.0], [1.0, 1.0, 9.0]])
REWARDS = torch.tensor([0.5, -1.0, 2.0])
TERMINATED = torch.tensor([False, False, True])


def naive_td_target(rewards, terminated, q_online, q_target, gamma, double):
    out = []
    for i in range(len(rewards)):
        chooser = (q_online if double else q_target)[i].tolist()
        a = chooser.index(max(chooser))
        bootstrap = 0.0 if terminated[i] else gamma * q_target[i, a].item()
        out.append(rewards[i].item() + bootstrap)
    return torch.tensor(out)


@pytest.mark.parametrize("double,expected", [
    (True, [0.5 + 0.9 * 1.0, -1.0 + 0.9 * 2.0, 2.0]),   # Q_target at the online argmax (1, 0)
    (False, [0.5 + 0.9 * 4.0, -1.0 + 0.9 * 7.0, 2.0]),  # max of Q_target
])
def test_td_target(double, expected):
    y = td_target(REWARDS, TERMINATED, Q_ONLINE, Q_TARGET, gamma=0.9, double=double)
    torch.testing.assert_close(y, torch.tensor(expected))
    torch.testing.assert_close(y, naive_td_target(REWARDS, TERMINATED, Q_ONLINE, Q_TARGET, 0.9, double))


def test_td_target_double_and_plain_differ_on_these_q_values():
    double = td_target(REWARDS, TERMINATED, Q_ONLINE, Q_TARGET, gamma=0.9, double=True)
    plain = td_target(REWARDS, TERMINATED, Q_ONLINE, Q_TARGET, gamma=0.9, double=False)
    assert (double[:2] != plain[:2]).all()
    assert double[2] == plain[2] == REWARDS[2]


def test_td_target_random_against_naive_loop():
    g = torch.Generator().manual_seed(0)
    B, A = 16, 4
    rewards = torch.randn(B, generator=g)
    terminated = torch.rand(B, generator=g) < 0.3
    q_online, q_target = torch.randn(B, A, generator=g), torch.randn(B, A, generator=g)
    for double in (True, False):
        torch.testing.assert_close(td_target(rewards, terminated, q_online, q_target, 0.97, double),
                                   naive_td_target(rewards, terminated, q_online, q_target, 0.97, double))


# --- gae ----------------------------------------------------------------------------------------

def naive_gae(rewards, values, next_values, terminated, dones, gamma, lam):
    T, N = rewards.shape
    adv = [[0.0] * N for _ in range(T)]
    for n in range(N):
        a_next = 0.0
        for t in reversed(range(T)):
            term = float(terminated[t, n])
            done = float(dones[t, n])
            delta = rewards[t, n].item() + gamma * next_values[t, n].item() * (1 - term) - values[t, n].item()
            a_next = delta + gamma * lam * (1 - done) * a_next
            adv[t][n] = a_next
    adv = torch.tensor(adv)
    return adv, adv + values


def test_gae_against_naive_loop():
    g = torch.Generator().manual_seed(1)
    T, N = 7, 3
    rewards, values, next_values = (torch.randn(T, N, generator=g) for _ in range(3))
    terminated = torch.zeros(T, N, dtype=torch.bool)
    truncated = torch.zeros(T, N, dtype=torch.bool)
    terminated[2, 0] = terminated[5, 1] = terminated[6, 2] = True
    truncated[3, 2] = truncated[4, 0] = True
    dones = terminated | truncated
    adv, ret = gae(rewards, values, next_values, terminated, dones, gamma=0.97, lam=0.9)
    want_adv, want_ret = naive_gae(rewards, values, next_values, terminated, dones, 0.97, 0.9)
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)
    # a truncated step bootstraps from next_values but does not chain the advantage
    torch.testing.assert_close(adv[4, 0], rewards[4, 0] + 0.97 * next_values[4, 0] - values[4, 0])
    # a terminated step neither bootstraps nor chains
    torch.testing.assert_close(adv[2, 0], rewards[2, 0] - values[2, 0])


def test_gae_lambda_one_no_dones_is_discounted_return_minus_value():
    T = 5
    rewards = torch.ones(T, 1)
    values = torch.zeros(T, 1)
    next_values = torch.zeros(T, 1)
    next_values[-1] = 10.0
    no = torch.zeros(T, 1, dtype=torch.bool)
    adv, ret = gae(rewards, values, next_values, no, no, gamma=0.5, lam=1.0)
    expected = [sum(0.5 ** k for k in range(T - t)) + 0.5 ** (T - t) * 10.0 for t in range(T)]
    torch.testing.assert_close(ret[:, 0], torch.tensor(expected))


# --- DQN.update ---------------------------------------------------------------------------------

def dqn_cfg(**kw) -> DQNConfig:
    return DQNConfig(**{"hidden_sizes": (8,), "batch_size": 4, "learning_starts": 4, "buffer_size": 16, **kw})


def transition_batch(B: int = 6, seed: int = 0) -> dict[str, np.ndarray]:
    return wire_transitions(lambda rng, n: rng.integers(0, 2, n).astype(np.int64), 4, B, seed)


def params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("double", [True, False])
def test_dqn_update_smoke(double):
    torch.manual_seed(0)
    dqn = DQN(dqn_cfg(double_dqn=double, target_update_interval=100), SPEC)
    before = params(dqn.q)
    stats = dqn.update(transition_batch())
    assert dqn.version == 1
    assert set(stats) == {"loss", "q_mean", "grad_norm"}
    assert all(math.isfinite(v) for v in stats.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, dqn.q.parameters()))
    # no sync yet: the target still holds the initial weights
    assert all(torch.equal(a, b) for a, b in zip(before, dqn.target.parameters()))


def test_dqn_hard_target_sync_every_update():
    torch.manual_seed(0)
    dqn = DQN(dqn_cfg(target_update_interval=1, tau=1.0), SPEC)
    for i in range(2):
        dqn.update(transition_batch(seed=i))
        assert dqn.version == i + 1
        assert all(torch.equal(t, q) for t, q in zip(dqn.target.parameters(), dqn.q.parameters()))


def test_dqn_soft_target_update():
    torch.manual_seed(0)
    dqn = DQN(dqn_cfg(target_update_interval=1, tau=0.25), SPEC)
    old_target = params(dqn.target)
    dqn.update(transition_batch())
    for t, old, q in zip(dqn.target.parameters(), old_target, dqn.q.parameters()):
        torch.testing.assert_close(t.detach(), old + 0.25 * (q.detach() - old))


def test_dqn_target_syncs_only_on_interval():
    torch.manual_seed(0)
    dqn = DQN(dqn_cfg(target_update_interval=2, tau=1.0), SPEC)
    initial = params(dqn.target)
    dqn.update(transition_batch(seed=0))
    assert all(torch.equal(a, b) for a, b in zip(initial, dqn.target.parameters()))
    dqn.update(transition_batch(seed=1))
    assert all(torch.equal(t, q) for t, q in zip(dqn.target.parameters(), dqn.q.parameters()))


def test_dqn_state_dict_round_trip():
    torch.manual_seed(0)
    a = DQN(dqn_cfg(), SPEC)
    a.update(transition_batch())
    b = DQN(dqn_cfg(), SPEC)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert b.version == 1
    assert all(torch.equal(x, y) for x, y in zip(a.q.parameters(), b.q.parameters()))


# --- PPO.update ---------------------------------------------------------------------------------

def ppo_fragments(T: int, N: int, count: int = 1):
    return [make_fragment(T, N, obs_shape=(4,), seq=i, base=i * 100,
                          terminated=[(1, 0)], truncated=[(T - 1, N - 1)]) for i in range(count)]


def test_ppo_update_smoke():
    torch.manual_seed(0)
    cfg = PPOConfig(num_epochs=3, num_minibatches=2, batch_steps=16, hidden_sizes=(8,))
    ppo = PPO(cfg, SPEC)
    before = params(ppo.net)
    stats = ppo.update(ppo_fragments(T=4, N=2, count=2))  # 16 samples
    assert ppo.version == 1 and ppo.gradient_steps == 3 * 2
    assert set(stats) == {"policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "learning_rate", "return_std"}
    assert all(math.isfinite(v) for v in stats.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, ppo.net.parameters()))


def test_ppo_version_counts_across_updates():
    torch.manual_seed(0)
    ppo = PPO(PPOConfig(num_epochs=2, num_minibatches=4, batch_steps=8, hidden_sizes=(8,)), SPEC)
    ppo.update(ppo_fragments(T=4, N=2))
    ppo.update(ppo_fragments(T=4, N=2))
    assert ppo.version == 2 and ppo.gradient_steps == 2 * (2 * 4)


def test_ppo_runs_num_minibatches_per_epoch_when_samples_do_not_divide():
    torch.manual_seed(0)
    ppo = PPO(PPOConfig(num_epochs=1, num_minibatches=4, batch_steps=8, hidden_sizes=(8,)), SPEC)
    ppo.update(ppo_fragments(T=5, N=2))  # 10 samples
    assert ppo.gradient_steps == 4

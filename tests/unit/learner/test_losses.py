"""services/algorithms/dqn/learner.py td_target and services/algorithms/ppo/learner.py gae against naive loops,
one-step smoke tests of DQN.update and PPO.update, PPO._loss against a hand computation, and the bootstrap
at truncations in PPO._advantages against a naive per-step loop."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from services.algorithms.dqn.config import DQNConfig
from services.algorithms.ppo.config import PPOConfig
from services.common.models.nets import EnvSpec
from services.common.protocol.spaces import Discrete
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


# --- PPO._loss against a hand computation ---------------------------------------------------------

# Six samples of a Discrete(3) policy; the minibatch takes four of them. The network's outputs are
# fixed numbers (LOGITS, NEW_VALUES: what `dist_and_value` returns for sample i), so `_loss` is checked
# on its own. Chosen so that, with clip 0.2 and normalised advantages, sample 4 has its ratio (3.1)
# clipped (advantage > 0), sample 0 a ratio of 2.0 that is not (advantage < 0: the pessimistic term
# is the unclipped one), sample 3 a ratio of 0.51 clipped from below (advantage < 0), sample 1 a ratio
# inside the band; and the clipped value loss is the larger one for sample 3, the plain one for 4 and 1.
LOGITS = [[0.2, -0.4, 1.1], [1.5, 0.3, -0.8], [-0.6, 0.9, 0.1], [0.0, 2.0, -1.0], [0.7, 0.7, -0.3],
          [1.2, -1.5, 0.4]]
ACTIONS = [2, 0, 1, 0, 0, 2]
OLD_LOGPROB = [-1.2, -0.3, -1.5, -1.5, -2.0, -0.9]
ADVANTAGES = [0.5, 1.0, -2.0, -0.7, 1.8, 0.3]
NEW_VALUES = [0.3, 1.4, -0.2, 0.9, 0.5, 2.0]
OLD_VALUES = [0.1, 0.9, 0.2, 0.5, 0.0, 1.0]
RETURNS = [0.8, 0.5, 0.4, 1.6, -0.3, 2.2]
MINIBATCH = [4, 0, 3, 1]
CLIP = 0.2


def hand_ppo_loss(norm_adv: bool, clip_vloss: bool, ent_coef: float, vf_coef: float,
                  weights: list[float] | None = None) -> dict[str, float]:
    """The clipped PPO objective (Schulman et al. 2017, eq. 7 and 9; CleanRL's ppo.py), one sample at a
    time in Python floats; with `weights`, each sample's policy term times its weight (the decoupled
    objective of Hilton et al. 2021, OLD_LOGPROB then being the proximal policy's)."""
    mb = MINIBATCH
    n = len(mb)
    # log pi(a|s) of a softmax over the logits: logit[a] - log(sum_b exp(logit[b]))
    logprob, entropy = {}, {}
    for i in mb:
        log_z = math.log(sum(math.exp(x) for x in LOGITS[i]))
        logp = [x - log_z for x in LOGITS[i]]
        logprob[i] = logp[ACTIONS[i]]
        entropy[i] = -sum(math.exp(lp) * lp for lp in logp)
    logratio = {i: logprob[i] - OLD_LOGPROB[i] for i in mb}
    ratio = {i: math.exp(logratio[i]) for i in mb}
    # advantages normalised over the minibatch (unbiased std, + 1e-8)
    adv = {i: ADVANTAGES[i] for i in mb}
    if norm_adv:
        mean = sum(adv.values()) / n
        std = math.sqrt(sum((a - mean) ** 2 for a in adv.values()) / (n - 1))
        adv = {i: (a - mean) / (std + 1e-8) for i, a in adv.items()}
    policy_loss = 0.0
    for i in mb:
        clipped_ratio = min(max(ratio[i], 1 - CLIP), 1 + CLIP)
        policy_loss += (1.0 if weights is None else weights[i]) * max(-adv[i] * ratio[i], -adv[i] * clipped_ratio) / n
    value_loss = 0.0
    for i in mb:
        plain = (NEW_VALUES[i] - RETURNS[i]) ** 2
        if clip_vloss:
            step = min(max(NEW_VALUES[i] - OLD_VALUES[i], -CLIP), CLIP)
            plain = max(plain, (OLD_VALUES[i] + step - RETURNS[i]) ** 2)
        value_loss += 0.5 * plain / n
    mean_entropy = sum(entropy.values()) / n
    return {"loss": policy_loss - ent_coef * mean_entropy + vf_coef * value_loss,
            "policy_loss": policy_loss, "value_loss": value_loss, "entropy": mean_entropy,
            "approx_kl": sum((ratio[i] - 1) - logratio[i] for i in mb) / n,
            "clipfrac": sum(abs(ratio[i] - 1) > CLIP for i in mb) / n}


def test_the_hand_computed_minibatch_covers_each_branch_of_the_clipped_loss():
    """The numbers above reach every case the clipping distinguishes (checked by hand, not by `_loss`)."""
    logp = {i: LOGITS[i][ACTIONS[i]] - math.log(sum(math.exp(x) for x in LOGITS[i])) for i in MINIBATCH}
    ratio = {i: math.exp(logp[i] - OLD_LOGPROB[i]) for i in MINIBATCH}
    mean = sum(ADVANTAGES[i] for i in MINIBATCH) / len(MINIBATCH)
    assert ratio[4] > 1 + CLIP and ADVANTAGES[4] > mean    # clipped from above
    assert ratio[0] > 1 + CLIP and ADVANTAGES[0] < mean    # unclipped: the pessimistic term
    assert ratio[3] < 1 - CLIP and ADVANTAGES[3] < mean    # clipped from below
    assert 1 - CLIP < ratio[1] < 1 + CLIP
    assert abs(NEW_VALUES[3] - OLD_VALUES[3]) > CLIP and abs(NEW_VALUES[4] - OLD_VALUES[4]) > CLIP


WEIGHTS = [0.9, 1.0, 0.3, 0.6, 1.0, 0.75]   # truncated pi_prox / mu (ppo.decoupled)


@pytest.mark.parametrize("norm_adv, clip_vloss, ent_coef, weights", [
    (True, True, 0.01, None), (False, False, 0.0, None), (True, False, 0.05, None), (False, True, 0.01, None),
    (True, False, 0.0, WEIGHTS), (False, True, 0.01, WEIGHTS)])
def test_ppo_loss_against_a_hand_computation(monkeypatch, norm_adv, clip_vloss, ent_coef, weights):
    cfg = PPOConfig(hidden_sizes=(8,), norm_adv=norm_adv, clip_vloss=clip_vloss, ent_coef=ent_coef, vf_coef=0.5)
    ppo = PPO(cfg, EnvSpec(obs_shape=(1,), obs_dtype=np.float32, action=Discrete(3)))
    logits, new_values = torch.tensor(LOGITS), torch.tensor(NEW_VALUES)

    def dist_and_value(obs, mask):   # the observation of sample i is [i]
        rows = obs[:, 0].long()
        return ppo.net.head(logits[rows], mask), new_values[rows]

    monkeypatch.setattr(ppo.net, "dist_and_value", dist_and_value)
    data = (torch.arange(6, dtype=torch.float32).unsqueeze(1), torch.tensor(OLD_VALUES), torch.tensor(ADVANTAGES),
            torch.tensor(RETURNS), torch.tensor(ACTIONS), torch.tensor(OLD_LOGPROB),
            None if weights is None else torch.tensor(weights), None)
    loss, diagnostics, rows = ppo._loss(data, torch.tensor(MINIBATCH), CLIP)
    assert rows == len(MINIBATCH)
    want = hand_ppo_loss(norm_adv, clip_vloss, ent_coef, vf_coef=0.5, weights=weights)
    got = {"loss": loss.item(), **{k: v.item() for k, v in diagnostics.items()}}
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


# --- PPO._advantages: the bootstrap at truncations ------------------------------------------------

def obs_value(o) -> float:
    """The stub critic: V(o) = o[0] / 100 (fragment_factory observations: 0.1 x the step index;
    a final observation's is negative, so it can never be mistaken for the next step's)."""
    return float(o[0]) / 100


def naive_fragment_gae(frag, gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """GAE of one fragment, per env and per step, from its raw arrays: the step after t is obs[t + 1]
    unless t ended an episode, when it is that episode's true final observation (final_obs, at
    final_index = t * N + n). A terminated step adds no bootstrap; a truncated one bootstraps from
    the final observation's value; either ends the advantage's recursion. Flat t * N + n order."""
    T, N = frag.num_steps, frag.num_envs
    final = {int(i): j for j, i in enumerate(frag.final_index)}
    adv, ret = [0.0] * (T * N), [0.0] * (T * N)
    for n in range(N):
        following = 0.0
        for t in reversed(range(T)):
            i = t * N + n
            value = obs_value(frag.obs[t, n])
            next_value = obs_value(frag.final_obs[final[i]]) if i in final else obs_value(frag.obs[t + 1, n])
            bootstrap = 0.0 if frag.terminated[t, n] else gamma * next_value
            delta = float(frag.rewards[t, n]) + bootstrap - value
            ended = frag.terminated[t, n] or frag.truncated[t, n]
            following = delta + (0.0 if ended else gamma * lam * following)
            adv[i], ret[i] = following, following + value
    return adv, ret


def test_ppo_advantages_bootstrap_a_truncated_step_from_its_final_observation(monkeypatch):
    """Env 0 terminates inside the fragment, then runs to its end (bootstrap: V(obs[T])); env 1 is
    truncated inside it, then terminates at its last step; env 2 is truncated at its last step (bootstrap:
    V(final_obs), not V(obs[T]), the next episode's first observation)."""
    gamma, lam = 0.9, 0.8
    ppo = PPO(PPOConfig(hidden_sizes=(8,), gamma=gamma, gae_lambda=lam, normalize_rewards=False, decoupled=False), SPEC)
    monkeypatch.setattr(ppo.net, "value", lambda x: x[:, 0] / 100)
    frag = make_fragment(4, 3, obs_shape=(4,), terminated=[(1, 0), (3, 1)], truncated=[(2, 1), (3, 2)])
    obs, values, adv, ret, anchor, weights = ppo._advantages(frag, correct=False)
    torch.testing.assert_close(anchor, torch.tensor(frag.extras["behaviour_logprob"]).reshape(-1))
    assert weights is None   # plain PPO: the clip is centred on the behaviour policy, no weights
    want_adv, want_ret = naive_fragment_gae(frag, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(want_adv), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, torch.tensor(want_ret), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(obs, torch.tensor(frag.obs[:-1]).flatten(0, 1))
    torch.testing.assert_close(values, torch.tensor([obs_value(o) for o in frag.obs[:-1].reshape(-1, 4)]))
    # The three kinds of episode end, written out (flat index t * 3 + n; fragment_factory: reward = index):
    final = {int(i): obs_value(o) for i, o in zip(frag.final_index, frag.final_obs)}
    v = [[obs_value(o) for o in row] for row in frag.obs]
    assert adv[3 * 3 + 2].item() == pytest.approx(11 + gamma * final[11] - v[3][2])      # truncated at the end
    assert final[11] != v[4][2]                                                          # (not the reset's)
    assert adv[2 * 3 + 1].item() == pytest.approx(7 + gamma * final[7] - v[2][1])        # truncated inside
    assert adv[1 * 3 + 0].item() == pytest.approx(3 - v[1][0])                           # terminated
    assert adv[3 * 3 + 0].item() == pytest.approx(9 + gamma * v[4][0] - v[3][0])         # the fragment ends

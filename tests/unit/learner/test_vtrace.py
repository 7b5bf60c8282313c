"""services/algorithms/ppo/learner.py vtrace against a naive per-env, per-step transcription of Espeholt et al.
2018 eq. (1) (with lambda, section 4.2), its relation to gae, and PPO.update with V-trace targets."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.algorithms.ppo.config import PPOConfig
from services.common.protocol.fragments import build_fragment, decode_fragment
from services.common.models.nets import EnvSpec
from services.common.protocol.spaces import Discrete
from services.algorithms.ppo.learner import PPO, gae, vtrace
from tests.unit.fragment_factory import PPO as PPO_CODE
from tests.unit.fragment_factory import make_fragment

SPEC = EnvSpec(obs_shape=(4,), obs_dtype=np.float32, action=Discrete(2))
T, N = 6, 3
GAMMA = 0.97


def naive_vtrace(rewards, values, next_values, terminated, dones, log_rhos, gamma, lam, rho_bar, c_bar):
    """Straight from the paper, one env and one start step s at a time, in Python floats.

    v_s = V(x_s) + sum_{t=s}^{e} gamma^(t-s) (prod_{i=s}^{t-1} c_i) delta_t, where e is the first step
    >= s that ends an episode (or the fragment's last step), c_i = lam min(c_bar, rho_i) and
    delta_t = min(rho_bar, rho_t) (r_t + gamma V(x_{t+1}) (1 - terminated_t) - V(x_t)), with
    V(x_{t+1}) = next_values[t]. The policy-gradient advantage is
    min(rho_bar, rho_s) (r_s + gamma v_{s+1} (1 - terminated_s) - V(x_s)), v_{s+1} replaced by
    next_values[s] where s ends an episode or is the last step.
    """
    T_, N_ = rewards.shape
    r, v, nv = rewards.tolist(), values.tolist(), next_values.tolist()
    term, done, lr = terminated.tolist(), dones.tolist(), log_rhos.tolist()
    rho = [[math.exp(lr[t][n]) for n in range(N_)] for t in range(T_)]
    vs = [[0.0] * N_ for _ in range(T_)]
    pg = [[0.0] * N_ for _ in range(T_)]
    for n in range(N_):
        for s in range(T_):
            total, t = 0.0, s
            while True:
                trace = 1.0
                for i in range(s, t):
                    trace *= lam * min(c_bar, rho[i][n])
                delta = min(rho_bar, rho[t][n]) * (r[t][n] + gamma * nv[t][n] * (1.0 - term[t][n]) - v[t][n])
                total += gamma ** (t - s) * trace * delta
                if done[t][n] or t == T_ - 1:
                    break
                t += 1
            vs[s][n] = v[s][n] + total
        for s in range(T_):
            ends = done[s][n] or s == T_ - 1
            next_vs = nv[s][n] if ends else vs[s + 1][n]
            pg[s][n] = min(rho_bar, rho[s][n]) * (r[s][n] + gamma * next_vs * (1.0 - term[s][n]) - v[s][n])
    dt = rewards.dtype
    return torch.tensor(pg, dtype=dt), torch.tensor(vs, dtype=dt)


def random_inputs(seed: int = 0, dtype=torch.float64):
    """[T, N] inputs shaped like PPO._advantages': V over T+1 observations, next_values = V(x_{t+1})
    except at episode ends, where it is V of the true final observation."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(T, N, generator=g, dtype=dtype)
    all_values = torch.randn(T + 1, N, generator=g, dtype=dtype)
    values = all_values[:-1]
    terminated = torch.zeros(T, N, dtype=torch.bool)
    truncated = torch.zeros(T, N, dtype=torch.bool)
    terminated[1, 0] = terminated[4, 1] = terminated[T - 1, 2] = True
    truncated[3, 0] = truncated[2, 2] = True
    dones = terminated | truncated
    next_values = all_values[1:].clone()
    next_values[dones] = torch.randn(int(dones.sum()), generator=g, dtype=dtype)  # V(final_obs)
    # log pi/mu from -2 to +3: rho from 0.14 to 20, so both rho_bar and c_bar truncate often
    log_rhos = torch.rand(T, N, generator=g, dtype=dtype) * 5.0 - 2.0
    log_rhos[0, 1] = 4.0
    log_rhos[2, 0] = -3.0
    return rewards, values, next_values, terminated, dones, log_rhos


def test_inputs_cover_the_interesting_cases():
    rewards, values, next_values, terminated, dones, log_rhos = random_inputs()
    assert (log_rhos.exp() > 1.5).sum() >= 3 and (log_rhos.exp() < 0.7).sum() >= 3
    assert (dones & ~terminated).any() and terminated.any()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lam,rho_bar,c_bar", [(1.0, 1.0, 1.0), (0.95, 1.0, 1.0), (0.9, 2.0, 0.8),
                                               (0.0, 1.0, 1.0), (1.0, 100.0, 100.0)])
def test_vtrace_against_naive_paper_formula(seed, lam, rho_bar, c_bar):
    inputs = random_inputs(seed)
    pg, vs = vtrace(*inputs, gamma=GAMMA, lam=lam, rho_bar=rho_bar, c_bar=c_bar)
    want_pg, want_vs = naive_vtrace(*inputs, GAMMA, lam, rho_bar, c_bar)
    torch.testing.assert_close(vs, want_vs)
    torch.testing.assert_close(pg, want_pg)


def test_vtrace_float32_against_naive_formula():
    inputs = random_inputs(3, dtype=torch.float32)
    pg, vs = vtrace(*inputs, gamma=GAMMA, lam=0.95, rho_bar=1.0, c_bar=1.0)
    assert pg.dtype == vs.dtype == torch.float32
    want_pg, want_vs = naive_vtrace(*inputs, GAMMA, 0.95, 1.0, 1.0)
    torch.testing.assert_close(vs, want_vs)
    torch.testing.assert_close(pg, want_pg)


def test_vtrace_truncation_matters_on_these_inputs():
    """The clipping is exercised: without it (huge rho_bar, c_bar) the targets differ."""
    inputs = random_inputs(0)
    _, clipped = vtrace(*inputs, gamma=GAMMA, lam=1.0, rho_bar=1.0, c_bar=1.0)
    _, unclipped = vtrace(*inputs, gamma=GAMMA, lam=1.0, rho_bar=1e6, c_bar=1e6)
    assert not torch.allclose(clipped, unclipped)


def test_vtrace_episode_ends_by_hand():
    rewards, values, next_values, terminated, dones, log_rhos = random_inputs(0)
    pg, vs = vtrace(rewards, values, next_values, terminated, dones, log_rhos, GAMMA, 0.95, 1.0, 1.0)
    rho = log_rhos.exp().clamp(max=1.0)
    # terminated at (1, 0): no bootstrap, no trace beyond it
    torch.testing.assert_close(vs[1, 0], values[1, 0] + rho[1, 0] * (rewards[1, 0] - values[1, 0]))
    torch.testing.assert_close(pg[1, 0], rho[1, 0] * (rewards[1, 0] - values[1, 0]))
    # truncated at (3, 0): bootstraps from V(final_obs) = next_values, no trace beyond it
    one_step = rewards[3, 0] + GAMMA * next_values[3, 0] - values[3, 0]
    torch.testing.assert_close(vs[3, 0], values[3, 0] + rho[3, 0] * one_step)
    torch.testing.assert_close(pg[3, 0], rho[3, 0] * one_step)
    # the fragment's last step (5, 0) is not an episode end: bootstraps from next_values
    last = rewards[5, 0] + GAMMA * next_values[5, 0] - values[5, 0]
    torch.testing.assert_close(vs[5, 0], values[5, 0] + rho[5, 0] * last)
    torch.testing.assert_close(pg[5, 0], rho[5, 0] * last)
    # inside an episode the pg advantage bootstraps from the next target v_{s+1}
    torch.testing.assert_close(pg[4, 0], rho[4, 0] * (rewards[4, 0] + GAMMA * vs[5, 0] - values[4, 0]))


def test_vtrace_on_policy_equals_gae_returns():
    """With pi = mu (log_rhos = 0) and rho_bar = c_bar = 1: rho_t = 1, c_t = lam, so
    v_s - V(x_s) = sum_t (gamma lam)^(t-s) delta_t within the episode: exactly the GAE advantage.
    (float32, the learner's dtype: gae rounds gamma * lam to float32 even for float64 inputs.)"""
    rewards, values, next_values, terminated, dones, log_rhos = random_inputs(4, dtype=torch.float32)
    zeros = torch.zeros_like(log_rhos)
    for lam in (0.0, 0.5, 0.95, 1.0):
        _, vs = vtrace(rewards, values, next_values, terminated, dones, zeros, GAMMA, lam, 1.0, 1.0)
        adv, ret = gae(rewards, values, next_values, terminated, dones, GAMMA, lam)
        torch.testing.assert_close(vs, ret)
        torch.testing.assert_close(vs - values, adv)


def test_vtrace_on_policy_pg_advantage_is_one_step_on_vtrace_targets():
    """The pg advantage is r + gamma v_{s+1} - V(x_s), which is not the GAE advantage unless lam = 1."""
    rewards, values, next_values, terminated, dones, _ = random_inputs(5, dtype=torch.float32)
    zeros = torch.zeros(T, N, dtype=rewards.dtype)
    pg, vs = vtrace(rewards, values, next_values, terminated, dones, zeros, GAMMA, 1.0, 1.0, 1.0)
    adv, _ = gae(rewards, values, next_values, terminated, dones, GAMMA, 1.0)
    torch.testing.assert_close(pg, adv)  # lam = 1: v_{s+1} is the Monte-Carlo return, so both agree
    pg95, _ = vtrace(rewards, values, next_values, terminated, dones, zeros, GAMMA, 0.95, 1.0, 1.0)
    adv95, _ = gae(rewards, values, next_values, terminated, dones, GAMMA, 0.95)
    assert not torch.allclose(pg95, adv95)


def test_vtrace_lambda_one_on_policy_is_discounted_return_bootstrapped_at_fragment_end():
    rewards = torch.tensor([[1.0], [2.0], [3.0], [4.0]], dtype=torch.float64)
    values = torch.tensor([[0.5], [-1.0], [2.0], [0.0]], dtype=torch.float64)
    next_values = torch.tensor([[-1.0], [2.0], [0.0], [10.0]], dtype=torch.float64)
    no = torch.zeros(4, 1, dtype=torch.bool)
    g = 0.5
    _, vs = vtrace(rewards, values, next_values, no, no, torch.zeros(4, 1, dtype=torch.float64), g, 1.0, 1.0, 1.0)
    expected = [1 + g * 2 + g**2 * 3 + g**3 * 4 + g**4 * 10, 2 + g * 3 + g**2 * 4 + g**3 * 10,
                3 + g * 4 + g**2 * 10, 4 + g * 10]
    torch.testing.assert_close(vs[:, 0], torch.tensor(expected, dtype=torch.float64))


# --- PPO with V-trace ---------------------------------------------------------------------------

def ppo_cfg(**kw) -> PPOConfig:
    return PPOConfig(**{"num_epochs": 2, "num_minibatches": 2, "batch_steps": 16, "hidden_sizes": (8,), **kw})


def cartpole_fragment(seed: int, policy_version: int = 0, behaviour_logprob=None):
    rng = np.random.default_rng(seed)
    Tf, Nf = 4, 2
    terminated = np.zeros((Tf, Nf), bool)
    truncated = np.zeros((Tf, Nf), bool)
    terminated[1, 0] = True
    truncated[3, 1] = True
    final_index = np.flatnonzero((terminated | truncated).reshape(-1)).astype(np.int64)
    random_logprob = rng.uniform(-1.5, -0.2, (Tf, Nf)).astype(np.float32)
    if behaviour_logprob is None:
        behaviour_logprob = random_logprob
    msg = build_fragment(actor_id="a", seq=seed, policy_version=policy_version, algorithm=PPO_CODE,
                         env_ids=range(Nf), obs=rng.standard_normal((Tf + 1, Nf, 4)).astype(np.float32),
                         actions=rng.integers(0, 2, (Tf, Nf)).astype(np.int64),
                         rewards=np.ones((Tf, Nf), np.float32), terminated=terminated, truncated=truncated,
                         final_obs=rng.standard_normal((len(final_index), 4)).astype(np.float32),
                         final_index=final_index, extras={"behaviour_logprob": behaviour_logprob})
    return decode_fragment(msg)


def test_ppo_update_with_vtrace_correction_smoke():
    torch.manual_seed(0)
    ppo = PPO(ppo_cfg(), SPEC)
    frags = [cartpole_fragment(0), cartpole_fragment(1)]
    before = [p.detach().clone() for p in ppo.net.parameters()]
    stats = ppo.update(frags, correct=[True, False])
    assert ppo.version == 1
    assert ppo.gradient_steps == 2 * 2
    assert set(stats) == {"policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "learning_rate", "return_std"}
    assert all(math.isfinite(v) for v in stats.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, ppo.net.parameters()))
    ppo.update(frags, correct=[True, True])
    assert ppo.version == 2
    assert ppo.gradient_steps == 2 * 2 * 2


def test_ppo_update_with_factory_fragments_and_correction():
    torch.manual_seed(0)
    ppo = PPO(ppo_cfg(num_minibatches=3), SPEC)
    frags = [make_fragment(3, 2, obs_shape=(4,), seq=i, base=i, terminated=[(0, 1)], truncated=[(2, 0)])
             for i in range(3)]
    stats = ppo.update(frags, correct=[False, True, False])
    assert ppo.version == 1 and ppo.gradient_steps == 2 * 3
    assert all(math.isfinite(v) for v in stats.values())


def test_ppo_vtrace_targets_equal_gae_returns_when_behaviour_is_the_current_policy():
    """With behaviour log-probs from the current network, log_rhos = 0: the corrected returns are the
    GAE returns (default rho_bar = c_bar = 1), while the pg advantages are the one-step kind."""
    torch.manual_seed(0)
    ppo = PPO(ppo_cfg(), SPEC)
    frag = cartpole_fragment(7)
    with torch.no_grad():
        obs = torch.tensor(frag.obs[:-1]).flatten(0, 1)
        logprob = ppo.net.dist(obs).log_prob(torch.tensor(frag.actions).reshape(-1)).view(4, 2)
    frag = cartpole_fragment(7, behaviour_logprob=logprob.numpy().astype(np.float32))
    obs_g, values_g, adv_g, ret_g, *_ = ppo._advantages(frag, correct=False)
    obs_v, values_v, adv_v, ret_v, *_ = ppo._advantages(frag, correct=True)
    torch.testing.assert_close(obs_v, obs_g)
    torch.testing.assert_close(values_v, values_g)
    torch.testing.assert_close(ret_v, ret_g)
    assert not torch.allclose(adv_v, adv_g)

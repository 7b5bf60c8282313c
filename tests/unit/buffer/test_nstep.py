"""N-step returns in the replay (services/buffer/replay.py): both layouts against a per-step loop, a
checkpoint of other returns refused, and the DQN learner bootstrapping with each row's discount."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from services.algorithms.dqn.learner import DQN
from services.buffer.checkpoint import BufferCheckpointer
from services.buffer.compact import CompactReplay
from services.buffer.replay import ReplayRing
from services.buffer.store import Outcome, Store
from services.config import ConfigError, config_from_dict
from services.common.protocol.fragments import build_fragment, decode_fragment
from services.common.models.nets import EnvSpec
from services.common.protocol.spaces import Discrete
from services.common.stats import Metrics
from tests.unit.fragment_factory import DQN as DQN_CODE
from tests.unit.fragment_factory import FrameEnvs, fragment_arrays

GAMMA = 0.9


def fragment(seed: int, T: int = 7, N: int = 3, p_end: float = 0.2):
    """Random rewards, and episodes that end (terminated or truncated) at random steps."""
    rng = np.random.default_rng(seed)
    ends = rng.random((T, N)) < p_end
    kind = rng.random((T, N)) < 0.5
    arrays = fragment_arrays(T, N, (2,), terminated=list(zip(*np.nonzero(ends & kind))),
                             truncated=list(zip(*np.nonzero(ends & ~kind))), with_logprob=False)
    arrays["rewards"] = rng.normal(size=(T, N)).astype(np.float32)
    return decode_fragment(build_fragment(actor_id="a", seq=seed, policy_version=seed, algorithm=DQN_CODE,
                                          env_ids=range(N), **arrays))


def naive(frag, n: int, gamma: float) -> dict[str, np.ndarray]:
    """Each step's transition by a plain loop: sum rewards until n of them, the episode's end or the
    fragment's last step; take next_obs and terminated from the step it stopped at."""
    T, N = frag.rewards.shape
    nxt = frag.next_obs()
    rows = {k: [] for k in ("obs", "actions", "rewards", "next_obs", "terminated", "discount")}
    for t in range(T):
        for e in range(N):
            total, k = 0.0, 0
            while True:
                total += gamma ** k * float(frag.rewards[t + k, e])
                k += 1
                last = t + k - 1
                if frag.terminated[last, e] or frag.truncated[last, e] or k == n or t + k == T:
                    break
            for name, value in (("obs", frag.obs[t, e]), ("actions", frag.actions[t, e]), ("rewards", total),
                                ("next_obs", nxt[last, e]), ("terminated", frag.terminated[last, e]),
                                ("discount", gamma ** k)):
                rows[name].append(value)
    return {k: np.array(v) for k, v in rows.items()}


@pytest.mark.parametrize("n", [2, 3, 5, 7])
@pytest.mark.parametrize("seed", range(4))
def test_ring_rows_are_the_n_step_transitions_of_a_per_step_loop(n, seed):
    frags = [fragment(seed * 10 + i) for i in range(3)]
    ring = ReplayRing(capacity=1000, n_step=n, gamma=GAMMA)
    for f in frags:
        ring.add(f)
    held = ring.gather(np.arange(ring.size))
    want = {k: np.concatenate([naive(f, n, GAMMA)[k] for f in frags]) for k in naive(frags[0], n, GAMMA)}
    for name in ("obs", "actions", "next_obs", "terminated"):
        np.testing.assert_array_equal(held[name], want[name].astype(held[name].dtype), err_msg=name)
    np.testing.assert_allclose(held["rewards"], want["rewards"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(held["discount"], want["discount"], rtol=1e-6)
    assert held["rewards"].dtype == held["discount"].dtype == np.float32


@pytest.mark.parametrize("T", [1, 2, 3])
def test_fragments_shorter_than_n_sum_what_they_have(T):
    """A fragment (or a part the compact layout splits off) of fewer steps than n: windows stop at its end."""
    frags = [fragment(40 + T, T=T, N=4, p_end=0.3)]
    ring = ReplayRing(capacity=100, n_step=5, gamma=GAMMA)
    ring.add(frags[0])
    held, want = ring.gather(np.arange(ring.size)), naive(frags[0], 5, GAMMA)
    np.testing.assert_allclose(held["rewards"], want["rewards"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(held["discount"], want["discount"], rtol=1e-6)
    np.testing.assert_array_equal(held["next_obs"], want["next_obs"].astype(np.float32))
    np.testing.assert_array_equal(held["terminated"], want["terminated"])


def test_one_step_rows_are_the_steps_as_they_came_without_a_discount():
    frag = fragment(1)
    ring = ReplayRing(capacity=100)
    ring.add(frag)
    held = ring.gather(np.arange(ring.size))
    assert "discount" not in held
    np.testing.assert_array_equal(held["rewards"], frag.rewards.reshape(-1))
    np.testing.assert_array_equal(held["next_obs"], frag.next_obs().reshape(held["next_obs"].shape))


def test_compact_and_plain_layouts_hold_the_same_n_step_transitions():
    envs = FrameEnvs(3, seed=9, p_end=0.2)
    compact = CompactReplay(capacity=500, seed=3, n_step=3, gamma=GAMMA)
    plain = ReplayRing(capacity=500, seed=3, n_step=3, gamma=GAMMA)
    for seq in range(4):
        frag = decode_fragment(envs.fragment(6, seq=seq))
        compact.add(frag)
        plain.add(frag)
    assert compact.size == plain.size == 4 * 6 * 3
    want, got = plain.gather(np.arange(plain.size)), compact.gather(np.arange(compact.size))
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert (want["discount"] < GAMMA ** 2).any() and (want["discount"] > GAMMA ** 2).any()  # 3 steps and fewer


def config(**dqn):
    return config_from_dict({"algorithm": "dqn", "env": {"id": "CartPole-v1", "num_envs": 2},
                             "dqn": {"buffer_size": 64, "batch_size": 8, "learning_starts": 8, "rollout_steps": 4,
                                     "replay_ratio": 0, "gamma": GAMMA, **dqn}})


def test_n_step_is_checked_against_the_fragment_length():
    with pytest.raises(ConfigError, match="n_step"):
        config(n_step=5)
    with pytest.raises(ConfigError, match="n_step"):
        config(n_step=0)


async def test_a_checkpoint_of_other_returns_is_refused_naming_them(tmp_path, caplog):
    cfg = config(n_step=3)
    store = Store(cfg, Metrics("buffer"))
    frag = FrameEnvs(2, seed=4, p_end=0.0)
    for seq in range(3):
        assert store.insert(frag.fragment(4, seq=seq)) is Outcome.ACCEPTED
    await BufferCheckpointer(store, cfg, tmp_path, store.metrics).save()
    same = Store(cfg, Metrics("buffer"))
    assert await BufferCheckpointer(same, cfg, tmp_path, same.metrics).restore()
    assert same.size == store.size
    other_cfg = config(n_step=1)
    other = Store(other_cfg, Metrics("buffer"))
    with caplog.at_level(logging.WARNING):
        assert not await BufferCheckpointer(other, other_cfg, tmp_path, other.metrics).restore()
    assert "its transitions hold 3-step returns with gamma 0.9; this buffer makes 1-step returns" in caplog.text
    assert other.size == 0


def test_the_learner_bootstraps_each_row_with_its_own_discount(monkeypatch):
    """The batch's discount reaches the TD target in place of gamma, row by row."""
    import services.algorithms.dqn.learner as module
    spec = EnvSpec(obs_shape=(2,), obs_dtype=np.float32, action=Discrete(2))
    learner = DQN(config().section("dqn"), spec)
    seen = {}
    original = module.td_target

    def recording(rewards, terminated, next_q_online, next_q_target, gamma, double):
        seen.update(y=original(rewards, terminated, next_q_online, next_q_target, gamma, double),
                    bootstrap=next_q_target.gather(1, next_q_online.argmax(dim=1, keepdim=True)).squeeze(1))
        return seen["y"]

    monkeypatch.setattr(module, "td_target", recording)
    obs = np.ones((3, 2), np.float32)
    discount = np.array([GAMMA, GAMMA ** 3, GAMMA ** 2], np.float32)
    learner.update({"obs": obs, "actions": np.zeros(3, np.int64), "rewards": np.ones(3, np.float32),
                    "next_obs": obs, "terminated": np.array([False, False, True]), "discount": discount})
    assert learner.version == 1
    y, bootstrap = seen["y"].numpy(), seen["bootstrap"].numpy()
    np.testing.assert_allclose(y, 1.0 + discount * bootstrap * np.array([1, 1, 0]), rtol=1e-6)
    assert y[0] != y[1]

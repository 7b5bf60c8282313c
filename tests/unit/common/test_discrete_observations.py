"""Discrete and MultiDiscrete observations, alone or as keys of a Dict (issue 53 item 9): the spec
read from a gymnasium env, the integers on the wire and in buffers, one-hot encoding as the
networks' first step (observation normalisation skipping those elements), training PPO (feed-forward
and recurrent) and DQN through an actor's rollout and a buffer's replay, `kuberl export` giving the
torch policy's actions, out-of-range values refused with the field named, and PPO learning a tiny
Discrete-observation task."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from services.actor.finite import BadEnvStep
from services.actor.rollout import Rollout
from services.cli import export
from services.cli.trained import load_trained
from services.common.envs import make_vector_env, spec_of
from services.common.models.nets import ObsNormalizer, OneHot, obs_normalizer, to_numpy
from services.common.protocol import spaces
from services.common.protocol.fragments import RawFragment, decode_fragment
from services.common.protocol.spaces import Discrete, EnvSpec, MultiDiscrete
from services.common.protocol.tensors import TensorError
from services.common.stats import Metrics
from services.config import config_from_dict
from tests.policies import train

FROZEN_LAKE = {"id": "FrozenLake-v1", "kwargs": {"is_slippery": False}, "num_envs": 4}


def _register(name: str, obs_space, make_obs, bad_at: int | None = None, episode: int = 8) -> str:
    """A gymnasium env `kuberl-test/<name>-v0` observing `make_obs(rng)`, two actions, reward 1 when the
    action is the parity of the observation's first integer; with `bad_at`, env copy 1 (odd seed)
    returns 99 as that integer at step `bad_at`. Made on demand: gymnasium registers ids process-wide."""
    import gymnasium as gym

    class Env(gym.Env):
        observation_space = obs_space
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.odd = getattr(self, "odd", False) if seed is None else seed % 2 == 1
            self.t = 0
            self.obs = make_obs(self.np_random)
            return self.obs, {}

        def step(self, action):
            first = self.obs["card"] if isinstance(self.obs, dict) else np.asarray(self.obs).reshape(-1)[0]
            reward = float(int(action) == int(first) % 2)
            self.t += 1
            self.obs = make_obs(self.np_random)
            if self.t == bad_at and self.odd:
                if isinstance(self.obs, dict):
                    self.obs["card"] = 99
                else:
                    self.obs = np.full_like(self.obs, 99) if np.ndim(self.obs) else 99
            return self.obs, reward, False, self.t >= episode, {}

    env_id = f"kuberl-test/{name}-v0"
    if env_id not in gym.registry:
        gym.register(env_id, entry_point=Env, disable_env_checker=True)
    return env_id


def _parity(bad_at=None) -> str:
    import gymnasium as gym
    return _register(f"Parity{bad_at}", gym.spaces.Discrete(8), lambda rng: int(rng.integers(8)), bad_at)


def _cards(bad_at=None) -> str:
    """Dict{card: Discrete(5), hand: MultiDiscrete([3, 2]), pos: Box[2]}."""
    import gymnasium as gym
    space = gym.spaces.Dict({"pos": gym.spaces.Box(-1.0, 1.0, (2,), np.float32), "card": gym.spaces.Discrete(5),
                             "hand": gym.spaces.MultiDiscrete([3, 2])})
    return _register(f"Cards{bad_at}", space, lambda rng: {
        "pos": rng.uniform(-1, 1, 2).astype(np.float32), "card": int(rng.integers(5)),
        "hand": rng.integers([3, 2]).astype(np.int64)}, bad_at)


def _multi() -> str:
    import gymnasium as gym
    return _register("Multi", gym.spaces.MultiDiscrete([4, 3]), lambda rng: rng.integers([4, 3]).astype(np.int64))


# -- spaces and specs ---------------------------------------------------------------------------------

def test_specs_of_discrete_multidiscrete_and_dict_observations():
    """Specs from gymnasium envs, the wire layout of their observations, and the checkpoint's copy (~0.1 s)."""
    lake = spec_of(config_from_dict({"env": FROZEN_LAKE}).env)
    assert (lake.obs_shape, lake.obs_dtype, lake.obs_categories) == ((), np.int64, ((0, 16),))
    assert lake.discrete_obs == Discrete(16) and spaces.describe_observation(lake) == "Discrete(16)"
    multi = spec_of(config_from_dict({"env": {"id": _multi()}}).env)
    assert (multi.obs_shape, multi.obs_dtype, multi.obs_categories) == ((2,), np.int64, ((0, 4), (1, 3)))
    assert multi.discrete_obs == MultiDiscrete((4, 3))
    cards = spec_of(config_from_dict({"env": {"id": _cards()}}).env)
    # keys sorted: card (1 value), hand (2), pos (2); the integers stay integers among the float32 values
    assert cards.obs_shape == (5,) and cards.obs_dtype == np.float32 and cards.discrete_obs is None
    assert cards.obs_keys == (("card", ()), ("hand", (2,)), ("pos", (2,)))
    assert cards.obs_categories == ((0, 5), (1, 3), (2, 2))
    assert spaces.describe_observation(cards) == "Dict(card: Discrete(5), hand: MultiDiscrete([3, 2]), pos: [2])"
    for spec in (lake, multi, cards):
        assert spaces.spec_from_dict(spaces.spec_to_dict(spec)) == spec
    old = spaces.spec_to_dict(EnvSpec((3,), np.dtype(np.float32), Discrete(2)))
    del old["observation_categories"]   # a checkpoint written before categorical observations
    assert spaces.spec_from_dict(old).obs_categories == ()

    envs = make_vector_env(config_from_dict({"env": {"id": _cards(), "num_envs": 2}}).env)
    try:
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (2, 5) and obs.dtype == np.float32
        spaces.check_observations(cards, obs)   # whole numbers in range
        assert set(obs[:, 0]) <= set(range(5))
    finally:
        envs.close()


def test_spaces_kuberl_cannot_take_are_refused_naming_env_id():
    """A Discrete observation starting elsewhere than 0, and a Tuple, are refused at the spec (~0.1 s)."""
    import gymnasium as gym
    from services.common.envs import _spec_of_spaces

    with pytest.raises(ValueError, match=r"env.id: x: .*must start at 0"):
        _spec_of_spaces("x", gym.spaces.Discrete(3, start=1), gym.spaces.Discrete(2))
    with pytest.raises(ValueError, match=r"env.id: x has observation space Tuple.*Box, Discrete, MultiDiscrete"):
        _spec_of_spaces("x", gym.spaces.Tuple([gym.spaces.Discrete(2)]), gym.spaces.Discrete(2), dicts=True)


def test_out_of_range_observations_are_refused_naming_the_field():
    """check_observations: negative, >= n and fractional values name the field (and Dict key) (~0.01 s)."""
    lake = EnvSpec((), np.dtype(np.int64), Discrete(4), None, ((0, 16),))
    spaces.check_observations(lake, np.array([0, 15]))
    with pytest.raises(TensorError, match=r"^obs: is 16 \(row 1\), outside 0..15"):
        spaces.check_observations(lake, np.array([0, 16]), "obs")
    with pytest.raises(TensorError, match=r"^obs: is -1 \(row 0\)"):
        spaces.check_observations(lake, np.array([-1, 3]), "obs")
    cards = EnvSpec((5,), np.dtype(np.float32), Discrete(2), (("card", ()), ("hand", (2,)), ("pos", (2,))),
                    ((0, 5), (1, 3), (2, 2)))
    with pytest.raises(TensorError, match=r"^observations\['hand'\]\[1\]: is 2 \(row 0\), outside 0..1"):
        spaces.check_observations(cards, np.array([[4, 2, 2, 9.5, -9.5]], np.float32))
    with pytest.raises(TensorError, match=r"^observations\['card'\]: is 1.5"):
        spaces.check_observations(cards, np.array([[1.5, 0, 0, 0, 0]], np.float32))
    spaces.check_observations(cards, np.array([[4, 2, 1, 9.5, -9.5]], np.float32))   # a Box value may be anything


# -- networks -----------------------------------------------------------------------------------------

def test_one_hot_encodes_categorical_elements_and_normalisation_skips_them():
    """OneHot equals F.one_hot per element after the other elements; the normaliser leaves the
    integers as they are; neither adds to a checkpoint (~0.01 s)."""
    cards = EnvSpec((5,), np.dtype(np.float32), Discrete(2), (("card", ()), ("hand", (2,)), ("pos", (2,))),
                    ((0, 5), (1, 3), (2, 2)))
    x = torch.tensor([[4, 2, 1, 0.5, -0.5], [0, 0, 0, 3.0, 2.0]])
    one_hot = OneHot(cards)
    want = torch.cat([x[:, 3:], F.one_hot(x[:, 0].long(), 5), F.one_hot(x[:, 1].long(), 3),
                      F.one_hot(x[:, 2].long(), 2)], 1).float()
    assert one_hot.width == 2 + 5 + 3 + 2
    torch.testing.assert_close(one_hot(x), want)
    assert one_hot(torch.tensor([[7.0, 0, 0, 0, 0]]))[0, 2:7].sum() == 0   # out of range: no column set
    assert one_hot.state_dict() == {}

    norm = obs_normalizer(cards, clip=10.0)
    assert isinstance(norm, ObsNormalizer) and set(norm.state_dict()) == {"mean", "var", "count"}
    norm.update(x * 10)
    y = norm(x)
    torch.testing.assert_close(y[:, :3], x[:, :3])   # the integers, untouched
    assert not torch.allclose(y[:, 3:], x[:, 3:])
    lake = EnvSpec((), np.dtype(np.int64), Discrete(4), None, ((0, 16),))
    assert obs_normalizer(lake, 10.0) is None   # nothing to normalise
    torch.testing.assert_close(OneHot(lake)(torch.tensor([[3.0], [15.0]])), F.one_hot(torch.tensor([3, 15]), 16).float())


# -- every role, through one in-process run ------------------------------------------------------------

@pytest.mark.parametrize("cfg", [
    {"algorithm": "ppo", "env": FROZEN_LAKE, "ppo": {"hidden_sizes": [8], "rollout_steps": 8, "batch_steps": 32}},
    {"algorithm": "ppo", "env": {"id": "cards", "num_envs": 4},
     "ppo": {"hidden_sizes": [8], "rollout_steps": 8, "batch_steps": 32, "normalize_observations": True,
             "recurrent": "lstm", "recurrent_size": 8}},
    {"algorithm": "ppo", "env": {"id": "multi", "num_envs": 4},
     "ppo": {"hidden_sizes": [8], "rollout_steps": 8, "batch_steps": 32}},
    {"algorithm": "dqn", "env": FROZEN_LAKE,
     "dqn": {"hidden_sizes": [8], "learning_starts": 32, "batch_size": 16, "rollout_steps": 8}},
], ids=["ppo-discrete", "recurrent-ppo-dict-normalised", "ppo-multidiscrete", "dqn-discrete"])
def test_a_run_trains_on_integer_observations_and_exports_them(tmp_path, cfg):
    """Rollout (local envs) -> fragments of int64 (or Dict float32) observations -> buffer (DQN: its
    replay) -> learner -> checkpoint -> `kuberl export` (ONNX and TorchScript), whose graph takes the
    integers and gives the torch policy's actions (~1.5-4 s each; the first pays the exporters' imports)."""
    ids = {"cards": _cards(), "multi": _multi()}
    cfg = {**cfg, "env": {**cfg["env"], "id": ids.get(cfg["env"]["id"], cfg["env"]["id"])}}
    train(tmp_path / "run", cfg, 160)
    trained = load_trained(tmp_path / "run")
    assert trained.version >= 1 and trained.spec.obs_categories
    params = [p.detach().clone() for p in trained.policy.acting.net.parameters()]
    assert all(torch.isfinite(p).all() for p in params)
    obs = export.sample_observations(trained.spec, 64, seed=3)
    spaces.check_observations(trained.spec, obs)
    assert len(np.unique(obs.reshape(64, -1)[:, trained.spec.obs_categories[0][0]])) > 1
    for fmt in ("onnx", "torchscript"):
        path = export.export(trained, fmt, tmp_path / f"policy{export.FORMATS[fmt]}")
        assert export.check(trained, path, fmt) < 1e-4   # (raises ExportError on a mismatch)
    meta = export.metadata(trained, False)["kuberl.observation"]
    assert '"categories": [[' in meta


def test_fragments_carry_the_integers_and_an_out_of_range_one_stops_the_actor():
    """A Discrete env's fragment holds int64 [T+1, N] observations; a value >= n stops the actor with
    a BadEnvStep naming env.id, the field and the env (counted), before anything of it is recorded;
    a Dict's Discrete key likewise, named by key (~0.5 s)."""
    def rollout(env_id: str) -> Rollout:
        cfg = config_from_dict({"algorithm": "ppo", "env": {"id": env_id, "num_envs": 2},
                                "ppo": {"rollout_steps": 4, "batch_steps": 8, "hidden_sizes": [8]}})
        r = Rollout(cfg, "actor-d", 0, Metrics("actor"))
        r.policy.offer_weights(1, to_numpy(r.policy.net))
        return r

    r = rollout(_parity(bad_at=6))
    try:
        frag = decode_fragment(RawFragment(r.collect().payload))
        assert frag.obs.dtype == np.int64 and frag.obs.shape == (5, 2) and ((frag.obs >= 0) & (frag.obs < 8)).all()
        with pytest.raises(BadEnvStep, match=r"returned observations of env 1 is 99, outside 0..7 \(a categorical "
                                             r"observation of 8 values\)"):
            r.collect()
        assert r.metrics.counters["actor/steps_refused_out_of_bounds_total"] == 1 and r.seq == 1
    finally:
        r.close()
    r = rollout(_cards(bad_at=2))
    try:
        with pytest.raises(ValueError, match=r"returned observation\['card'\]: is 99, outside 0..4"):
            r.collect()
        assert r.seq == 0
    finally:
        r.close()


def test_ppo_learns_a_discrete_observation_task(tmp_path):
    """The right action is the parity of a Discrete(8) observation (reward 1, else 0): within 1k env
    steps PPO's policy gives the right action probability >= 0.9 for each of the eight (untrained: about
    0.5), so its greedy action is right for all (~1 s)."""
    cfg = {"algorithm": "ppo", "seed": 0, "env": {"id": _parity(), "num_envs": 8},
           "ppo": {"hidden_sizes": [16], "rollout_steps": 16, "batch_steps": 128, "learning_rate": 0.01,
                   "num_epochs": 4, "gamma": 0.0, "normalize_rewards": False}}
    train(tmp_path / "run", cfg, 1_000)
    trained = load_trained(tmp_path / "run")
    obs = torch.arange(8)
    with torch.inference_mode():
        right = trained.policy.acting.net.dist(obs).probs[obs, obs % 2]
        actions = trained.greedy()(obs).numpy()
    assert right.min().item() >= 0.9, right
    np.testing.assert_array_equal(actions, np.arange(8) % 2)


def test_a_learner_refuses_a_batch_with_an_out_of_range_observation(tmp_path):
    """The learner checks what the actor checked (bad data from a simulator, a buggy actor or the wire
    never reaches the weights): a fragment whose Discrete observation is outside 0..n-1 is refused,
    counted as an invalid batch, the version unchanged; its in-range twin trains (~1 s)."""
    from services.buffer.store import Store
    from services.common.protocol.fragments import build_fragment
    from services.learner.trainer import Trainer

    cfg = config_from_dict({"algorithm": "ppo", "env": {"id": _parity(), "num_envs": 2},
                            "ppo": {"rollout_steps": 4, "batch_steps": 8, "hidden_sizes": [8]}})
    r = Rollout(cfg, "actor-d", 0, Metrics("actor"))
    try:
        r.policy.offer_weights(1, to_numpy(r.policy.net))
        f = decode_fragment(RawFragment(r.collect().payload), extras=("behaviour_logprob",))
    finally:
        r.close()

    def batch(obs: np.ndarray, seq: int):
        msg = build_fragment(actor_id="a", seq=seq, policy_version=f.policy_version, algorithm=f.algorithm,
                             env_ids=f.env_ids, obs=obs, actions=f.actions, rewards=f.rewards, terminated=f.terminated,
                             truncated=f.truncated, final_obs=f.final_obs, final_index=f.final_index, extras=f.extras)
        store = Store(cfg, Metrics("buffer"))
        store.insert(RawFragment(msg.SerializeToString()))
        return store.next_batch(8, "learner")

    trainer = Trainer(cfg, Metrics("learner"), tmp_path)
    bad = f.obs.copy()
    bad[2, 1] = 8   # Discrete(8): 8 is out of range
    trainer.train(batch(bad, 0))
    assert trainer.version == 0 and trainer.metrics.counters["learner/batches_invalid_total"] == 1
    trainer.train(batch(f.obs.copy(), 1))
    assert trainer.version == 1 and trainer.metrics.counters["learner/batches_invalid_total"] == 1

"""Self-play in the actor (services/actor/selfplay.py): only the learning agent of each env copy is
recorded; the others are played by the newest weights or a pool snapshot, drawn by the documented
rule; the pool keeps every `snapshot_every`-th version, the newest `pool_size`; games are scored and
Elo moves by the formula."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from services.actor.rollout import Rollout
from services.actor.selfplay import LATEST, START_ELO, SelfPlay, Snapshot
from services.common.models.nets import to_numpy
from services.common.protocol.fragments import RawFragment, decode_fragment
from services.common.protocol.spaces import Box, Discrete, MultiDiscrete, random_actions
from services.common.stats import Metrics
from services.config import ConfigError, config_from_dict
from tests.helpers import TINY_PPO

pytest.importorskip("pettingzoo", reason="PettingZoo is in the actor extra")

COPIES = 4
NO_SLOT = np.zeros(2 * COPIES, bool)   # (no slot's episode ended: `stepped`'s `ended`)


def config(**selfplay):
    return config_from_dict({**TINY_PPO, "env": {"id": "pettingzoo:kuberl_envs.tron", "num_envs": COPIES,
                                                 "kwargs": {"size": 6}},
                             "selfplay": {"enabled": True, **selfplay}})


def weights_preferring(rollout: Rollout, action: int) -> dict[str, np.ndarray]:
    """The policy's weights changed so that it picks `action` almost surely (its action head: zero
    weights and a large bias on `action`)."""
    arrays = to_numpy(rollout.policy.net)
    n = rollout.spec.action.n
    for name, arr in arrays.items():
        if name.endswith("weight") and arr.shape[0] == n:
            arrays[name] = np.zeros_like(arr)
        if name.endswith("bias") and arr.shape == (n,):
            arrays[name] = np.where(np.arange(n) == action, 50.0, 0.0).astype(arr.dtype)
    return arrays


def collect_versions(rollout: Rollout, versions: int) -> list:
    """A window's fragments at each of `versions` new versions of the policy (the same weights each time)."""
    frags = []
    for version in range(1, versions + 1):
        rollout.policy.offer_weights(version, to_numpy(rollout.policy.net))
        frags.append(rollout.collect())
        while rollout._pending:
            frags.append(rollout.collect())
    return frags


def snapshot_playing_2_policy_1(**selfplay) -> tuple[Rollout, Snapshot]:
    """A closed rollout (swap_sides false: slot 2k is copy k's learning agent) whose pool holds one
    snapshot, of weights that play 2, and whose training policy now plays 1."""
    rollout = Rollout(config(snapshot_every=1, swap_sides=False, **selfplay), "sp", 0, Metrics("actor"))
    rollout.close()
    rollout.policy.offer_weights(1, weights_preferring(rollout, 2))
    rollout.policy.swap()
    rollout.selfplay.swapped()
    (snapshot,) = rollout.selfplay.pool
    rollout.policy.offer_weights(2, weights_preferring(rollout, 1))
    rollout.policy.swap()
    return rollout, snapshot


def test_only_the_learning_agents_are_recorded_and_every_game_is_scored():
    rollout = Rollout(config(snapshot_every=2, pool_size=2), "sp", 0, Metrics("actor"))
    try:
        frags = collect_versions(rollout, 6)
        sp = rollout.selfplay
        assert [s.version for s in sp.pool] == [4, 6]                # every 2nd version, the newest 2
        decoded = [decode_fragment(RawFragment(m.payload)) for m in frags]
    finally:
        rollout.close()
    # Both agents of a tron copy play every step, and each copy has one learning agent: one recorded
    # sample per copy and step, the learning agent's (a slot of its copy).
    steps = 6 * TINY_PPO["ppo"]["rollout_steps"]
    assert sum(f.num_samples for f in decoded) == steps * COPIES
    assert rollout.metrics.counters["actor/env_steps_total"] == steps * COPIES
    c = rollout.metrics.counters
    assert c["actor/selfplay_games_total"] == c["actor/selfplay_wins_total"] + c["actor/selfplay_losses_total"] \
        + c["actor/selfplay_draws_total"] > 0
    # Every recorded episode is a learning agent's, one per game.
    assert c["actor/episodes_total"] == c["actor/selfplay_games_total"]
    assert rollout.metrics.gauges["actor/selfplay_pool_size"] == 2


def test_record_latest_records_every_side_of_the_games_against_the_newest_weights():
    rollout = Rollout(config(record_latest=True, latest_probability=1.0), "sp", 0, Metrics("actor"))
    try:
        decoded = [decode_fragment(RawFragment(m.payload)) for m in collect_versions(rollout, 3)]
    finally:
        rollout.close()
    # Every copy faces the newest weights (an empty pool too): both agents of every copy are recorded.
    steps = 3 * TINY_PPO["ppo"]["rollout_steps"]
    assert sum(f.num_samples for f in decoded) == steps * COPIES * 2
    c = rollout.metrics.counters
    assert c["actor/episodes_total"] == 2 * c["actor/selfplay_games_total"] > 0   # one per side and game
    assert all(f.extras["behaviour_logprob"].min() < 0 for f in decoded)   # the policy's own log-probs, not 0s

    # Against a snapshot only the learning agent is recorded, and the draw decides at each episode.
    sp = rollout.selfplay
    sp.sp = dataclasses.replace(sp.sp, latest_probability=0.5)
    sp.add(Snapshot(10, None, START_ELO))
    for _ in range(200):
        sp.new_episode(1)
        recorded = sp.recorded()[2:4]
        if sp.opponent[1] is LATEST:
            assert recorded.all()
        else:
            assert list(np.flatnonzero(recorded)) == [sp.learning_agent[1]]


def test_opponents_are_drawn_by_the_documented_rule():
    rollout = Rollout(config(latest_probability=0.2), "sp", 0, Metrics("actor"))
    rollout.close()
    sp = rollout.selfplay
    assert all(o is LATEST for o in sp.opponent)                     # an empty pool: the newest weights
    for v in (10, 20, 30):
        sp.add(Snapshot(v, None, START_ELO))
    draws = 3000
    latest, versions, sides = 0, {10: 0, 20: 0, 30: 0}, [0, 0]
    for _ in range(draws):
        sp.new_episode(0)
        sides[sp.learning_agent[0]] += 1
        if sp.opponent[0] is LATEST:
            latest += 1
        else:
            versions[sp.opponent[0].version] += 1
    # Binomial: 0.2 +- 0.007 (sd); each snapshot 0.8 / 3 +- 0.008; each side 0.5 +- 0.009. 4 sd.
    assert abs(latest / draws - 0.2) < 0.03
    assert all(abs(n / draws - 0.8 / 3) < 0.035 for n in versions.values()), versions
    assert abs(sides[0] / draws - 0.5) < 0.04


def test_random_probability_puts_a_uniformly_random_player_in_that_share_of_the_other_episodes():
    rollout = Rollout(config(latest_probability=0.2, random_probability=0.5), "sp", 0, Metrics("actor"))
    rollout.close()
    sp = rollout.selfplay
    draws, counts = 4000, {"latest": 0, "random": 0, "snapshot": 0}
    for pool in ([], [Snapshot(10, None, START_ELO)]):
        for s in pool:
            sp.add(s)
        counts = dict.fromkeys(counts, 0)
        for _ in range(draws):
            sp.new_episode(0)
            o = sp.opponent[0]
            counts["latest" if o is LATEST else "random" if o is sp.random else "snapshot"] += 1
        # 0.2 the newest weights; of the other 0.8, half random and half a snapshot (the newest weights
        # while the pool is empty). Binomial sd <= 0.008: 4 sd.
        assert abs(counts["random"] / draws - 0.4) < 0.035, counts
        assert abs(counts["snapshot"] / draws - (0.4 if pool else 0.0)) < 0.035, counts
    assert set(counts) == {"latest", "random", "snapshot"}

    # The random player keeps to the mask and plays uniformly; games against it are scored apart.
    mask = np.zeros((30000, 5), bool)
    mask[:, [0, 3]] = True
    mask[:10000, 3] = False
    actions = random_actions(Discrete(5), len(mask), mask, np.random.default_rng(0))
    assert (actions[:10000] == 0).all()
    assert set(actions[10000:]) == {0, 3} and abs((actions[10000:] == 3).mean() - 0.5) < 0.02
    multi = random_actions(MultiDiscrete((2, 3)), 4, np.array([[1, 0, 0, 0, 1]] * 4, bool), np.random.default_rng(0))
    assert multi.tolist() == [[0, 2]] * 4
    box = random_actions(Box.of((2,), [-1, 0], [1, 5]), 1000, None, np.random.default_rng(0))
    assert box.shape == (1000, 2) and box.min(0).tolist() >= [-1, 0] and box.max(0).tolist() <= [1, 5]


def test_games_against_the_random_player_are_scored_apart_and_not_rated():
    rollout = Rollout(config(latest_probability=0.0, random_probability=1.0), "sp", 0, Metrics("actor"))
    try:
        collect_versions(rollout, 3)
    finally:
        rollout.close()
    c, g = rollout.metrics.counters, rollout.metrics.gauges
    assert c["actor/selfplay_games_total"] > 0 and len(rollout.selfplay.recent_random) == min(
        100, c["actor/selfplay_games_total"])
    assert g["actor/selfplay_random_win_rate"] == sum(s == 1.0 for s in rollout.selfplay.recent_random) / len(
        rollout.selfplay.recent_random)
    assert g["actor/selfplay_elo"] == START_ELO        # random games are not rated
    with pytest.raises(ConfigError, match=r"^selfplay.random_probability: 1.5 is invalid"):
        config(random_probability=1.5)
    unbounded = SimpleNamespace(policy=SimpleNamespace(spec=SimpleNamespace(action=Box.of((1,), [-np.inf], [np.inf]))))
    with pytest.raises(ValueError, match=r"^selfplay.random_probability: the random player acts uniformly within "
                                         r"the action space's bounds, and Box"):
        SelfPlay(config(random_probability=0.5), unbounded, 1, 2, Metrics("actor"), np.random.default_rng(0))


def test_keep_history_holds_the_newest_half_and_a_uniform_sample_of_the_older():
    rollout = Rollout(config(pool_size=4, keep="history"), "sp", 0, Metrics("actor"))
    rollout.close()
    picked = np.zeros(101)
    trials = 400
    for trial in range(trials):
        sp = rollout.selfplay
        sp.newest.clear()
        sp.older, sp._left, sp.rng = [], 0, np.random.default_rng(trial)
        for v in range(1, 101):
            sp.add(Snapshot(v, None, START_ELO))
        versions = [snap.version for snap in sp.pool]
        assert versions[2:] == [99, 100] and len(versions) == 4     # the newest half, in order
        picked[versions[:2]] += 1
    # Each of versions 1..98 is among the 2 older ones with probability 2/98: over 400 trials, 8.2 +- 2.8
    # each; the first and the second half of the history alike (392 +- 19.8 each of the 800 picks).
    assert picked[99:].sum() == 0 and picked[1:99].sum() == 2 * trials
    assert abs(picked[1:50].sum() - picked[50:99].sum()) < 4 * 2 * 19.8
    assert rollout.metrics.gauges["actor/selfplay_pool_size"] == 4


def test_prioritized_sampling_meets_the_snapshots_it_loses_to_most():
    rollout = Rollout(config(latest_probability=0.0, sampling="prioritized", swap_sides=False), "sp", 0,
                      Metrics("actor"))
    rollout.close()
    sp = rollout.selfplay
    beaten, even, unbeaten = Snapshot(1, None, START_ELO, 98, 98.0), Snapshot(2, None, START_ELO, 10, 5.0), \
        Snapshot(3, None, START_ELO, 8, 0.0)
    for snap in (beaten, even, unbeaten):
        sp.add(snap)
    weights = np.array([(1 - 99 / 100) ** 2, (1 - 6 / 12) ** 2, (1 - 1 / 10) ** 2])
    assert [snap.hardness() for snap in sp.pool] == pytest.approx(weights)
    draws, counts = 4000, {1: 0, 2: 0, 3: 0}
    for _ in range(draws):
        sp.new_episode(0)
        counts[sp.opponent[0].version] += 1
    want = weights / weights.sum()   # 0.0001, 0.236, 0.764
    assert all(abs(counts[v + 1] / draws - want[v]) < 0.03 for v in range(3)), counts
    # Games against a snapshot count toward its hardness: copy 0's learning agent (slot 0) wins.
    sp.face(0, even)
    sp.stepped(np.array([1.0, -1.0] + [0.0] * (2 * COPIES - 2)), NO_SLOT, np.array([True] + [False] * (COPIES - 1)))
    assert (even.games, even.points) == (11, 6.0)


def test_a_snapshot_plays_its_copy_opponents_in_one_batch_and_elo_moves_by_the_formula():
    rollout, snapshot = snapshot_playing_2_policy_1()
    sp = rollout.selfplay
    for k, opponent in enumerate([snapshot, LATEST, snapshot, LATEST]):
        sp.face(k, opponent)
    n = COPIES * 2
    obs = np.zeros((n, rollout.spec.obs_shape[0]), np.float32)
    calls = []
    act = rollout.policy.act
    rollout.policy.act = lambda x, *args: calls.append(len(x)) or act(x, *args)
    out, recorded = sp.act(obs, np.ones(n, bool), None, 0)
    # Slot 2k is copy k's learning agent (swap_sides false: the first); copies 0 and 2 face the snapshot
    # (which plays 2), copies 1 and 3 the newest weights (1, as the learning agents).
    assert out.tolist() == [1, 2, 1, 1, 1, 2, 1, 1]
    assert calls == [6]                      # the training policy acted for its 6 slots only, in one call
    assert recorded["behaviour_logprob"][[1, 5]].tolist() == [0.0, 0.0]   # the snapshot's slots: no extras
    _, direct, _ = act(obs[:6])
    assert recorded["behaviour_logprob"][[0, 2, 3, 4, 6, 7]].tolist() == direct["behaviour_logprob"].tolist()

    sp.rating = 1000.0
    snapshot.rating = 1200.0
    expected = 1 / (1 + 10 ** (200 / 400))
    sp.stepped(np.array([1.0, -1.0, 0, 0, 0, 0, 0, 0]), NO_SLOT, np.array([True, False, False, False]))   # copy 0: a win
    assert sp.rating == pytest.approx(1000.0 + 16 * (1 - expected))
    assert rollout.metrics.gauges["actor/selfplay_win_rate"] == 1.0
    sp.face(1, LATEST)
    sp.stepped(np.array([0, 0, -1.0, 1.0, 0, 0, 0, 0]), NO_SLOT, np.array([False, True, False, False]))   # copy 1: lost, to the newest
    assert sp.rating == pytest.approx(1000.0 + 16 * (1 - expected))   # (no rating change against itself)
    assert rollout.metrics.counters["actor/selfplay_losses_total"] == 1


def test_opponent_epsilon_makes_that_share_of_the_policy_opponents_moves_random():
    """Each move of an opponent that is the policy (a snapshot, or the newest weights on a side not
    recorded) is uniformly random with probability opponent_epsilon; the learning agents' moves, the
    sides record_latest records, and the random player's are left alone."""
    rollout, snapshot = snapshot_playing_2_policy_1(opponent_epsilon=0.3)
    sp = rollout.selfplay
    for k, opponent in enumerate([snapshot, LATEST, sp.random, LATEST]):
        sp.face(k, opponent)
    n = COPIES * 2
    obs = np.zeros((n, rollout.spec.obs_shape[0]), np.float32)
    rows = np.array([sp.act(obs, np.ones(n, bool), None, 0)[0] for _ in range(3000)])
    assert (rows[:, [0, 2, 4, 6]] == 1).all()                   # the learning agents: the policy's own move
    for slot, own in ((1, 2), (3, 1), (7, 1)):                  # the snapshot's side, the newest weights' sides
        # with probability 0.3 uniform over 3 moves: the policy's own 0.8, each other 0.1 (sd 0.0055: 4 sd)
        shares = np.bincount(rows[:, slot], minlength=3) / len(rows)
        assert abs(shares[own] - 0.8) < 0.025 and all(abs(shares[a] - 0.1) < 0.025 for a in range(3) if a != own), (slot, shares)
    assert abs(np.bincount(rows[:, 5], minlength=3) / len(rows) - 1 / 3).max() < 0.03   # the random player: uniform

    # record_latest, every copy against the newest weights: every side is recorded, so none is random.
    recording = Rollout(config(latest_probability=1.0, record_latest=True, opponent_epsilon=1.0), "sp", 0,
                        Metrics("actor"))
    recording.close()
    recording.policy.offer_weights(1, weights_preferring(recording, 1))
    recording.policy.swap()
    assert recording.selfplay.recorded().all()
    assert (recording.selfplay.act(obs, np.ones(n, bool), None, 0)[0] == 1).all()
    with pytest.raises(ConfigError, match=r"^selfplay.opponent_epsilon: -0.1 is invalid"):
        config(opponent_epsilon=-0.1)
    unbounded = SimpleNamespace(policy=SimpleNamespace(spec=SimpleNamespace(action=Box.of((1,), [-np.inf], [np.inf]))))
    with pytest.raises(ValueError, match=r"^selfplay.opponent_epsilon: the random player acts uniformly within"):
        SelfPlay(config(opponent_epsilon=0.1), unbounded, 1, 2, Metrics("actor"), np.random.default_rng(0))


def test_selfplay_needs_an_env_with_several_agents():
    with pytest.raises(ConfigError, match=r"selfplay.enabled: True is invalid: self-play needs an env with several"):
        config_from_dict({**TINY_PPO, "selfplay": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"selfplay.latest_probability: 1.5 is invalid"):
        config(latest_probability=1.5)


def plays_2(obs):
    """A fixed player for the tests below (tests.unit.actor.test_selfplay:plays_2)."""
    return 2


def plays_0_where_allowed(obs, mask):
    """One that takes the mask (two arguments): the first allowed move."""
    return 0 if mask is None else int(np.flatnonzero(mask)[0])


def test_fixed_players_take_their_share_of_the_other_episodes_and_play_their_copies():
    """selfplay.fixed_players: of the episodes not against the newest weights, fixed_probability are
    against one of them (uniformly); each plays its copy's opponent side with its own function, left
    alone by opponent_epsilon; its games are scored apart (its own win rate) and not rated."""
    here = "tests.unit.actor.test_selfplay"
    rollout, snapshot = snapshot_playing_2_policy_1(
        latest_probability=0.2, fixed_probability=0.5, opponent_epsilon=1.0,
        fixed_players=[f"{here}:plays_2", f"{here}:plays_0_where_allowed"])
    sp = rollout.selfplay
    twos, firsts = sp.fixed
    assert (twos.name, firsts.name) == (f"{here}:plays_2", f"{here}:plays_0_where_allowed")
    draws, counts = 6000, {"latest": 0, "snapshot": 0, "twos": 0, "firsts": 0}
    for _ in range(draws):
        sp.new_episode(0)
        o = sp.opponent[0]
        counts["latest" if o is LATEST else "snapshot" if o is snapshot else "twos" if o is twos else "firsts"] += 1
    # 0.2 the newest weights; of the other 0.8, half a fixed player (each 0.2) and half the snapshot (sd <= 0.0065: 4 sd)
    for key, share in (("latest", 0.2), ("snapshot", 0.4), ("twos", 0.2), ("firsts", 0.2)):
        assert abs(counts[key] / draws - share) < 0.026, counts

    for k, opponent in enumerate([twos, firsts, twos, snapshot]):
        sp.face(k, opponent)
    n = COPIES * 2
    obs = np.zeros((n, rollout.spec.obs_shape[0]), np.float32)
    rows = np.array([sp.act(obs, np.ones(n, bool), None, 0)[0] for _ in range(200)])
    assert (rows[:, [0, 2, 4, 6]] == 1).all()          # the learning agents: the policy's own move
    assert (rows[:, [1, 5]] == 2).all() and (rows[:, 3] == 0).all()   # the fixed players: theirs, never random
    assert len(set(rows[:, 7])) == 3                    # the snapshot's side: every move random (epsilon 1)

    # Their games: scored apart, each its own win rate, the rating unmoved.
    sp.returns[:] = 0.0
    sp.stepped(np.array([1.0, -1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0]), NO_SLOT, np.array([True, True, True, False]))
    g = rollout.metrics.gauges
    assert list(twos.recent) == [1.0, 0.5] and list(firsts.recent) == [0.0]
    assert g[f"actor/selfplay_fixed/{twos.name}_win_rate"] == 0.5
    assert g[f"actor/selfplay_fixed/{firsts.name}_win_rate"] == 0.0
    assert g["actor/selfplay_elo"] == START_ELO

    with pytest.raises(ConfigError, match=r"^selfplay.fixed_probability: 0.5 is invalid: needs selfplay.fixed_players"):
        config(fixed_probability=0.5)
    with pytest.raises(ConfigError, match=r"^selfplay.fixed_players: 'plays_2' is invalid: each must be module:function"):
        config(fixed_players=["plays_2"])
    with pytest.raises(ValueError, match=r"^selfplay.fixed_players: no_such_module:f: No module named 'no_such_module'"):
        Rollout(config(fixed_players=["no_such_module:f"], fixed_probability=0.1), "sp", 0, Metrics("actor"))


def test_a_recurrent_policy_plays_itself_with_a_state_per_slot_for_it_and_for_each_snapshot(tmp_path):
    """ppo.recurrent with self-play: the training policy keeps a state per slot it plays, so does each
    snapshot (a frozen recurrent network) for the slots it plays, each zeroed where a slot's episode ends;
    the recorded side's fragments start from the policy's state, and its learner trains on them."""
    from services.buffer.store import Store
    from services.learner.trainer import Trainer

    cfg = config_from_dict({**TINY_PPO, "env": {"id": "pettingzoo:kuberl_envs.tron", "num_envs": COPIES,
                                                "kwargs": {"size": 6}},
                            "ppo": {**TINY_PPO["ppo"], "recurrent": "gru", "recurrent_size": 4},
                            "selfplay": {"enabled": True, "snapshot_every": 1, "latest_probability": 0.0}})
    rollout = Rollout(cfg, "sp", 0, Metrics("actor"))
    sp = rollout.selfplay
    played = np.zeros(2 * COPIES, bool)   # slots a snapshot acted for, seen from outside
    try:
        frags = []
        for version in range(1, 7):
            rollout.policy.offer_weights(version, to_numpy(rollout.policy.net))
            frags.append(rollout.collect())
            while rollout._pending:
                frags.append(rollout.collect())
            for snapshot in sp.pool:
                assert snapshot.state is not None and snapshot.state.shape == (2 * COPIES, 4)
                played |= np.abs(snapshot.state).sum(axis=1) > 0
    finally:
        rollout.close()
    assert sp.pool and played.any()   # snapshots act, from states of their own
    decoded = [decode_fragment(RawFragment(m.payload), extras=("behaviour_logprob",), start_extras=("core_state",))
               for m in frags]
    assert all(f.extras["core_state"].shape == (len(f.env_ids), 4) for f in decoded)
    assert any(np.abs(f.extras["core_state"]).sum() > 0 for f in decoded)   # carried over windows
    # An ended slot's states are zeros: the policy's and every snapshot's (the next episode starts afresh).
    ended = np.ones(2 * COPIES, bool)
    sp.stepped(np.zeros(2 * COPIES), ended, None)
    assert not sp.learning.state.any() and not any(snap.state.any() for snap in sp.pool)
    store = Store(cfg, Metrics("buffer"))
    for m in frags:
        store.insert(RawFragment(m.payload))
    trainer = Trainer(cfg, Metrics("learner"), tmp_path / "learner")
    batch = store.next_batch(4, "learner")
    assert batch is not None
    trainer.train(batch)
    assert trainer.version == 1 and trainer.metrics.counters["learner/batches_invalid_total"] == 0


def league_config(**selfplay):
    return config_from_dict({**TINY_PPO, "env": {"id": "pettingzoo:kuberl_envs.tron", "num_envs": COPIES,
                                                 "kwargs": {"size": 6}},
                             "planner": {"enabled": False},
                             "policies": {"red": {"agents": ["p0"]}, "blue": {"agents": ["p1"]}},
                             "selfplay": {"enabled": True, **selfplay}})


def test_a_league_gives_each_policy_its_own_pool_and_elo_and_records_only_live_sides(tmp_path):
    """Self-play with several policies (a league, services/actor/league.py): each policy snapshots its own
    versions into its own pool; in an episode either every side is its newest weights (all recorded) or
    one policy's side learns (recorded) against the other side's snapshot (not recorded), played by that
    snapshot in one batch; a finished game moves the learning policy's Elo by the formula, against the
    rating the other policy had when its snapshot was taken."""
    from services.actor.league import EVERY_SIDE, League
    from services.buffer.store import Store
    from services.learner.trainer import Trainer

    rollout = Rollout(league_config(snapshot_every=1, latest_probability=0.0), "lg", 0, Metrics("actor"))
    league = rollout.selfplay
    assert isinstance(league, League)
    try:
        red, blue = rollout.policies["red"], rollout.policies["blue"]
        red.offer_weights(1, weights_preferring(rollout, 2))
        blue.offer_weights(1, to_numpy(blue.net))
        msgs = []
        for _ in range(3):
            msgs.append(rollout.collect())
            while rollout._pending:
                msgs.append(rollout.collect())
    finally:
        rollout.close()
    pools = league.pools
    assert [s.version for s in pools["red"].pool] == [1] and [s.version for s in pools["blue"].pool] == [1]
    assert pools["red"].pool[0] is not pools["blue"].pool[0]
    # Before the pools filled (the first episodes), every side was live; once they had snapshots, every
    # episode has one learning side and the other's snapshot.
    for k in range(COPIES):
        learner = league.learner[k]
        assert learner in ("red", "blue")
        other = "blue" if learner == "red" else "red"
        assert league.recorded[learner][k] and not league.recorded[other][k]
        assert league.opponent[other][k] in pools[other].pool and league.opponent[learner][k] is LATEST
    assert {m.policy for m in msgs} == {"red", "blue"}   # each policy's recorded side goes to its own table
    for name in ("red", "blue"):   # ... and its learner trains on it
        store = Store(rollout.cfg, Metrics("buffer"))
        for m in msgs:
            if m.policy == name:
                store.insert(RawFragment(m.payload))
        trainer = Trainer(rollout.cfg, Metrics("learner"), tmp_path / name, policy=name)
        batch = store.next_batch(4, "learner")
        assert batch is not None
        trainer.train(batch)
        assert trainer.version == 1 and trainer.metrics.counters["learner/batches_invalid_total"] == 0
    # Elo: a red win against blue's snapshot, rated 1000 when taken.
    k = 0
    league.learner[0], league.opponent["blue"][0] = "red", pools["blue"].pool[0]
    before = pools["red"].rating
    snap = pools["blue"].pool[0]
    expected = 1.0 / (1.0 + 10.0 ** ((snap.rating - before) / 400.0))
    games = rollout.metrics.counters["actor/policies/red/selfplay_games_total"]
    league.returns["red"][:], league.returns["blue"][:] = 0.0, 0.0
    over = np.zeros(COPIES, bool)
    over[k] = True
    league.stepped("red", np.eye(1, COPIES, k)[0], np.zeros(COPIES, bool), over)
    league.stepped("blue", np.zeros(COPIES), np.zeros(COPIES, bool), over)
    assert pools["red"].rating == pytest.approx(before + league.sp.elo_k * (1.0 - expected))
    assert rollout.metrics.counters["actor/policies/red/selfplay_games_total"] == games + 1
    assert rollout.metrics.counters["actor/policies/red/selfplay_wins_total"] >= 1
    assert rollout.metrics.gauges["actor/policies/red/selfplay_elo"] == pools["red"].rating
    assert snap.games >= 1
    # Every side live: all recorded, no rating moves.
    league.learner[1] = EVERY_SIDE
    for name in ("red", "blue"):
        league.opponent[name][1] = LATEST
        league.recorded[name][1] = league.live[name][1] = True
    ratings = {n: p.rating for n, p in pools.items()}
    over = np.array([False, True] + [False] * (COPIES - 2))
    league.stepped("red", np.zeros(COPIES), np.zeros(COPIES, bool), over)
    league.stepped("blue", np.eye(1, COPIES, 1)[0], np.zeros(COPIES, bool), over)
    assert {n: p.rating for n, p in pools.items()} == ratings


def test_a_leagues_snapshot_plays_its_sides_slots_in_one_batch():
    """In a league the other side's slots are played by that side's own snapshot (its policy's weights
    as they were), one call for every copy facing it; the learning side by its newest weights."""
    rollout = Rollout(league_config(snapshot_every=1, latest_probability=0.0), "lg", 0, Metrics("actor"))
    rollout.close()
    league = rollout.selfplay
    red, blue = rollout.policies["red"], rollout.policies["blue"]
    blue.offer_weights(1, weights_preferring(rollout, 2))
    blue.swap()
    league.seats["blue"].swapped()
    (snapshot,) = league.pools["blue"].pool
    blue.offer_weights(2, weights_preferring(rollout, 0))
    blue.swap()
    red.offer_weights(1, weights_preferring(rollout, 1))
    red.swap()
    for k in range(COPIES):   # red learns everywhere, blue's side is its snapshot (it plays 2; blue now 0)
        league.learner[k] = "red"
        league.opponent["blue"][k] = snapshot
        league.recorded["red"][k] = league.live["red"][k] = True
        league.recorded["blue"][k] = league.live["blue"][k] = False
    calls = []
    act = snapshot.acting.act
    snapshot.acting.act = lambda x, *args, **kw: calls.append(len(x)) or act(x, *args, **kw)
    obs = np.zeros((COPIES, *rollout.spec.obs_shape), rollout.spec.obs_dtype)
    present = np.ones(COPIES, bool)
    red_actions, extras = league.seats["red"].act(obs, present, None, 0)
    blue_actions, blue_extras = league.seats["blue"].act(obs, present, None, 0)
    assert (red_actions == 1).all() and set(extras) == {"behaviour_logprob"}
    assert (blue_actions == 2).all() and calls == [COPIES] and not blue_extras

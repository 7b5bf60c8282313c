"""services/buffer/store.py: dedupe, storage, batch cutting and accounting of the buffer."""

from __future__ import annotations

import numpy as np
import pytest

from kuberl.v1 import common_pb2 as pb
from services.common.protocol.fragments import batch_samples
from services.buffer.store import MAX_INCARNATIONS_PER_ACTOR, SEQ_WINDOW, Outcome, SeqWindow, Store
from services.config import config_from_dict
from services.common.stats import Metrics
from services.common.protocol.tensors import TensorError, decode
from tests.unit.fragment_factory import DQN, PPO, make_msg

T, N = 4, 2  # fragments of 8 samples


def dqn_store(**dqn) -> Store:
    """One-step returns unless `n_step` says otherwise: rows are the fragments' steps as they came."""
    cfg = config_from_dict({"algorithm": "dqn", "env": {"num_envs": N},
                            "dqn": {"buffer_size": 256, "batch_size": 8, "learning_starts": 16,
                                    "rollout_steps": T, "n_step": 1, **dqn}})
    return Store(cfg, Metrics("buffer"))


def ppo_store(fifo_capacity_steps: int = 1024) -> Store:
    cfg = config_from_dict({"algorithm": "ppo", "env": {"num_envs": N},
                            "ppo": {"rollout_steps": T, "batch_steps": 8, "num_minibatches": 1},
                            "buffer": {"fifo_capacity_steps": fifo_capacity_steps}})
    return Store(cfg, Metrics("buffer"))


def dqn_msg(seq=0, actor_id="actor-0", **kw):
    return make_msg(T, N, algorithm=DQN, seq=seq, actor_id=actor_id, base=10 * seq, **kw)


def ppo_msg(seq=0, actor_id="actor-0", **kw):
    return make_msg(T, N, algorithm=PPO, seq=seq, actor_id=actor_id, base=10 * seq, **kw)


def counter(store: Store, name: str) -> float:
    return store.metrics.counters[f"buffer/{name}"]


def transitions(batch: pb.TrainingBatch) -> dict[str, np.ndarray]:
    return {f.name: decode(getattr(batch.transitions, f.name), f.name)
            for f in pb.TransitionBatch.DESCRIPTOR.fields if batch.transitions.HasField(f.name)}


# --- SeqWindow ----------------------------------------------------------------------------------

def test_seq_window_exact_within_window():
    w = SeqWindow()
    assert w.high == -1
    assert w.outcome(0) is Outcome.ACCEPTED
    for seq in (5, 3, 9):
        w.add(seq)
    assert w.high == 9
    assert [s for s in range(12) if w.outcome(s) is Outcome.DUPLICATE] == [3, 5, 9]


def test_seq_window_refuses_seqs_far_below_high_water_as_too_old():
    w = SeqWindow()
    high = 3 * SEQ_WINDOW
    w.add(high)
    assert w.outcome(high - SEQ_WINDOW) is Outcome.TOO_OLD
    assert w.outcome(0) is Outcome.TOO_OLD
    assert w.outcome(high - SEQ_WINDOW + 1) is Outcome.ACCEPTED
    assert w.outcome(high - 1) is Outcome.ACCEPTED


def test_seq_window_pruning_keeps_answers_consistent():
    w = SeqWindow()
    for seq in range(2 * SEQ_WINDOW + 10):
        w.add(seq)
    assert all(w.outcome(s) is not Outcome.ACCEPTED for s in range(2 * SEQ_WINDOW + 10))
    assert w.outcome(2 * SEQ_WINDOW + 10) is Outcome.ACCEPTED


# --- insert / dedupe ----------------------------------------------------------------------------

def test_new_store_reports_zero_counters():
    store = dqn_store()
    for name in ("fragments_duplicate_total", "fragments_too_old_total", "fragments_invalid_total",
                 "fragments_evicted_total", "batches_unsent_total", "dedupe_windows_forgotten_total"):
        assert store.metrics.snapshot()[f"buffer/{name}"] == 0.0
    assert store.size == 0
    assert store.high_water("actor-0", 0) is None


def test_accepted_fragment_is_counted():
    store = dqn_store()
    assert store.insert(dqn_msg(0, policy_version=4)) is Outcome.ACCEPTED
    assert store.size == T * N
    assert store.inserted_samples == T * N
    assert counter(store, "fragments_received_total") == 1
    assert counter(store, "samples_received_total") == T * N
    assert store.metrics.gauges["buffer/policy_version_newest"] == 4


@pytest.mark.parametrize("make_store,make", [(dqn_store, dqn_msg), (ppo_store, ppo_msg)])
def test_duplicate_is_counted_and_not_stored_twice(make_store, make):
    store = make_store()
    assert store.insert(make(0)) is Outcome.ACCEPTED
    assert store.insert(make(0)) is Outcome.DUPLICATE
    assert counter(store, "fragments_duplicate_total") == 1
    assert counter(store, "fragments_received_total") == 1
    assert store.size == T * N
    assert store.inserted_samples == T * N


def test_same_seq_from_different_actors_is_stored_for_both():
    store = ppo_store()
    assert store.insert(ppo_msg(0, actor_id="a")) is Outcome.ACCEPTED
    assert store.insert(ppo_msg(0, actor_id="b")) is Outcome.ACCEPTED
    assert store.size == 2 * T * N
    assert counter(store, "fragments_duplicate_total") == 0


def test_seq_far_below_high_water_is_refused_as_too_old_never_called_a_duplicate():
    store = dqn_store()
    store.insert(dqn_msg(SEQ_WINDOW + 5))
    assert store.insert(dqn_msg(3)) is Outcome.TOO_OLD
    assert store.insert(dqn_msg(SEQ_WINDOW)) is Outcome.ACCEPTED  # still inside the exact window
    assert counter(store, "fragments_too_old_total") == 1
    assert counter(store, "fragments_duplicate_total") == 0
    assert store.size == 2 * T * N


@pytest.mark.parametrize("make_store,make", [(dqn_store, dqn_msg), (ppo_store, ppo_msg)])
def test_a_restarted_actor_under_the_same_id_is_stored_not_taken_for_duplicates(make_store, make):
    """kill -9 of an actor: its successor keeps the actor id, starts seq at 0 with a new incarnation."""
    store = make_store()
    for seq in range(5):
        assert store.insert(make(seq, incarnation=111)) is Outcome.ACCEPTED
    for seq in range(3):  # the new process
        assert store.insert(make(seq, incarnation=222)) is Outcome.ACCEPTED
    assert store.insert(make(1, incarnation=222)) is Outcome.DUPLICATE  # its own re-send still dedupes
    assert store.insert(make(4, incarnation=111)) is Outcome.DUPLICATE  # and so does the old one's
    assert store.inserted_samples == 8 * T * N
    assert counter(store, "fragments_received_total") == 8
    assert counter(store, "fragments_duplicate_total") == 2
    assert store.high_water("actor-0", 111) == 4
    assert store.high_water("actor-0", 222) == 2
    assert store.high_water("actor-0", 333) is None


def test_old_incarnations_are_forgotten_beyond_the_bound_and_counted():
    store = ppo_store()
    for inc in range(1, MAX_INCARNATIONS_PER_ACTOR + 2):
        store.insert(ppo_msg(0, incarnation=inc))
    assert store.high_water("actor-0", 1) is None  # the oldest window went
    assert all(store.high_water("actor-0", inc) == 0 for inc in range(2, MAX_INCARNATIONS_PER_ACTOR + 2))
    assert counter(store, "dedupe_windows_forgotten_total") == 1
    assert store.metrics.snapshot()["buffer/actors_known"] == 1


def test_dedupe_state_round_trips_into_a_new_store():
    store = ppo_store()
    for seq in (0, 1, 5):
        store.insert(ppo_msg(seq, actor_id="a", incarnation=7))
    store.insert(ppo_msg(0, actor_id="b", incarnation=2**64 - 1))
    state = store.dedupe_state()
    assert all(arr.dtype != object for arr in state.values())  # saved without pickle
    fresh = ppo_store()
    fresh.restore_dedupe_state(state)
    assert [fresh.insert(ppo_msg(s, actor_id="a", incarnation=7)) for s in (0, 1, 2, 5)] == [
        Outcome.DUPLICATE, Outcome.DUPLICATE, Outcome.ACCEPTED, Outcome.DUPLICATE]
    assert fresh.insert(ppo_msg(0, actor_id="b", incarnation=2**64 - 1)) is Outcome.DUPLICATE
    assert fresh.high_water("a", 7) == 5
    bad = dict(state, recent=state["recent"][:-1])
    with pytest.raises(ValueError, match="lengths disagree"):
        fresh.restore_dedupe_state(bad)


def test_high_water_reports_highest_seq():
    store = ppo_store()
    assert store.high_water("a", 0) is None
    for seq in (3, 1, 7, 5):
        store.insert(ppo_msg(seq, actor_id="a"))
    store.insert(ppo_msg(7, actor_id="a"))  # duplicate
    assert store.high_water("a", 0) == 7
    assert store.high_water("b", 0) is None
    store.insert(ppo_msg(0, actor_id="b"))
    assert store.high_water("b", 0) == 0


def test_fragment_for_other_algorithm_is_refused():
    store = dqn_store()
    with pytest.raises(TensorError, match="fragment is for ppo but this receiver serves dqn") as e:
        store.insert(ppo_msg(0))
    assert e.value.field == "algorithm"
    assert store.size == 0
    assert store.high_water("actor-0", 0) is None
    assert counter(store, "fragments_received_total") == 0


def test_refused_fragment_stores_nothing_and_its_seq_stays_free():
    store = dqn_store()
    store.insert(dqn_msg(0))
    with pytest.raises(TensorError) as e:
        store.insert(make_msg(T, N, obs_shape=(5,), algorithm=DQN, seq=1))
    assert e.value.field == "obs"
    assert store.size == T * N
    assert store.high_water("actor-0", 0) == 0
    assert store.insert(dqn_msg(1)) is Outcome.ACCEPTED


def test_malformed_fragment_is_refused():
    store = ppo_store()
    msg = ppo_msg(0)
    msg.ClearField("extras")
    with pytest.raises(TensorError) as e:
        store.insert(msg)
    assert e.value.field == "extras.behaviour_logprob"
    assert store.size == 0


# --- DQN batches --------------------------------------------------------------------------------

def test_dqn_warms_up_until_learning_starts():
    store = dqn_store(replay_ratio=0.0)  # unpaced: served as soon as the warm-up is stored
    store.insert(dqn_msg(0))  # 8 < learning_starts = 16
    assert store.next_batch(8) is None
    assert store.wait_reason == "warming up"
    store.insert(dqn_msg(1))
    batch = store.next_batch(8)
    assert batch is not None
    assert batch.WhichOneof("kind") == "transitions"
    assert batch.buffer_inserted_total == 16
    assert batch.buffer_size == 16
    rows = transitions(batch)
    assert {k: v.shape for k, v in rows.items()} == {
        "obs": (8, 3), "actions": (8,), "rewards": (8,), "next_obs": (8, 3), "terminated": (8,),
        "policy_version": (8,)}
    assert rows["obs"].dtype == np.float32 and rows["terminated"].dtype == np.bool_
    inserted = set(range(8)) | set(range(10, 18))
    assert set(rows["rewards"].tolist()) <= inserted
    np.testing.assert_array_equal(rows["obs"][:, 0], rows["rewards"] * 10)
    np.testing.assert_array_equal(rows["next_obs"], rows["obs"] + 10 * N)
    assert store.served_samples == 8
    assert counter(store, "samples_served_total") == 8
    assert counter(store, "batches_served_total") == 1


def test_dqn_waits_for_a_full_batch_even_past_learning_starts():
    store = dqn_store()
    store.insert(dqn_msg(0))
    store.insert(dqn_msg(1))
    assert store.next_batch(32) is None
    assert store.wait_reason == "warming up"


def test_dqn_paced_by_replay_ratio_counted_from_the_end_of_the_warm_up():
    store = dqn_store(replay_ratio=1.0)
    store.insert(dqn_msg(0))
    store.insert(dqn_msg(1))  # 16 inserted = learning_starts: the warm-up is not production
    assert store.next_batch(8) is None
    assert store.wait_reason == "paced"
    store.insert(dqn_msg(2))  # 8 produced: at ratio 1, one batch of 8
    assert store.next_batch(8) is not None
    assert store.next_batch(8) is None
    assert store.wait_reason == "paced"
    assert store.served_samples == 8
    store.insert(dqn_msg(3))
    assert store.next_batch(8) is not None
    assert store.next_batch(8) is None
    assert store.wait_reason == "paced"


def test_dqn_ratio_zero_serves_without_limit():
    store = dqn_store(replay_ratio=0.0)
    store.insert(dqn_msg(0))
    store.insert(dqn_msg(1))
    assert all(store.next_batch(8) is not None for _ in range(50))
    assert store.served_samples == 400


# --- PPO batches --------------------------------------------------------------------------------

def served_seqs(batch: pb.TrainingBatch) -> list[int]:
    assert batch.WhichOneof("kind") == "rollouts"
    return [f.seq for f in batch.rollouts.fragments]


def test_ppo_batches_are_whole_fragments_each_served_once():
    store = ppo_store()
    msgs = [ppo_msg(seq) for seq in range(3)]
    for m in msgs:
        store.insert(m)
    batch = store.next_batch(12)
    assert served_seqs(batch) == [0, 1]
    assert list(batch.rollouts.fragments) == msgs[:2]
    assert batch_samples(batch) == 16
    assert batch.buffer_size == 8
    assert batch.buffer_inserted_total == 24
    assert store.next_batch(12) is None
    assert store.wait_reason == "empty"
    store.insert(ppo_msg(3))
    assert served_seqs(store.next_batch(12)) == [2, 3]
    assert store.next_batch(1) is None
    assert store.served_samples == 32
    assert counter(store, "samples_served_total") == 32


def test_ppo_empty_store_waits():
    store = ppo_store()
    assert store.next_batch(8) is None
    assert store.wait_reason == "empty"


def test_ppo_fifo_eviction_is_counted():
    store = ppo_store(fifo_capacity_steps=16)
    for seq in range(3):
        store.insert(ppo_msg(seq))
    assert counter(store, "fragments_evicted_total") == 1
    assert counter(store, "samples_evicted_total") == T * N
    assert store.size == 16
    assert served_seqs(store.next_batch(16)) == [1, 2]
    # every sample accepted is stored, served or counted as evicted
    assert store.inserted_samples == store.served_samples + store.size + counter(store, "samples_evicted_total")


def test_an_unsent_ppo_batch_goes_back_to_the_front_of_the_fifo():
    """A FIFO's batch took its fragments out: if its learner went away before it was sent, they go
    back where they came from, first for the next learner, and the draw is not counted as served."""
    store = ppo_store()
    for seq in range(3):
        store.insert(ppo_msg(seq))
    store.unserve("l", store.next_batch(16, "l"))
    assert counter(store, "batches_unsent_total") == 1
    assert store.size == 24 and store.served_samples == 0 and store.in_flight("l") == 0
    assert served_seqs(store.next_batch(24, "m")) == [0, 1, 2]
    # every sample accepted is stored, served or counted as evicted
    assert store.inserted_samples == store.served_samples + store.size + counter(store, "samples_evicted_total")


def test_an_unsent_ppo_batch_is_evicted_and_counted_if_the_fifo_filled_meanwhile():
    store = ppo_store(fifo_capacity_steps=16)
    for seq in range(2):
        store.insert(ppo_msg(seq))
    batch = store.next_batch(8)
    store.insert(ppo_msg(2))           # the FIFO holds 1 and 2: full
    store.unserve("l", batch)          # 0 goes back in front of them: the oldest, evicted
    assert counter(store, "samples_evicted_total") == T * N and counter(store, "fragments_evicted_total") == 1
    assert served_seqs(store.next_batch(16)) == [1, 2]
    assert store.inserted_samples == store.served_samples + store.size + counter(store, "samples_evicted_total")


def test_an_unsent_replay_batch_loses_nothing_and_its_draw_is_taken_back():
    """A replay's batch only drew rows the replay still holds: nothing is lost, and the rate limiter
    may serve the draw again (it was never trained on), so the replay ratio holds."""
    store = dqn_store(replay_ratio=1.0)
    for seq in range(3):   # 16 to warm up, 8 produced: one batch of 8 at ratio 1
        store.insert(dqn_msg(seq))
    batch = store.next_batch(8)
    assert store.next_batch(8) is None and store.wait_reason == "paced"
    store.unserve("l", batch)
    assert counter(store, "batches_unsent_total") == 1
    assert store.size == 24 and store.served_samples == 0
    assert store.next_batch(8) is not None   # the draw taken back is served again
    assert store.next_batch(8) is None and store.wait_reason == "paced"


def test_gauges():
    store = dqn_store(replay_ratio=0.0, learning_starts=8)
    assert store.gauges()["buffer/samples_per_insert"] == 0.0
    store.insert(dqn_msg(0, actor_id="a"))
    store.insert(dqn_msg(0, actor_id="b"))
    store.next_batch(8)
    store.next_batch(8)
    g = store.gauges()
    assert g["buffer/size_samples"] == 16
    assert g["buffer/samples_per_insert"] == 2.0  # 16 served / 8 inserted after the warm-up of 8
    assert g["buffer/actors_known"] == 2


def _reference(high: int, stored: set[int], seq: int) -> Outcome:
    """The window's rule written naively: exact within SEQ_WINDOW seqs of the newest, too old beyond."""
    if seq > high:
        return Outcome.ACCEPTED
    if seq <= high - SEQ_WINDOW:
        return Outcome.TOO_OLD
    return Outcome.DUPLICATE if seq in stored else Outcome.ACCEPTED


def test_the_bit_ring_window_agrees_with_a_naive_set_on_random_sequences():
    import random

    rng = random.Random(0)
    W = SEQ_WINDOW
    for _ in range(20):
        w, stored, high, nxt = SeqWindow(), set(), -1, 0
        for _ in range(2000):
            r = rng.random()
            if r < 0.6:                      # in order
                seq, nxt = nxt, nxt + 1
            elif r < 0.8:                    # a re-send, inside or beyond the window
                seq = max(0, nxt - rng.randint(1, 3 * W // 2))
            elif r < 0.9:                    # a jump of about a window
                nxt += rng.choice([W - 1, W, W + 1, rng.randint(1, 3 * W)])
                seq = nxt
            else:                            # right at the window's edge
                seq = max(0, nxt - rng.randint(W - 2, W + 2))
            got = w.outcome(seq)
            assert got is _reference(high, stored, seq)
            if got is Outcome.ACCEPTED:
                w.add(seq)
                stored.add(seq)
                high = max(high, seq)
        assert w.recent == sorted(s for s in stored if s > high - W)
        assert SeqWindow.of(w.high, w.recent).recent == w.recent


def test_the_window_covers_every_send_queue_config_allows():
    from services.config import ConfigError, config_from_dict
    from services.common.protocol.fragments import DEDUPE_WINDOW

    assert SEQ_WINDOW == DEDUPE_WINDOW
    config_from_dict({"actor": {"queue_fragments": DEDUPE_WINDOW}})
    with pytest.raises(ConfigError, match="actor.queue_fragments: 65537 is invalid: must be 1..65536"):
        config_from_dict({"actor": {"queue_fragments": DEDUPE_WINDOW + 1}})


def test_a_reporting_learner_is_served_at_most_prefetch_plus_one_batches_ahead():
    """buffer.batch_prefetch 2: three batches in flight, then none until the learner reports one
    trained on; a learner that never reports (a plain client) is not held to it."""
    store = dqn_store(replay_ratio=0.0)
    for seq in range(4):
        store.insert(dqn_msg(seq))
    store.report_progress("l", 0, 0)
    assert all(store.next_batch(8, "l") is not None for _ in range(3))
    assert store.next_batch(8, "l") is None and store.wait_reason == "prefetched"
    store.report_progress("l", 1, 1)
    assert store.next_batch(8, "l") is not None
    assert store.next_batch(8, "l") is None and store.wait_reason == "prefetched"
    assert all(store.next_batch(8, "other") is not None for _ in range(10))


def test_learners_silent_for_long_are_forgotten_and_unreported_ids_are_bounded(monkeypatch):
    """Restarted learners come back under new ids: a long run must not keep every id it saw."""
    from services.buffer import store as store_module
    monkeypatch.setattr(store_module, "MAX_UNREPORTED", 2)
    store = ppo_store()
    store.report_progress("old", 3, 3, now=0.0)
    store.report_progress("recent", 5, 5, now=store_module.LEARNER_FORGET_S - 1)
    for lid in ("s1", "s2", "s3"):   # served, never reporting
        store._served_to[lid] = 1
    store.report_progress("new", 0, 0, now=store_module.LEARNER_FORGET_S + 1)
    assert set(store._learners) == {"recent", "new"}
    assert "old" not in store._served_to
    assert set(store._served_to) - set(store._learners) == {"s2", "s3"}   # the newest two kept

"""services/learner/trainer.py: the learner-side staleness bound (drop or V-trace correction), the
learner/policy_lag histogram, skipped and malformed batches."""

from __future__ import annotations

import numpy as np
import pytest

from kuberl.v1 import common_pb2 as pb
from services.buffer.store import Store
from services.config import config_from_dict
from services.common.protocol.fragments import decode_fragment
from services.common.stats import Metrics
from services.learner.trainer import Trainer
from tests.unit.fragment_factory import PPO, make_msg

N = 2


def ppo_config(**ppo):
    return config_from_dict({"algorithm": "ppo", "env": {"num_envs": N},
                             "ppo": {"max_policy_lag": 1, "stale_fragments": "drop", "rollout_steps": 4,
                                     "batch_steps": 8, "num_epochs": 1,
                                     "num_minibatches": 2, "hidden_sizes": [8], **ppo}})


@pytest.fixture
def make_trainer(tmp_path):
    def make(**ppo) -> Trainer:
        return Trainer(ppo_config(**ppo), Metrics("learner"), tmp_path / "ckpt")
    return make


def msg(seq: int, version: int, steps: int = 4) -> pb.TrajectoryFragment:
    """A CartPole-shaped fragment (obs [T+1, 2, 4] float32, actions 0/1 int64) of steps * 2 samples."""
    return make_msg(steps, N, obs_shape=(4,), algorithm=PPO, seq=seq, policy_version=version, base=seq * 100,
                    terminated=[(0, 1)], truncated=[(steps - 1, 0)])


def batch_of(*msgs: pb.TrajectoryFragment, batch_id: int = 0) -> pb.TrainingBatch:
    return pb.TrainingBatch(batch_id=batch_id, rollouts=pb.RolloutBatch(fragments=list(msgs)))


def counter(trainer: Trainer, name: str) -> float:
    return trainer.metrics.counters[f"learner/{name}"]


def record_updates(trainer: Trainer) -> list[tuple[list[int], list[bool] | None]]:
    """Wrap algo.update to record (policy versions, correct flags) of each call, then run it."""
    calls = []
    update = trainer.algo.update

    def spy(fragments, correct=None):
        calls.append(([f.policy_version for f in fragments], None if correct is None else list(correct)))
        return update(fragments, correct)

    trainer.algo.update = spy
    return calls


def lags(trainer: Trainer) -> list[float]:
    return list(trainer.lag.recent._values)


# lags 0, 1, 3 at version 3 with 8, 4 and 6 samples
MIXED = ((0, 3, 4), (1, 2, 2), (2, 0, 3))  # (seq, policy_version, steps)


def mixed_batch() -> pb.TrainingBatch:
    return batch_of(*(msg(seq, v, steps) for seq, v, steps in MIXED))


def test_new_trainer_reports_zero_counters(make_trainer):
    trainer = make_trainer()
    snap = trainer.metrics.snapshot()
    for name in ("fragments_dropped_stale", "samples_dropped_stale", "fragments_corrected", "batches_skipped",
                 "batches_invalid"):
        assert snap[f"learner/{name}_total"] == 0.0
    assert trainer.version == 0
    assert trainer.metrics.histograms["learner/policy_lag"] is trainer.lag


def test_drops_only_fragments_beyond_max_lag(make_trainer):
    trainer = make_trainer()
    trainer.algo.version = 3
    calls = record_updates(trainer)
    trainer.train(mixed_batch())
    assert calls == [([3, 2], [False, False])]
    assert counter(trainer, "fragments_dropped_stale_total") == 1
    assert counter(trainer, "samples_dropped_stale_total") == 6
    assert counter(trainer, "fragments_corrected_total") == 0
    assert counter(trainer, "batches_skipped_total") == 0
    assert trainer.version == 4
    assert trainer.algo.gradient_steps == 2  # 1 epoch x 2 minibatches
    assert counter(trainer, "updates_total") == 1
    assert counter(trainer, "samples_total") == 8 + 4
    assert counter(trainer, "batches_total") == 1
    assert trainer.metrics.gauges["learner/policy_version"] == 4
    for stat in ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac"):
        assert np.isfinite(trainer.metrics.gauges[f"learner/{stat}"])


def test_policy_lag_histogram_holds_every_fragment_weighted_by_samples(make_trainer):
    trainer = make_trainer()
    trainer.algo.version = 3
    trainer.train(mixed_batch())
    assert lags(trainer) == [0.0] * 8 + [1.0] * 4 + [3.0] * 6  # the dropped one too
    assert trainer.lag.count == 18
    assert trainer.lag.sum == 0 * 8 + 1 * 4 + 3 * 6
    assert trainer.lag.cumulative()[:4] == [("0", 8), ("1", 12), ("2", 12), ("4", 18)]
    snap = trainer.metrics.snapshot()
    assert snap["learner/policy_lag_mean"] == pytest.approx(22 / 18)
    assert snap["learner/policy_lag_max"] == 3.0


def test_lag_exactly_max_is_kept(make_trainer):
    trainer = make_trainer(max_policy_lag=2)
    trainer.algo.version = 5
    calls = record_updates(trainer)
    trainer.train(batch_of(msg(0, 3), msg(1, 2)))  # lags 2 and 3
    assert calls == [([3], [False])]
    assert counter(trainer, "fragments_dropped_stale_total") == 1


def test_correct_mode_keeps_stale_fragments_for_vtrace(make_trainer):
    trainer = make_trainer(stale_fragments="correct")
    trainer.algo.version = 3
    calls = record_updates(trainer)
    trainer.train(mixed_batch())
    assert calls == [([3, 2, 0], [False, False, True])]
    assert counter(trainer, "fragments_corrected_total") == 1
    assert counter(trainer, "fragments_dropped_stale_total") == 0
    assert counter(trainer, "samples_dropped_stale_total") == 0
    assert trainer.version == 4
    assert counter(trainer, "samples_total") == 18
    assert lags(trainer) == [0.0] * 8 + [1.0] * 4 + [3.0] * 6


def test_no_bound_keeps_everything(make_trainer):
    trainer = make_trainer(max_policy_lag=None)
    trainer.algo.version = 100
    calls = record_updates(trainer)
    trainer.train(mixed_batch())
    assert calls == [([3, 2, 0], [False, False, False])]
    assert counter(trainer, "fragments_dropped_stale_total") == 0
    assert trainer.version == 101


def test_batch_of_only_stale_fragments_is_skipped(make_trainer):
    trainer = make_trainer()
    trainer.algo.version = 3
    calls = record_updates(trainer)
    trainer.train(batch_of(msg(0, 0), msg(1, 1)))  # lags 3 and 2
    assert calls == []
    assert counter(trainer, "batches_skipped_total") == 1
    assert counter(trainer, "fragments_dropped_stale_total") == 2
    assert counter(trainer, "samples_dropped_stale_total") == 16
    assert trainer.version == 3
    assert trainer.algo.gradient_steps == 0
    assert counter(trainer, "samples_total") == 0
    assert counter(trainer, "updates_total") == 0
    assert lags(trainer) == [3.0] * 8 + [2.0] * 8


def test_consecutive_batches_are_judged_at_the_advancing_version(make_trainer):
    trainer = make_trainer()
    calls = record_updates(trainer)
    trainer.train(batch_of(msg(0, 0)))  # version 0 -> 1
    trainer.train(batch_of(msg(1, 0)))  # lag 1: kept, 1 -> 2
    trainer.train(batch_of(msg(2, 0)))  # lag 2: dropped, skipped
    assert [c[0] for c in calls] == [[0], [0]]
    assert trainer.version == 2
    assert counter(trainer, "batches_skipped_total") == 1
    assert lags(trainer) == [0.0] * 8 + [1.0] * 8 + [2.0] * 8


def test_malformed_batch_is_counted_and_skipped(make_trainer):
    trainer = make_trainer()
    bad = msg(1, 0)
    bad.rewards.data = bad.rewards.data[:-4]  # one float short of its shape
    calls = record_updates(trainer)
    trainer.train(batch_of(msg(0, 0), bad, batch_id=7))  # must not raise
    assert counter(trainer, "batches_invalid_total") == 1
    assert calls == []
    assert trainer.version == 0
    assert trainer.lag.count == 0
    assert counter(trainer, "batches_total") == 0
    # the trainer is still usable
    trainer.train(batch_of(msg(2, 0)))
    assert trainer.version == 1
    assert counter(trainer, "batches_invalid_total") == 1


@pytest.mark.parametrize("breakage", ["missing_logprob", "dqn_fragment", "bad_final_index", "nan_reward"])
def test_other_malformed_fragments_are_counted(make_trainer, breakage):
    trainer = make_trainer()
    m = msg(0, 0)
    if breakage == "missing_logprob":
        m.ClearField("extras")
    elif breakage == "dqn_fragment":
        m = make_msg(4, N, obs_shape=(4,), algorithm=pb.ALGORITHM_DQN)
    elif breakage == "bad_final_index":
        m.final_index.data = np.array([0, 1], np.int64).tobytes()
    else:
        rewards = np.ones((4, N), np.float32)
        rewards[1, 1] = np.nan
        m.rewards.data = rewards.tobytes()
    trainer.train(batch_of(m))
    # (NaN or infinity is counted apart: services/algorithms/checks.py, docs/reliability.md)
    assert counter(trainer, "batches_nonfinite_total" if breakage == "nan_reward" else "batches_invalid_total") == 1
    assert trainer.version == 0


def test_fragment_that_does_not_fit_the_env_is_counted_not_raised(make_trainer):
    trainer = make_trainer()
    wrong = make_msg(4, N, obs_shape=(3,), algorithm=PPO)
    trainer.train(batch_of(wrong))
    assert counter(trainer, "batches_invalid_total") == 1


def test_action_out_of_range_is_counted_not_raised(make_trainer):
    trainer = make_trainer()
    m = msg(0, 0)
    m.actions.data = np.full((4, N), 2, np.int64).tobytes()
    decode_fragment(m)  # valid on the wire
    trainer.train(batch_of(m))
    assert counter(trainer, "batches_invalid_total") == 1


# --- buffer and learner together ----------------------------------------------------------------

def test_buffer_projection_after_the_learner_drops_a_stale_batch(make_trainer):
    cfg = ppo_config()
    store = Store(cfg, Metrics("buffer"))
    trainer = make_trainer()
    trainer.algo.version = 5  # e.g. restored from a checkpoint
    store.insert(msg(0, 0))
    batch = store.next_batch(8, "l")  # no progress report yet: the buffer cannot judge it
    trainer.train(batch)              # lag 5: dropped at consumption
    assert counter(trainer, "batches_skipped_total") == 1
    # the learner has consumed every batch it was served; report as learner/loops.py does
    store.report_progress("l", trainer.version, int(trainer.metrics.counters["learner/batches_consumed_total"]))
    assert store.learner_version == trainer.version

"""A batch the buffer cut for a learner that went away before it was written (StreamBatches,
services/buffer/loops.py: serve_batches): nothing of it is lost. A FIFO's fragments go to the next learner; a replay's draw is
taken back from the rate limiter. Inline and on the store's owner thread (`buffer.store_thread`)."""

from __future__ import annotations

import asyncio

import pytest

from kuberl.v1 import buffer_pb2
from kuberl.v1 import common_pb2 as pb
from services.buffer.owner import StoreOwner
from services.buffer.servicer import BufferServicer
from tests.unit.buffer.test_store import T, N, dqn_msg, dqn_store, ppo_msg, ppo_store


class GoneAway(Exception):
    """What grpcio raises writing to a call whose peer ended it (it has no public type)."""


class Stream:
    def __init__(self, fail: bool):
        self.fail, self.written = fail, []

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")

    async def write(self, msg):
        if self.fail:
            raise GoneAway("the learner went away")
        self.written.append(msg)


def request(learner: str, algorithm: int, batch_size: int) -> buffer_pb2.BatchRequest:
    return buffer_pb2.BatchRequest(learner_id=learner, algorithm=algorithm, batch_size=batch_size, max_batches=1)


@pytest.mark.parametrize("threaded", [False, True])
def test_a_fifo_batch_not_delivered_goes_to_the_next_learner(threaded):
    async def run():
        store = ppo_store()
        s = BufferServicer(store, store.metrics, StoreOwner(threaded=threaded))
        for seq in range(3):
            await s.run(store.insert, ppo_msg(seq))
        await s.StreamBatches(request("gone", pb.ALGORITHM_PPO, 2 * T * N), Stream(fail=True))
        await s.run(lambda: None)   # after the store took the batch back (posted to its owner)
        other = Stream(fail=False)
        await s.StreamBatches(request("next", pb.ALGORITHM_PPO, 3 * T * N), other)
        s.run.close()
        return store, other.written
    store, written = asyncio.run(run())
    assert [[f.seq for f in b.rollouts.fragments] for b in written] == [[0, 1, 2]]
    stats = store.metrics.snapshot()
    assert stats["buffer/batches_unsent_total"] == 1 and stats["buffer/samples_evicted_total"] == 0
    assert store.served_samples == 3 * T * N == store.inserted_samples


@pytest.mark.parametrize("threaded", [False, True])
def test_a_replay_batch_not_delivered_is_served_again_within_the_replay_ratio(threaded):
    async def run():
        store = dqn_store(replay_ratio=1.0)
        s = BufferServicer(store, store.metrics, StoreOwner(threaded=threaded))
        for seq in range(3):   # 16 to warm up, then 8: one batch of 8 at ratio 1
            await s.run(store.insert, dqn_msg(seq))
        await s.StreamBatches(request("gone", pb.ALGORITHM_DQN, 8), Stream(fail=True))
        await s.run(lambda: None)
        other = Stream(fail=False)
        await s.StreamBatches(request("next", pb.ALGORITHM_DQN, 8), other)
        s.run.close()
        return store, other.written
    store, written = asyncio.run(run())
    assert len(written) == 1 and store.served_samples == 8
    assert store.metrics.snapshot()["buffer/batches_unsent_total"] == 1

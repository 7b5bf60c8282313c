"""A learner streaming from several buffer shards counts what it consumed per shard and reports each
shard only its own counts (services/learner/loops.py, inbox.py): each shard's in-flight count and rate
limiter read them. The ratio it shows is over every shard."""

from __future__ import annotations

import asyncio

import numpy as np

from kuberl.v1 import buffer_pb2
from kuberl.v1 import common_pb2 as pb
from services.common.notify import Notifier
from services.common.stats import Metrics
from services.common.protocol.tensors import encode
from services.learner.inbox import Fetched, Inbox, Shard, discard
from services.learner.loops import send_progress, train_loop
from services.learner.publish import WeightsHub


def batch(samples: int) -> pb.TrainingBatch:
    return pb.TrainingBatch(transitions=pb.TransitionBatch(rewards=encode(np.zeros(samples, np.float32))))


class Stub:
    """A buffer shard's ReportProgress: records the requests, acks with its own production."""

    def __init__(self, inserted: int, warmup: int):
        self.requests: list[buffer_pb2.LearnerProgress] = []
        self.inserted, self.warmup = inserted, warmup

    async def ReportProgress(self, request, timeout=None):
        self.requests.append(request)
        return buffer_pb2.ProgressAck(samples_inserted_total=self.inserted, warmup_samples=self.warmup)


class Trainer:
    def __init__(self):
        self.metrics, self.version, self.trained = Metrics("learner"), 0, []

    def train(self, b) -> None:
        self.trained.append(b)
        self.version += 1
        self.metrics.inc("learner/batches_consumed_total")


async def test_consumption_is_counted_and_reported_per_shard():
    shards = [Shard(0, "a:1", Stub(inserted=1_100, warmup=100)), Shard(1, "b:1", Stub(inserted=3_000, warmup=0))]
    inbox = Inbox(16)
    # Shard 0 serves 2 batches of 32, shard 1 five of 64; the train loop takes them as they come.
    sizes = [(0, 32), (1, 64), (1, 64), (0, 32), (1, 64), (1, 64), (1, 64)]
    for index, samples in sizes:
        await inbox.put(Fetched(batch(samples), shards[index]))
    trainer = Trainer()
    loop = asyncio.create_task(train_loop(trainer, inbox, WeightsHub(), 1_000, Notifier()))
    while len(trainer.trained) < len(sizes) or sum(s.batches_consumed for s in shards) < len(sizes):
        await asyncio.sleep(0)
    loop.cancel()
    await asyncio.gather(loop, return_exceptions=True)
    assert [(s.batches_consumed, s.samples_consumed) for s in shards] == [(2, 64), (5, 320)]
    # One discarded at shutdown counts toward its own shard too.
    metrics = Metrics("learner")
    discard(metrics, [Fetched(batch(32), shards[0])])
    assert (shards[0].batches_consumed, shards[0].samples_consumed) == (3, 96)
    assert metrics.counters["learner/batches_discarded_total"] == 1
    for shard in shards:
        await send_progress(shard, shards, "l", 7, metrics)
    (first,), (second,) = shards[0].stub.requests, shards[1].stub.requests
    assert (first.batches_consumed_total, first.samples_consumed_total, first.policy_version) == (3, 96, 7)
    assert (second.batches_consumed_total, second.samples_consumed_total) == (5, 320)
    # Over both shards: (96 + 320) samples consumed over (1,100 - 100) + 3,000 produced.
    assert metrics.gauges["learner/samples_per_insert"] == (96 + 320) / 4_000

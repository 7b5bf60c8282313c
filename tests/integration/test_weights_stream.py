"""SubscribeWeights: newest-only delivery to slow subscribers, and chunking past the 4 MB message limit."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from kuberl.v1 import learner_pb2, learner_pb2_grpc
from services.common.net.grpcutil import start_server
from services.common.stats import Metrics
from services.common.protocol.weights import WeightsAssembler, encode_weights
from services.learner.publish import WeightsHub
from services.learner.servicer import LearnerServicer


async def _learner(hub: WeightsHub):
    srv = await start_server("127.0.0.1:0", lambda s: learner_pb2_grpc.add_LearnerServicer_to_server(
        LearnerServicer(hub, Metrics("learner")), s), ["kuberl.v1.Learner"], max_message_bytes=64 << 20)
    return srv


async def test_slow_subscriber_gets_the_newest_version_not_a_backlog():
    hub = WeightsHub()
    hub.publish(encode_weights(0, {"w": np.zeros(1 << 18, np.float32)}))  # 1 MiB per version
    srv = await _learner(hub)
    try:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            call = learner_pb2_grpc.LearnerStub(ch).SubscribeWeights(learner_pb2.WeightsRequest(subscriber_id="slow"))
            assembler, received = WeightsAssembler(), []
            it = call.__aiter__()
            while not received:
                if (got := assembler.add(await it.__anext__())) is not None:
                    received.append(got[0])
            for v in range(1, 41):  # 40 versions published while the subscriber reads nothing
                hub.publish(encode_weights(v, {"w": np.full(1 << 18, v, np.float32)}))
                await asyncio.sleep(0.005)
            while received[-1] != 40:
                if (got := assembler.add(await it.__anext__())) is not None:
                    received.append(got[0])
                    assert float(got[1]["w"][0]) == got[0]
            call.cancel()
        assert received == sorted(received) and received[0] == 0
        assert len(received) < 20, f"a backlog was delivered: {received}"
    finally:
        hub.close()
        await srv.server.stop(None)


async def test_weights_larger_than_the_default_message_limit_arrive_in_chunks():
    big = {"a": np.arange(1_500_000, dtype=np.float32), "b": np.ones((3, 5), np.int64)}  # ~6 MB
    hub = WeightsHub()
    hub.publish(encode_weights(7, big))
    srv = await _learner(hub)
    try:
        async with grpc.aio.insecure_channel(srv.address) as ch:  # default 4 MB receive limit
            call = learner_pb2_grpc.LearnerStub(ch).SubscribeWeights(
                learner_pb2.WeightsRequest(subscriber_id="big", after_version=3))
            assembler, chunks = WeightsAssembler(), 0
            async for chunk in call:
                chunks += 1
                if (got := assembler.add(chunk)) is not None:
                    break
            call.cancel()
        assert chunks >= 6 and got[0] == 7
        np.testing.assert_array_equal(got[1]["a"], big["a"])
        np.testing.assert_array_equal(got[1]["b"], big["b"])
    finally:
        hub.close()
        await srv.server.stop(None)


async def test_subscriber_holding_the_current_version_waits_for_a_new_one(monkeypatch):
    hub = WeightsHub()
    hub.publish(encode_weights(5, {"w": np.zeros(3, np.float32)}))
    # The stream waits for a publish in the hub's notifier: count the waits it enters there.
    waiting = asyncio.Event()
    wait = hub._changed.wait

    async def counted(timeout=None):
        waiting.set()
        return await wait(timeout)

    monkeypatch.setattr(hub._changed, "wait", counted)
    srv = await _learner(hub)
    try:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            call = learner_pb2_grpc.LearnerStub(ch).SubscribeWeights(
                learner_pb2.WeightsRequest(subscriber_id="s", after_version=5))
            first = asyncio.ensure_future(call.read())
            await asyncio.wait_for(waiting.wait(), 30)  # the stream holds 5, the newest: it waits
            assert not first.done()
            hub.publish(encode_weights(6, {"w": np.ones(3, np.float32)}))
            assert (await asyncio.wait_for(first, 5)).version == 6  # the first message: nothing of 5 was sent
            call.cancel()
    finally:
        hub.close()
        await srv.server.stop(None)


async def test_empty_subscriber_id_is_invalid_argument():
    hub = WeightsHub()
    hub.publish(encode_weights(0, {"w": np.zeros(3, np.float32)}))
    srv = await _learner(hub)
    try:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            call = learner_pb2_grpc.LearnerStub(ch).SubscribeWeights(learner_pb2.WeightsRequest())
            try:
                await call.read()
                raise AssertionError("expected INVALID_ARGUMENT")
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "subscriber_id" in err.details()
    finally:
        hub.close()
        await srv.server.stop(None)

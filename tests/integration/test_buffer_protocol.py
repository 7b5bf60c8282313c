"""The buffer's wire contract: acks, dedupe, every refusal and its status code, isolation of clients."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from kuberl.v1 import buffer_pb2, buffer_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services.buffer import main as buffer_main
from services.buffer import loops as buffer_loops
from services.config import config_from_dict
from services.common.protocol.tensors import encode
from tests.fragments import make_fragment
from tests.helpers import TINY_DQN, TINY_PPO
from tests.store_owner import store_owner  # noqa: F401 (every test runs with the store on the loop and on its thread)


@pytest.fixture
async def ppo_buffer():
    async with buffer_main.serving(config_from_dict(TINY_PPO), listen="127.0.0.1:0") as endpoints:
        address = endpoints.grpc
        async with grpc.aio.insecure_channel(address) as channel:
            yield buffer_pb2_grpc.BufferStub(channel)


WAIT_S = 60.0  # upper bound for a call or a poll on a loaded machine; nothing asserts on time


async def _send(call, messages) -> None:
    """Write `messages` and half-close. If a write fails because the RPC already ended (grpc.aio
    raises InvalidStateError, or INTERNAL "Failed execute_batch", or from done_writing an error
    of a private grpcio type, hence `Exception`), the call's own status, the server's answer, is
    raised instead: a client learns why from the status, never from the failed write."""
    try:
        for m in messages:
            await call.write(m)
        await call.done_writing()
    except Exception:
        await call  # raises AioRpcError with the status the server sent, if it was not OK
        raise


async def _push(stub, fragments) -> buffer_pb2.PushAck:
    call = stub.PushTrajectories(timeout=WAIT_S)
    await _send(call, fragments)
    return await call


async def _stats(stub) -> dict[str, float]:
    return dict((await stub.GetStats(pb.GetStatsRequest(), timeout=5)).metrics)


async def test_ack_counts_and_duplicates_are_not_stored_twice(ppo_buffer):
    ack = await _push(ppo_buffer, [make_fragment(seq=0), make_fragment(seq=1)])
    assert (ack.accepted, ack.duplicates, ack.last_accepted_seq, ack.high_water_seq) == (2, 0, 1, 1)
    again = await _push(ppo_buffer, [make_fragment(seq=1), make_fragment(seq=0), make_fragment(seq=2)])
    assert (again.accepted, again.duplicates, again.last_accepted_seq) == (1, 2, 2)
    s = await _stats(ppo_buffer)
    assert s["buffer/fragments_received_total"] == 3
    assert s["buffer/fragments_duplicate_total"] == 2
    assert s["buffer/size_samples"] == 3 * 4 * 2


def _bad(mutate):
    msg = make_fragment(seq=1)
    mutate(msg)
    return msg


MALFORMED = {
    "unknown dtype": (lambda m: setattr(m.obs, "dtype", 42), "obs.dtype"),
    "negative dim": (lambda m: m.rewards.shape.__setitem__(0, -4), "rewards.shape"),
    "huge dims": (lambda m: m.obs.shape.extend([1 << 20, 1 << 20]), "obs.shape"),
    "byte length": (lambda m: setattr(m.rewards, "data", m.rewards.data[:-1]), "rewards.data"),
    "wrong algorithm": (lambda m: setattr(m, "algorithm", pb.ALGORITHM_DQN), "algorithm"),
    "missing field": (lambda m: m.ClearField("actions"), "actions"),
    "rewards dtype": (lambda m: m.rewards.CopyFrom(encode(np.ones((4, 2), np.float64))), "rewards.dtype"),
    "empty actor id": (lambda m: setattr(m, "actor_id", ""), "actor_id"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
async def test_malformed_fragment_is_refused_and_others_keep_working(ppo_buffer, case):
    mutate, field = MALFORMED[case]
    call = ppo_buffer.PushTrajectories(timeout=10)
    await call.write(make_fragment(seq=0))
    await call.write(_bad(mutate))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.done_writing()
        await call
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details() and "seq 1" in err.value.details()
    md = dict(err.value.trailing_metadata())
    assert md["kuberl-rejected-seq"] == "1" and md["kuberl-accepted"] == "1"
    # The good fragment before it was kept; a new stream and another client both work.
    other = await _push(ppo_buffer, [make_fragment(actor_id="someone-else", seq=0)])
    again = await _push(ppo_buffer, [make_fragment(seq=2)])
    assert other.accepted == 1 and again.accepted == 1
    s = await _stats(ppo_buffer)
    assert s["buffer/fragments_received_total"] == 3 and s["buffer/fragments_invalid_total"] == 1


async def test_concurrent_client_is_unaffected_by_a_bad_one(ppo_buffer):
    async def good_client():
        return await _push(ppo_buffer, [make_fragment(actor_id="good", seq=i) for i in range(20)])

    async def bad_client():
        bad = _bad(MALFORMED["byte length"][0])
        return await _push(ppo_buffer, [bad if i == 3 else make_fragment(actor_id="bad", seq=i) for i in range(5)])

    good, bad = await asyncio.gather(good_client(), bad_client(), return_exceptions=True)
    assert isinstance(bad, grpc.aio.AioRpcError), bad
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad.code(), bad.details())
    assert dict(bad.trailing_metadata())["kuberl-accepted"] == "3"
    assert not isinstance(good, BaseException), good
    assert good.accepted == 20


async def test_a_client_that_writes_after_a_refusal_sees_the_refusal(ppo_buffer):
    # The buffer has refused message 1 before the client writes more: the status waits for the
    # client's half-close, so the later writes succeed (they are dropped) and the client gets
    # INVALID_ARGUMENT with its metadata, never INTERNAL from writing into a closed stream.
    call = ppo_buffer.PushTrajectories(timeout=WAIT_S)
    await call.write(make_fragment(seq=0))
    await call.write(_bad(MALFORMED["byte length"][0]))
    async with asyncio.timeout(WAIT_S):
        while (await _stats(ppo_buffer)).get("buffer/fragments_invalid_total") != 1:
            await asyncio.sleep(0.01)
    for seq in (2, 3, 4):
        await call.write(make_fragment(seq=seq))  # no exception: the stream is still open
    await call.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "seq 1" in err.value.details()
    md = dict(err.value.trailing_metadata())
    assert md["kuberl-rejected-seq"] == "1" and md["kuberl-accepted"] == "1"
    s = await _stats(ppo_buffer)
    assert s["buffer/fragments_received_total"] == 1  # what came after the refusal was not stored


async def test_oversize_message_is_resource_exhausted():
    cfg = config_from_dict({**TINY_PPO, "buffer": {"max_message_mb": 1}})
    async with buffer_main.serving(cfg, listen="127.0.0.1:0") as endpoints:
        address = endpoints.grpc
        async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            stub = buffer_pb2_grpc.BufferStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _push(stub, [make_fragment(T=4, N=2, obs_dim=40_000)])  # ~1.4 MB
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (await _push(stub, [make_fragment(seq=5)])).accepted == 1  # still serving


@pytest.mark.parametrize("request_kwargs, field", [
    ({"algorithm": pb.ALGORITHM_DQN, "batch_size": 8}, "algorithm"),
    ({"algorithm": pb.ALGORITHM_PPO, "batch_size": 0}, "batch_size"),
    ({"algorithm": pb.ALGORITHM_PPO, "batch_size": 8, "learner_id": ""}, "learner_id"),
])
async def test_bad_batch_request_is_invalid_argument(ppo_buffer, request_kwargs, field):
    req = buffer_pb2.BatchRequest(**{"learner_id": "l", **request_kwargs})
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in ppo_buffer.StreamBatches(req, timeout=5):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()


async def test_ppo_fragments_are_each_served_once_across_learners(ppo_buffer):
    await _push(ppo_buffer, [make_fragment(seq=i) for i in range(8)])  # 8 fragments x 8 samples
    req = buffer_pb2.BatchRequest(learner_id="l", algorithm=pb.ALGORITHM_PPO, batch_size=16, max_batches=2)

    async def learner():
        return [f.seq for b in [b async for b in ppo_buffer.StreamBatches(req, timeout=10)]
                for f in b.rollouts.fragments]

    a, b = await asyncio.gather(learner(), learner())
    assert sorted(a + b) == list(range(8))


async def test_a_batch_stream_ends_itself_cleanly_after_its_time_and_loses_nothing(ppo_buffer, monkeypatch):
    """A StreamBatches stream ends with OK once it has served BATCH_STREAM_S (here 0: after one batch),
    so the server's max connection age never cancels one mid-write; the next stream goes on."""
    monkeypatch.setattr(buffer_loops, "BATCH_STREAM_S", 0.0)
    await _push(ppo_buffer, [make_fragment(seq=i) for i in range(4)])  # 4 fragments x 8 samples
    req = buffer_pb2.BatchRequest(learner_id="l", algorithm=pb.ALGORITHM_PPO, batch_size=16)
    streams = []
    for _ in range(2):
        call = ppo_buffer.StreamBatches(req, timeout=WAIT_S)
        streams.append([[f.seq for f in b.rollouts.fragments] async for b in call])
        assert await call.code() == grpc.StatusCode.OK
    assert streams == [[[0, 1]], [[2, 3]]]
    s = await _stats(ppo_buffer)
    assert s["buffer/samples_served_total"] == 32 and s["buffer/batches_unsent_total"] == 0


async def test_dqn_batches_have_the_requested_rows():
    cfg = config_from_dict(TINY_DQN)
    async with buffer_main.serving(cfg, listen="127.0.0.1:0") as endpoints:
        address = endpoints.grpc
        async with grpc.aio.insecure_channel(address) as ch:
            stub = buffer_pb2_grpc.BufferStub(ch)
            # 32 = learning_starts, then 8 more: at TINY_DQN's ratio of 8 that is 64 samples, 4 batches of 16
            frags = [make_fragment(seq=i, T=8 if i < 2 else 4, algorithm=pb.ALGORITHM_DQN) for i in range(3)]
            assert (await _push(stub, frags)).accepted == 3
            req = buffer_pb2.BatchRequest(learner_id="l", algorithm=pb.ALGORITHM_DQN, batch_size=16, max_batches=3)
            batches = [b async for b in stub.StreamBatches(req, timeout=10)]
            assert [b.batch_id for b in batches] == [0, 1, 2]
            for b in batches:
                assert list(b.transitions.obs.shape) == [16, 4] and list(b.transitions.rewards.shape) == [16]


async def test_a_learners_progress_ack_names_the_warm_up_so_its_ratio_counts_from_its_end():
    """TINY_DQN's warm-up is 32 samples (learning_starts): the learner's replay ratio divides by what
    was inserted after it, as the buffer's own gauge does (services/learner/loops.py: report_progress)."""
    async with buffer_main.serving(config_from_dict(TINY_DQN), listen="127.0.0.1:0") as endpoints:
        async with grpc.aio.insecure_channel(endpoints.grpc) as ch:
            stub = buffer_pb2_grpc.BufferStub(ch)
            progress = buffer_pb2.LearnerProgress(learner_id="l", policy_version=0)
            await _push(stub, [make_fragment(seq=0, T=8, N=2, algorithm=pb.ALGORITHM_DQN)])
            ack = await stub.ReportProgress(progress, timeout=WAIT_S)
            assert (ack.samples_inserted_total, ack.warmup_samples) == (16, 16)   # all of it warm-up so far
            await _push(stub, [make_fragment(seq=i, T=8, N=2, algorithm=pb.ALGORITHM_DQN) for i in (1, 2, 3)])
            ack = await stub.ReportProgress(progress, timeout=WAIT_S)
            assert (ack.samples_inserted_total, ack.warmup_samples) == (64, 32)


async def test_ppo_fragment_with_another_layout_is_invalid_argument(ppo_buffer):
    assert (await _push(ppo_buffer, [make_fragment(seq=0, obs_dim=4)])).accepted == 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _push(ppo_buffer, [make_fragment(seq=1, obs_dim=5)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "obs" in err.value.details()
    assert (await _push(ppo_buffer, [make_fragment(seq=2, obs_dim=4)])).accepted == 1


async def test_bytes_that_are_not_a_fragment_are_refused_without_naming_a_seq():
    # The buffer reads pushed fragments straight from their bytes (services/common/protocol/wire.py).
    async with buffer_main.serving(config_from_dict(TINY_PPO), listen="127.0.0.1:0") as endpoints:
        async with grpc.aio.insecure_channel(endpoints.grpc) as channel:
            raw_push = channel.stream_unary("/kuberl.v1.Buffer/PushTrajectories", request_serializer=None,
                                            response_deserializer=buffer_pb2.PushAck.FromString)
            call = raw_push(timeout=10)
            await call.write(make_fragment(seq=0).SerializeToString())
            await call.write(make_fragment(seq=1).SerializeToString()[:-5])  # cut short
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.done_writing()
                await call
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed TrajectoryFragment" in err.value.details()
            md = dict(err.value.trailing_metadata())
            assert "kuberl-rejected-seq" not in md  # bytes that do not parse cannot name their seq
            assert md["kuberl-accepted"] == "1" and md["kuberl-last-accepted-seq"] == "0"
            ack = await _push(buffer_pb2_grpc.BufferStub(channel), [make_fragment(seq=1)])
            assert ack.accepted == 1


# -- WatchInsertLimit: the insert side of the rate limiter (docs/rate-limiter.md) ----------------------

async def test_insert_limit_streams_at_once_and_moves_with_inserts_and_batches():
    """A replay buffer (ratio 2, warm-up 32, batch 16): the limit starts above the warm-up plus the
    slack, names this actor's high-water seq once it stored something, and rises as batches are served."""
    cfg = config_from_dict({**TINY_DQN, "dqn": {**TINY_DQN["dqn"], "replay_ratio": 2.0}})
    async with buffer_main.serving(cfg, listen="127.0.0.1:0") as endpoints:
        async with grpc.aio.insecure_channel(endpoints.grpc) as channel:
            stub = buffer_pb2_grpc.BufferStub(channel)
            watch = stub.WatchInsertLimit(buffer_pb2.InsertLimitRequest(actor_id="actor-t", incarnation=0))
            first = await asyncio.wait_for(watch.read(), WAIT_S)
            # no fragment seen, no learner yet: warm-up 32 + one learner's 3 batches of 16 at ratio 2
            assert first.insert_limit_samples == 32 + 3 * 16 // 2 and first.samples_inserted_total == 0
            assert not first.HasField("high_water_seq") and first.replay_ratio_target == 2.0
            frags = [make_fragment(seq=i, T=8, N=2, algorithm=pb.ALGORITHM_DQN) for i in range(3)]
            await _push(stub, frags)  # 48 samples: 16 past the warm-up, so 2 batches of 16 at ratio 2
            msg = await asyncio.wait_for(watch.read(), WAIT_S)
            while msg.samples_inserted_total < 48:
                msg = await asyncio.wait_for(watch.read(), WAIT_S)
            assert msg.high_water_seq == 2
            assert msg.insert_limit_samples == 32 + 24 + 16  # the largest fragment joins the slack
            batches = stub.StreamBatches(buffer_pb2.BatchRequest(learner_id="l", algorithm=pb.ALGORITHM_DQN,
                                                                 batch_size=16, max_batches=2), timeout=WAIT_S)
            assert len([b async for b in batches]) == 2
            while msg.samples_served_total < 32:
                msg = await asyncio.wait_for(watch.read(), WAIT_S)
            assert msg.insert_limit_samples == 32 + 32 // 2 + 24 + 16
            watch.cancel()


async def test_insert_limit_refuses_an_empty_actor_id(ppo_buffer):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in ppo_buffer.WatchInsertLimit(buffer_pb2.InsertLimitRequest(actor_id="")):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "actor_id" in err.value.details()


async def test_a_fifo_limit_counts_what_waits_and_what_is_in_flight(ppo_buffer):
    """TINY_PPO: batches of 16 steps. Actors may fill one batch plus the largest fragment; a batch
    served stays counted until the learner reports it trained on."""
    watch = ppo_buffer.WatchInsertLimit(buffer_pb2.InsertLimitRequest(actor_id="actor-t"))
    assert (await asyncio.wait_for(watch.read(), WAIT_S)).insert_limit_samples == 16
    await _push(ppo_buffer, [make_fragment(seq=i) for i in range(4)])  # 4 x 8 samples
    msg = await asyncio.wait_for(watch.read(), WAIT_S)
    while msg.samples_inserted_total < 32:
        msg = await asyncio.wait_for(watch.read(), WAIT_S)
    assert msg.insert_limit_samples == 0 + 16 + 8  # nothing trained on yet: 16 + the largest fragment
    batches = ppo_buffer.StreamBatches(buffer_pb2.BatchRequest(learner_id="l", algorithm=pb.ALGORITHM_PPO,
                                                               batch_size=16, max_batches=1), timeout=WAIT_S)
    assert len([b async for b in batches]) == 1
    await ppo_buffer.ReportProgress(buffer_pb2.LearnerProgress(learner_id="l", policy_version=0,
                                                               batches_consumed_total=0), timeout=WAIT_S)
    while msg.samples_served_total < 16:
        msg = await asyncio.wait_for(watch.read(), WAIT_S)
    assert msg.insert_limit_samples == 24  # served, but in flight: the limit has not moved
    await ppo_buffer.ReportProgress(buffer_pb2.LearnerProgress(learner_id="l", policy_version=1,
                                                               batches_consumed_total=1), timeout=WAIT_S)
    while msg.insert_limit_samples == 24:
        msg = await asyncio.wait_for(watch.read(), WAIT_S)
    assert msg.insert_limit_samples == 16 + 24  # trained on: room for one more batch
    watch.cancel()

"""A DQN buffer with a checkpoint dir, stopped and started again on the same dir, holds the same
samples, and fragments re-sent by actors that the first buffer stored are counted as duplicates."""

from __future__ import annotations

import grpc

from kuberl.v1 import buffer_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services.buffer import main as buffer_main
from services.config import config_from_dict
from tests.fragments import make_fragment
from tests.helpers import TINY_DQN, TINY_PPO
from tests.store_owner import store_owner  # noqa: F401 (every test runs with the store on the loop and on its thread)

WAIT_S = 60.0  # upper bound for a call on a loaded machine; nothing asserts on time


async def push(stub, fragments):
    call = stub.PushTrajectories(timeout=WAIT_S)
    for f in fragments:
        await call.write(f)
    await call.done_writing()
    return await call


async def stats(stub) -> dict[str, float]:
    return dict((await stub.GetStats(pb.GetStatsRequest(), timeout=WAIT_S)).metrics)


def fragments(actor_id: str, seqs) -> list[pb.TrajectoryFragment]:
    return [make_fragment(actor_id, seq, T=8, N=2, algorithm=pb.ALGORITHM_DQN, version=seq, fill=seq)
            for seq in seqs]


async def test_replay_and_dedupe_survive_a_restart(tmp_path):
    cfg = config_from_dict(TINY_DQN)  # a ring of 512: 20 fragments of 16 transitions = 320 samples
    sent = fragments("actor-a", range(10)) + fragments("actor-b", range(10))
    async with buffer_main.serving(cfg, listen="127.0.0.1:0", checkpoint_dir=str(tmp_path)) as endpoints:
        async with grpc.aio.insecure_channel(endpoints.grpc) as channel:
            stub = buffer_pb2_grpc.BufferStub(channel)
            ack = await push(stub, sent)
            assert (ack.accepted, ack.duplicates) == (20, 0)
            before = await stats(stub)
    assert before["buffer/size_samples"] == 320
    assert [p.name for p in tmp_path.iterdir()] == ["replay-000000000001.npz"]  # written at shutdown

    async with buffer_main.serving(cfg, listen="127.0.0.1:0", checkpoint_dir=str(tmp_path)) as endpoints:
        async with grpc.aio.insecure_channel(endpoints.grpc) as channel:
            stub = buffer_pb2_grpc.BufferStub(channel)
            after = await stats(stub)
            assert after["buffer/size_samples"] == 320
            assert after["buffer/checkpoint_restored_samples"] == 320
            # Actors that never got their acks re-send: nothing is stored twice.
            again = await push(stub, sent[15:] + fragments("actor-a", [10]))
            assert (again.accepted, again.duplicates, again.high_water_seq) == (1, 5, 10)
            final = await stats(stub)
    assert final["buffer/fragments_duplicate_total"] == 5
    assert final["buffer/size_samples"] == 336


async def test_a_damaged_checkpoint_starts_the_buffer_empty(tmp_path):
    (tmp_path / "replay-000000000001.npz").write_bytes(b"PK\x03\x04 cut short by a full disk")
    cfg = config_from_dict(TINY_DQN)
    async with buffer_main.serving(cfg, listen="127.0.0.1:0", checkpoint_dir=str(tmp_path)) as endpoints:
        async with grpc.aio.insecure_channel(endpoints.grpc) as channel:
            stub = buffer_pb2_grpc.BufferStub(channel)
            assert (await stats(stub))["buffer/size_samples"] == 0
            assert (await push(stub, fragments("actor-a", range(2)))).accepted == 2


async def test_a_ppo_buffer_does_not_checkpoint_its_fifo(tmp_path, caplog):
    cfg = config_from_dict(TINY_PPO)
    async with buffer_main.serving(cfg, listen="127.0.0.1:0", checkpoint_dir=str(tmp_path)) as endpoints:
        async with grpc.aio.insecure_channel(endpoints.grpc) as channel:
            stub = buffer_pb2_grpc.BufferStub(channel)
            assert (await push(stub, [make_fragment("actor-a", 0)])).accepted == 1
    assert list(tmp_path.iterdir()) == []
    assert "not checkpointed" in caplog.text

"""Learners that train as a group (gradients averaged with torch.distributed gloo), as real processes
with a buffer and an actor: they stay identical, stop together cleanly, and a dead peer ends the group."""

from __future__ import annotations

import threading

import grpc
import pytest

from kuberl.v1 import learner_pb2, learner_pb2_grpc
from services.common.local.procs import free_port
from tests.helpers import TINY_DQN, TINY_PPO, TINY_SAC, Service, stats, wait_for, write_config


def _checksums(address: str, seconds: float) -> dict[int, str]:
    """version -> weights checksum, for every version the learner publishes within `seconds`."""
    seen: dict[int, str] = {}
    with grpc.insecure_channel(address) as ch:
        call = learner_pb2_grpc.LearnerStub(ch).SubscribeWeights(
            learner_pb2.WeightsRequest(subscriber_id="group-test"), timeout=seconds)
        try:
            for chunk in call:
                if chunk.chunk_index == 0:
                    seen[chunk.version] = chunk.checksum
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
    return seen


def _group(tmp_path, algo: dict, world: int = 2):
    config = write_config(tmp_path / "c.yaml", {**algo, "learner": {**algo["learner"], "publish_interval_updates": 1}})
    buffer = Service("buffer", tmp_path, config)
    buffer.wait_ready()
    group = f"127.0.0.1:{free_port()}"
    learners = [Service("learner", tmp_path, config, "--buffer", buffer.address, "--checkpoint-dir",
                        str(tmp_path / "ck"), "--world-size", str(world), "--rank", str(rank), "--group", group,
                        "--learner-id", f"learner-{rank}") for rank in range(world)]
    for lrn in learners:
        lrn.wait_ready(timeout=120)
    actor = Service("actor", tmp_path, config, "--buffer", buffer.address, "--learner", learners[0].address)
    actor.wait_ready()
    return buffer, learners, actor


@pytest.mark.parametrize("algo", [TINY_DQN, TINY_PPO, TINY_SAC], ids=["dqn", "ppo", "sac"])
def test_a_group_of_learners_trains_in_step_and_stops_together(tmp_path, algo):
    buffer, learners, actor = _group(tmp_path, algo)
    try:
        s = [stats(lrn.address, learner_pb2_grpc.LearnerStub) for lrn in learners]
        assert [x["learner/group_size"] for x in s] == [2, 2] and [x["learner/rank"] for x in s] == [0, 1]
        wait_for(lambda: all(stats(lrn.address, learner_pb2_grpc.LearnerStub)["learner/policy_version"] >= 5
                             for lrn in learners), timeout=120, interval=0.5, what="both learners past version 5")
        # Both learners trained on their own batches...
        s = [stats(lrn.address, learner_pb2_grpc.LearnerStub) for lrn in learners]
        assert all(x["learner/samples_total"] > 0 for x in s), s
        # ...and hold the same weights at every version both published (same averaged gradients).
        out: list[dict[int, str]] = [{}, {}]
        threads = [threading.Thread(target=lambda i=i: out[i].update(_checksums(learners[i].address, 4.0)))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        common = set(out[0]) & set(out[1])
        assert common, out
        assert all(out[0][v] == out[1][v] for v in common), {v: (out[0][v], out[1][v]) for v in common}
    finally:
        codes = {"actor": actor.terminate()}
        # Stopped at once, the group agrees on a round to stop at; both exit cleanly, rank 0 checkpoints.
        for lrn in learners:
            lrn.popen.send_signal(15)
        codes.update({f"learner-{i}": lrn.popen.wait(60) for i, lrn in enumerate(learners)})
        codes["buffer"] = buffer.terminate()
    assert set(codes.values()) == {0}, (codes, learners[0].output()[-3000:], learners[1].output()[-3000:])
    assert list((tmp_path / "ck").glob("ckpt-*.pt"))
    assert "took rank 0's state" in learners[1].output()


def test_a_dead_peer_ends_the_group_with_an_error_naming_it(tmp_path):
    buffer, learners, actor = _group(tmp_path, TINY_DQN)
    try:
        wait_for(lambda: stats(learners[0].address, learner_pb2_grpc.LearnerStub)["learner/policy_version"] >= 2,
                 timeout=120, interval=0.5, what="the group training")
        learners[1].kill()
        assert learners[0].popen.wait(60) != 0   # (the 60 s: a liveness bound, raising if it hangs)
        assert "GroupBroken" in learners[0].output() and "a peer is gone" in learners[0].output()
    finally:
        actor.terminate()
        for lrn in learners:
            lrn.kill()
        buffer.terminate()


def test_bad_group_flags_are_refused_naming_the_flag(tmp_path):
    config = write_config(tmp_path / "c.yaml", TINY_DQN)
    for args, said in ((["--world-size", "2", "--rank", "2", "--group", "127.0.0.1:1"], "rank: 2 must lie in 0..1"),
                       (["--world-size", "2", "--rank", "0"], "needs the rendezvous address"),
                       (["--world-size", "0"], "world size: 0 must be >= 1"),
                       (["--world-size", "2", "--group", "learner-0"], "'learner-0' must be host:port")):
        lrn = Service("learner", tmp_path, config, "--buffer", "127.0.0.1:1", *args)
        assert lrn.popen.wait(60) == 2 and said in lrn.output(), lrn.output()


def test_a_learner_stopped_while_its_group_forms_exits_at_once_and_cleanly(tmp_path):
    config = write_config(tmp_path / "c.yaml", TINY_DQN)
    lrn = Service("learner", tmp_path, config, "--buffer", "127.0.0.1:1", "--world-size", "2", "--rank", "0",
                  "--group", f"127.0.0.1:{free_port()}")
    wait_for(lambda: "joining a group of 2 learners" in lrn.output(), timeout=60, what="the learner waiting for rank 1")
    assert lrn.terminate(timeout=20) == 0
    assert "stopped while waiting for the group of 2 learners to form" in lrn.output()

"""Buffer shards (services/common/net/shards.py): three buffers, one learner streaming from all three,
three actors at different speeds each pinned to one shard. Each shard holds the target replay ratio within its band
on its own (the learner draws more from the shard whose actor inserts more), the learner's ratio over
all shards holds too, and nothing is dropped, refused or stored twice."""

from __future__ import annotations

import re

from kuberl.v1 import actor_pb2_grpc, buffer_pb2_grpc, learner_pb2_grpc
from services.common.net.shards import combined_samples_per_insert
from tests.helpers import TINY_DQN, Service, stats, wait_for, write_config

TARGET, TOLERANCE, LEARNING_STARTS, SHARDS = 4.0, 0.1, 64, 3
# Read each shard's ratio as its inserts pass marks (not at times), from SETTLED samples past the warm-up.
READ_EVERY, READINGS, SETTLED = 100, 6, 400


def _config(tmp, name, steps_per_s, shards=SHARDS):
    data = {**TINY_DQN, "dqn": {**TINY_DQN["dqn"], "batch_size": 32, "learning_starts": LEARNING_STARTS,
                                "buffer_size": 4096, "replay_ratio": TARGET, "replay_ratio_tolerance": TOLERANCE},
            "topology": {"buffers": shards},
            "actor": {"push_ack_interval_s": 0.2, "max_env_steps_per_s": steps_per_s}}
    return write_config(tmp / f"{name}.yaml", data)


def _start(tmp_path, procs: list[Service], cfg, actor_cfgs) -> tuple[list[str], str, list[Service]]:
    """With the buffers in `procs` starting: a learner streaming from all of them and one actor per
    config, actor i with index i (so on shard i modulo the shards). Every process joins `procs`.
    Returns (shard addresses, learner address, actors)."""
    shards = [b.wait_ready() for b in procs]
    addresses = ",".join(shards)
    procs.append(Service("learner", tmp_path, cfg, "--buffer", addresses, "--checkpoint-dir", str(tmp_path / "ck")))
    learner = procs[-1].wait_ready()
    actors = [Service("actor", tmp_path, c, "--buffer", addresses, "--learner", learner, "--actor-index", str(i))
              for i, c in enumerate(actor_cfgs)]
    procs += actors
    for a in actors:
        a.wait_ready()
    return shards, learner, actors


def _ratios_at_marks(address: str) -> list[float]:
    ratios = []
    for k in range(READINGS):
        mark = LEARNING_STARTS + SETTLED + k * READ_EVERY
        s = wait_for(lambda: (s := stats(address, buffer_pb2_grpc.BufferStub)).get(
            "buffer/samples_received_total", 0) >= mark and s, timeout=90, interval=0.02,
            what=f"{mark} samples inserted at {address}")
        ratios.append(s["buffer/samples_per_insert"])
    return ratios


def test_each_shard_holds_the_replay_ratio_and_nothing_is_lost(tmp_path):
    # Shards 0 and 1 take an actor stepping 80 env steps/s each, shard 2 one stepping 240: the tiny
    # learner could train far more than the 1,600 samples/s ratio 4 asks for, so every shard must pace
    # it, each by its own inserts.
    slow, fast = _config(tmp_path, "slow", 80), _config(tmp_path, "fast", 240)
    buffers = [Service("buffer", tmp_path, slow) for _ in range(SHARDS)]
    procs = list(buffers)
    try:
        shards, learner, actors = _start(tmp_path, procs, slow, (slow, slow, fast))
        for i, a in enumerate(actors):   # actor i pushes to shard i (its index modulo the shards)
            assert stats(a.address, actor_pb2_grpc.ActorStub)["actor/buffer_shard"] == i
        ratios = [_ratios_at_marks(address) for address in shards]
        for r in ratios:
            assert all(TARGET * (1 - TOLERANCE) <= x <= TARGET * (1 + TOLERANCE) for x in r), ratios
        per_shard = [stats(address, buffer_pb2_grpc.BufferStub) for address in shards]
        assert all(s["buffer/replay_ratio_in_band"] == 1.0 and s["buffer/paced_seconds_total"] > 0 for s in per_shard)
        # The learner trained on every shard, more on the one its actor fills faster.
        served = [s["buffer/samples_served_total"] for s in per_shard]
        assert served[2] > 1.5 * max(served[:2]) and min(served) > 0, served
        total = combined_samples_per_insert(per_shard)
        assert TARGET * (1 - TOLERANCE) <= total <= TARGET * (1 + TOLERANCE), total
        learned = wait_for(lambda: (s := stats(learner, learner_pb2_grpc.LearnerStub)).get("learner/samples_per_insert")
                           and s, timeout=30, what="the learner's ratio over all shards")
        assert TARGET * (1 - 2 * TOLERANCE) <= learned["learner/samples_per_insert"] <= TARGET * (1 + 2 * TOLERANCE)
    finally:
        for a in procs[SHARDS + 1:]:  # actors first: they flush what they hold, then log their tally
            assert a.terminate() == 0, a.output()
        final = [stats(b.address, buffer_pb2_grpc.BufferStub) if b.address else {} for b in buffers]
        for p in procs[:SHARDS + 1][::-1]:
            p.terminate()
    # Each shard stored exactly what its own actor cut: nothing dropped, refused, duplicated or misrouted.
    for actor, shard in zip(procs[SHARDS + 1:], final):
        tally = re.search(r"actor \S+ stopped: (\d+) fragments cut, (\d+) acknowledged, (\d+) dropped, "
                          r"(\d+) rejected", actor.output())
        assert tally, actor.output()[-2000:]
        cut, acked, dropped, rejected = (int(tally.group(i)) for i in range(1, 5))
        assert dropped == 0 and rejected == 0
        assert cut == acked == shard["buffer/fragments_received_total"] > 0
        assert shard["buffer/fragments_duplicate_total"] == 0 and shard["buffer/fragments_invalid_total"] == 0
        assert shard["buffer/actors_known"] == 1


def _tally(actor: Service) -> tuple[int, int, int, int]:
    """(cut, acknowledged, dropped, rejected) from an actor's last log line."""
    tally = re.search(r"actor \S+ stopped: (\d+) fragments cut, (\d+) acknowledged, (\d+) dropped, "
                      r"(\d+) rejected", actor.output())
    assert tally, actor.output()[-2000:]
    return tuple(int(tally.group(i)) for i in range(1, 5))


def test_a_shard_killed_with_sigkill_comes_back_and_each_shard_stored_what_it_acknowledged(tmp_path):
    """Chaos on one shard: shard 1 is frozen (nothing acknowledges), its actor's acknowledged count read,
    then it is SIGKILLed and started again on the same address, empty (no checkpoints here). Its actor
    re-sends what was not acknowledged. Shard 0 never notices; the learner trains from both throughout.
    Per shard, stored == acknowledged: shard 0 everything its actor was acknowledged, the new shard 1
    exactly what its actor was acknowledged after the kill (less what it counted as too old)."""
    import os
    import signal

    cfg2 = _config(tmp_path, "two", 150, shards=2)
    buffers = [Service("buffer", tmp_path, cfg2) for _ in range(2)]
    procs = list(buffers)
    new_shard = None
    try:
        shards, _, actors = _start(tmp_path, procs, cfg2, (cfg2, cfg2))
        acked = lambda i: stats(actors[i].address, actor_pb2_grpc.ActorStub)["actor/fragments_acked_total"]  # noqa: E731
        served = lambda address: stats(address, buffer_pb2_grpc.BufferStub)["buffer/samples_served_total"]  # noqa: E731
        wait_for(lambda: acked(1) >= 20 and served(shards[1]) > 0, timeout=90, what="shard 1 storing and serving")
        os.kill(buffers[1].popen.pid, signal.SIGSTOP)   # nothing more is acknowledged by shard 1
        before = acked(1)
        wait_for(lambda: acked(0) >= before + 10, timeout=60, what="shard 0 going on while shard 1 is frozen")
        assert acked(1) == before
        buffers[1].kill()
        new_shard = Service("buffer", tmp_path, cfg2, listen=shards[1])
        assert new_shard.wait_ready() == shards[1]
        wait_for(lambda: acked(1) >= before + 20, timeout=90, what="actor 1 acknowledged by the new shard 1")
        trained = served(shards[1])
        wait_for(lambda: served(shards[1]) > trained, timeout=60, what="the learner streaming from the new shard 1")
    finally:
        for a in procs[3:]:
            a.terminate()
        final = [stats(address, buffer_pb2_grpc.BufferStub) for address in shards]
        for p in [new_shard, procs[2], buffers[0]]:
            if p is not None:
                p.terminate()
        buffers[1].kill()
    (_, acked0, _, rejected0), (_, acked1, _, rejected1) = _tally(procs[3]), _tally(procs[4])
    assert rejected0 == rejected1 == 0
    assert final[0]["buffer/fragments_received_total"] == acked0 > 0
    assert final[0]["buffer/fragments_duplicate_total"] == 0
    assert final[1]["buffer/fragments_received_total"] == acked1 - before - final[1]["buffer/fragments_too_old_total"]
    assert final[1]["buffer/fragments_received_total"] > 0


def test_actors_without_an_index_spread_over_the_shards_by_their_live_actors(tmp_path):
    """A Deployment's actors have no index. Each picks, as it starts, a shard with the fewest live
    actors (open insert-limit streams, `buffer/actors_live`); actors started one after another spread
    over the shards whatever their ids hash to. Four actors whose ids all hash to shard 0 end two and
    two, and each shard reports its two."""
    from services.common.net.shards import shard_of

    cfg = _config(tmp_path, "cfg", 200, shards=2)
    ids = [a for a in (f"pod-{k}" for k in range(100)) if shard_of(a, 2) == 0][:4]
    buffers = [Service("buffer", tmp_path, cfg) for _ in range(2)]
    procs = list(buffers)
    try:
        shards = [b.wait_ready() for b in buffers]
        addresses = ",".join(shards)
        procs.append(Service("learner", tmp_path, cfg, "--buffer", addresses, "--checkpoint-dir", str(tmp_path / "ck")))
        learner = procs[-1].wait_ready()
        placed = []
        for k, actor_id in enumerate(ids):
            procs.append(Service("actor", tmp_path, cfg, "--buffer", addresses, "--learner", learner,
                                 "--actor-id", actor_id))
            address = procs[-1].wait_ready()
            placed.append(int(stats(address, actor_pb2_grpc.ActorStub)["actor/buffer_shard"]))
            # the next one starts once this one's insert-limit stream is open on its shard
            wait_for(lambda: sum(stats(s, buffer_pb2_grpc.BufferStub).get("buffer/actors_live", 0)
                                 for s in shards) == k + 1, timeout=60, what=f"{k + 1} live actors")
        assert sorted(placed) == [0, 0, 1, 1], placed
        assert [stats(s, buffer_pb2_grpc.BufferStub)["buffer/actors_live"] for s in shards] == [2.0, 2.0]
    finally:
        for p in reversed(procs):
            p.terminate()

"""Changing the buffer shards of a running experiment (docs/architecture.md, "Buffer shards"), with this
test in the planner's place: it sends SetTopology as services/planner/shards.py does. One shard, then
two (actor 1 moves to the new shard, the learner streams from it), then the new one drains (actor 1
moves back; a FIFO is served out, a replay counted as evicted) and leaves the list (the learner's
stream to it ends). Counted over both shards: every fragment each actor cut was stored exactly once,
nothing dropped, refused or duplicated."""

from __future__ import annotations

import re
import time

import grpc
import pytest

from kuberl.v1 import actor_pb2_grpc, buffer_pb2, buffer_pb2_grpc, learner_pb2_grpc
from tests.helpers import TINY_DQN, TINY_PPO, Service, stats, wait_for, write_config


def _config(tmp, algorithm: str):
    base = TINY_DQN if algorithm == "dqn" else TINY_PPO
    data = {**base, "actor": {"push_ack_interval_s": 0.2, "max_env_steps_per_s": 100}}
    if algorithm == "dqn":
        data["dqn"] = {**base["dqn"], "replay_ratio": 2.0}
    return write_config(tmp / f"{algorithm}.yaml", data)


def _set(addresses: list[str], active: int, generation: int) -> list[buffer_pb2.TopologyAck]:
    """SetTopology to every shard listed, as the planner does at each measurement."""
    topology = buffer_pb2.BufferTopology(generation=generation, addresses=addresses, active=active)
    acks = []
    for i, address in enumerate(addresses):
        with grpc.insecure_channel(address) as ch:
            acks.append(buffer_pb2_grpc.BufferStub(ch).SetTopology(
                buffer_pb2.SetTopologyRequest(topology=topology, shard=i), timeout=5))
    return acks


def _tally(actor: Service) -> tuple[int, int, int, int]:
    tally = re.search(r"actor \S+ stopped: (\d+) fragments cut, (\d+) acknowledged, (\d+) dropped, "
                      r"(\d+) rejected", actor.output())
    assert tally, actor.output()[-3000:]
    return tuple(int(tally.group(i)) for i in range(1, 5))


@pytest.mark.parametrize("algorithm", ["ppo", "dqn"])
def test_a_shard_added_then_drained_loses_nothing(tmp_path, algorithm):
    cfg = _config(tmp_path, algorithm)
    a, b = Service("buffer", tmp_path, cfg), Service("buffer", tmp_path, cfg)
    procs = [a, b]
    actors: list[Service] = []
    try:
        first, second = a.wait_ready(), b.wait_ready()
        gen = int(time.time() * 1000)
        _set([first], 1, gen)
        procs.append(Service("learner", tmp_path, cfg, "--buffer", first, "--checkpoint-dir", str(tmp_path / "ck")))
        learner = procs[-1].wait_ready()
        actors = [Service("actor", tmp_path, cfg, "--buffer", first, "--learner", learner, "--actor-index", str(i))
                  for i in range(2)]
        procs += actors
        for actor in actors:
            actor.wait_ready()
        st = lambda address, stub=buffer_pb2_grpc.BufferStub: stats(address, stub)  # noqa: E731
        received = lambda address: st(address)["buffer/fragments_received_total"]  # noqa: E731
        wait_for(lambda: received(first) >= 20 and st(first)["buffer/samples_served_total"] > 0, timeout=90,
                 what="the first shard storing and serving")
        assert st(first)["buffer/topology_generation"] == gen

        # Two shards: actor 1 (index 1 % 2) moves to the second; actor 0 stays; the learner adds it.
        _set([first, second], 2, gen + 1)
        wait_for(lambda: st(actors[1].address, actor_pb2_grpc.ActorStub)["actor/buffer_shard"] == 1, timeout=30,
                 what="actor 1 on shard 1")
        wait_for(lambda: received(second) >= 10 and st(second)["buffer/samples_served_total"] > 0, timeout=90,
                 what="the new shard storing and serving")
        assert st(learner, learner_pb2_grpc.LearnerStub)["learner/buffer_shards"] == 2
        assert st(actors[0].address, actor_pb2_grpc.ActorStub)["actor/shard_moves_total"] == 0
        assert st(second)["buffer/actors_live"] == 1 and st(first)["buffer/actors_live"] == 1

        # Drain the second: actor 1 moves back, the shard reports drained once nothing is left there.
        held = []

        def drained() -> bool:
            acks = _set([first, second], 1, gen + 2)
            held.append(acks[1].size_samples)
            assert acks[1].draining and not acks[0].draining
            return acks[1].drained
        wait_for(drained, timeout=90, interval=0.5, what="the second shard drained")
        assert st(actors[1].address, actor_pb2_grpc.ActorStub)["actor/buffer_shard"] == 0
        after_drain = st(second)
        assert after_drain["buffer/actors_live"] == 0 and after_drain["buffer/size_samples"] == 0
        if algorithm == "dqn":   # a replay's samples are counted as evicted, not served out
            assert after_drain["buffer/samples_evicted_on_drain_total"] > 0
        else:                    # a FIFO is served out (or counted stale) before it is drained
            assert after_drain["buffer/samples_evicted_on_drain_total"] == 0
        _set([first], 1, gen + 3)
        wait_for(lambda: st(learner, learner_pb2_grpc.LearnerStub)["learner/buffer_shards"] == 1, timeout=30,
                 what="the learner dropping the drained shard")
        moved_back = received(first)
        wait_for(lambda: received(first) >= moved_back + 10, timeout=60, what="both actors on the first shard")
    finally:
        for actor in actors:   # actors first: they flush what they hold, then log their tally
            actor.terminate()
        final = [stats(s.address, buffer_pb2_grpc.BufferStub) if s.address else {} for s in (a, b)]
        for p in procs[::-1]:
            if p not in actors:
                p.terminate()
    tallies = [_tally(actor) for actor in actors]
    for cut, acked, dropped, rejected in tallies:
        assert cut == acked > 0 and dropped == 0 and rejected == 0, tallies
    # Stored exactly once, over both shards: what both actors were acknowledged.
    assert sum(f["buffer/fragments_received_total"] for f in final) == sum(t[1] for t in tallies)
    assert all(f["buffer/fragments_duplicate_total"] == 0 and f["buffer/fragments_invalid_total"] == 0 for f in final)
    assert final[1]["buffer/fragments_received_total"] > 0


def test_the_planner_adds_and_drains_a_shard_of_a_kuberl_up_run(tmp_path, capsys):
    """`kuberl scale buffer 2`, then `kuberl scale buffer 1`, against a live `kuberl up` run: the planner's
    local backend starts shard 1, actor-1 moves to it and the learner trains from it; then it drains,
    is stopped, and actor-1 moves back. The run's summary accounts for every fragment: each actor's
    acknowledged count is what the two shards stored."""
    import json
    import subprocess
    import sys

    from kuberl.v1 import planner_pb2 as ppb
    from kuberl.v1 import planner_pb2_grpc
    from services.cli.main import main as kuberl
    from services.common.local.procs import free_port
    from tests.helpers import ROOT, run_logs, stop_up

    config = write_config(tmp_path / "c.yaml", {
        **TINY_DQN, "dqn": {**TINY_DQN["dqn"], "replay_ratio": 2.0},
        "actor": {"push_ack_interval_s": 0.2, "max_env_steps_per_s": 100},
        "topology": {"actors": 2},
        "planner": {"interval_s": 1, "warmup_s": 1, "cooldown_s": 2, "actor": {"min": 2, "max": 2},
                    "buffer": {"min": 1, "max": 2}},
        "run": {"target_return": None, "poll_interval_s": 0.5}})
    planner = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "services.cli.main", "up", str(config), "--run-dir", str(tmp_path),
                             "--name", "run", "--planner-port", planner.rsplit(":", 1)[1], "--quiet"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def status() -> ppb.PlannerStatus:
        if proc.poll() is not None:
            raise AssertionError(f"kuberl up ended early:\n{proc.stdout.read()}\n{run_logs(tmp_path / 'run')}")
        with grpc.insecure_channel(planner) as ch:
            return planner_pb2_grpc.PlannerStub(ch).GetStatus(ppb.GetStatusRequest(), timeout=10)

    def replicas(role: str) -> dict[str, str]:
        try:
            return {r.name: r.address for r in status().replicas if r.role == role and r.ready}
        except grpc.RpcError:
            return {}

    def scale(n: int) -> None:   # (the first step at once, unless an add is still being carried through)
        assert kuberl(["scale", "buffer", str(n), "--planner", planner]) == 0, capsys.readouterr()
        out = capsys.readouterr().out
        assert "buffer shards" in out, out

    try:
        wait_for(lambda: len(replicas("actor")) == 2 and len(replicas("buffer")) == 1, timeout=120,
                 what="the run serving")
        actor1 = lambda: stats(replicas("actor")["actor-1"], actor_pb2_grpc.ActorStub)  # noqa: E731
        wait_for(lambda: actor1()["actor/fragments_acked_total"] >= 10, timeout=90, what="actor-1 pushing")
        scale(2)
        shards = wait_for(lambda: len(b := replicas("buffer")) == 2 and b, timeout=90, what="shard 1 serving")
        wait_for(lambda: actor1()["actor/buffer_shard"] == 1, timeout=60, what="actor-1 moving to shard 1")
        wait_for(lambda: stats(shards["buffer-1"], buffer_pb2_grpc.BufferStub)["buffer/samples_served_total"] > 0,
                 timeout=90, what="the learner training from shard 1")
        scale(1)
        wait_for(lambda: list(replicas("buffer")) == ["buffer-0"], timeout=120, what="shard 1 drained and stopped")
        assert actor1()["actor/buffer_shard"] == 0 and actor1()["actor/shard_moves_total"] == 2
        journal = [json.loads(line) for line in (tmp_path / "run" / "decisions.jsonl").read_text().splitlines()]
        moves = [(d.get("buffer_shards", 0), d.get("buffer_shards_target", 0)) for d in journal
                 if d.get("buffer_shards", 0) != d.get("buffer_shards_target", 0)]
        assert moves == [(1, 2), (2, 1)], moves
        assert all("manual override" in d["buffer_shards_reason"] for d in journal
                   if d.get("buffer_shards", 0) != d.get("buffer_shards_target", 0))
    finally:
        out = stop_up(proc, tmp_path) if proc.poll() is None else proc.communicate()[0]
    assert proc.returncode == 0, out + run_logs(tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["exit_codes"]["buffer-1"] == 0 and set(summary["exit_codes"].values()) == {0}, summary["exit_codes"]
    logs = tmp_path / "run" / "logs"
    acked = [_tally_log((logs / f"actor-{i}.log").read_text()) for i in range(2)]
    stored = [summary["last_stats"][f"buffer-{i}"] for i in range(2)]
    assert sum(s["buffer/fragments_received_total"] for s in stored) == sum(acked) > 0, (acked, stored)
    assert stored[1]["buffer/fragments_received_total"] > 0
    assert "drained and stopped" in (logs / "planner-0.log").read_text()


def _tally_log(text: str) -> int:
    m = re.search(r"actor \S+ stopped: (\d+) fragments cut, (\d+) acknowledged, (\d+) dropped", text)
    assert m and m.group(1) == m.group(2) and m.group(3) == "0", text[-2000:]
    return int(m.group(2))

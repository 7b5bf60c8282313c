"""Buffer shards on a real node, installed with Helm.

**A fixed two (`buffer.shards: 2`) and a learner group.** 
Two actors push, each to the shard `shard_of` its pod name picks (`kuberl_actor_buffer_shard`). The
planner is asked through its API (`SetReplicas`, what `kuberl scale learner N` sends) to take the
learner StatefulSet 1 -> 3 -> 2, its own decisions paused so that the walk is the test's: at each size every learner pod reports the group's size and the
group trains, and every shard an actor feeds keeps serving batches. Then the pod of a fed shard is
deleted, and the accounting of tests/e2e/test_pod_deletion.py is made per shard: once the old pod is
gone and before its replacement serves, the acknowledged counts of the actors pinned to it cannot
move; their sum must equal what the old shard stored (its last log line), so nothing it
acknowledged was lost unaccounted (a PPO FIFO is not checkpointed; what it held unserved is in the
same line). The replacement serves under the same name, the actors and learners reconnect without
restarting, and the group trains on.

**Shards the planner adds and drains (`config.planner.buffer`).** From one shard, the planner is asked
(`kuberl scale buffer 2`) for a second: the Kubernetes backend scales the buffer StatefulSet up, the
new pod joins the shard list once it serves, one actor moves to it and the learner streams from it.
Then `kuberl scale buffer 1`: the shard drains (its actors move back, the learner serves out its FIFO),
the planner scales the StatefulSet down, and the drained pod ends holding nothing. The accounting is
exact: the actors are stopped (their last log lines give what each had acknowledged), and the sum
equals what shard 0 stored plus what the drained shard stored (its last log line).
"""

from __future__ import annotations

import re
import time

import grpc

from kuberl.v1 import planner_pb2, planner_pb2_grpc
from tests.e2e.helm import SMALL, release
from tests.e2e.kube import (VERSION_METRIC, fresh_namespace, kubectl, pod_metrics, pod_metrics_or_empty, pods,
                            wait_ready, wait_until)
from tests.e2e.test_pod_deletion import _follow, _output

NAMESPACE = "kuberl-shards"
SHARDS = 2
GROUP_SIZE = "kuberl_learner_group_size"
ACKED = "kuberl_actor_fragments_acked_total"
RECEIVED = "kuberl_buffer_fragments_received_total"
SERVED = "kuberl_buffer_batches_served_total"
# Three learner pods, two buffers, two actors and the planner on the 2-core node: smaller requests than
# test_helm's (the pods use what they use; requests only decide what the scheduler places).
VALUES = {
    **SMALL,
    "actor": {"resources": {"requests": {"cpu": "200m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}},
    "buffer": {"shards": SHARDS,
               "resources": {"requests": {"cpu": "200m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}},
    "learner": {"resources": {"requests": {"cpu": "250m", "memory": "768Mi"}, "limits": {"memory": "2Gi"}},
                "persistence": {"size": "1Gi"}},
    "config": {"topology": {"actors": 2},
               "learner": {"checkpoint_interval_s": 10},
               # The planner moves nothing by itself here: the actors stay at 2, the learners where asked.
               "planner": {"actor": {"min": 2, "max": 2}, "learner": {"min": 1, "max": 3}}},
}


def _metrics(node, pod: str) -> dict[str, float]:
    return pod_metrics_or_empty(node, NAMESPACE, pod)


def _wait(what: str, predicate, node, timeout_s: float = 300) -> float:
    return wait_until(node, NAMESPACE, what, predicate, timeout_s)


def _planner(node):
    (planner,) = pods(node, NAMESPACE, "planner")
    return grpc.insecure_channel(f"{planner.status.pod_ip}:50054")


def _pause_planner(node) -> None:
    """The walk is the test's: the planner's own decisions are held (a paused planner still applies overrides)."""
    with _planner(node) as ch:
        status = planner_pb2_grpc.PlannerStub(ch).Pause(planner_pb2.PauseRequest(reason="e2e walk"), timeout=60)
    assert status.paused


def _ask(node, role: str, replicas: int) -> planner_pb2.Decision:
    """SetReplicas, what `kuberl scale ROLE N` sends."""
    with _planner(node) as ch:
        return planner_pb2_grpc.PlannerStub(ch).SetReplicas(
            planner_pb2.SetReplicasRequest(role=role, replicas=replicas, ttl_s=1800), timeout=60)


def _scale_learners(node, replicas: int) -> None:
    decision = _ask(node, "learner", replicas)
    (learner,) = [r for r in decision.roles if r.role == "learner"]
    assert not decision.error and learner.target == replicas and (decision.applied or learner.current == replicas), \
        decision


def _learners(node, n: int) -> list[dict[str, float]]:
    return [_metrics(node, f"kuberl-learner-{i}") for i in range(n)]


def _group_trains(node, n: int, timeout_s: float = 400) -> dict[str, float]:
    """Every one of the first n learner pods reports a group of n, and the group's version rises by 2."""
    formed = _wait(f"a group of {n} learners",
                   lambda: all(m.get(GROUP_SIZE) == n for m in _learners(node, n)), node, timeout_s)
    version = _metrics(node, "kuberl-learner-0").get(VERSION_METRIC, 0.0)
    trained = _wait(f"the group of {n} training",
                    lambda: _metrics(node, f"kuberl-learner-{n - 1}").get(VERSION_METRIC, 0.0) >= version + 2,
                    node, timeout_s)
    return {"formed_s": round(formed, 1), "then_trained_s": round(trained, 1)}


def _restarts(node, component: str) -> int:
    return sum(cs.restart_count for p in pods(node, NAMESPACE, component) for cs in p.status.container_statuses or [])


def _served(node) -> dict[str, float]:
    return {f"kuberl-buffer-{i}": _metrics(node, f"kuberl-buffer-{i}").get(SERVED, 0.0) for i in range(SHARDS)}


def test_two_shards_a_learner_group_taken_1_3_2_and_a_shard_pod_deleted(e2e_node, e2e_images, e2e_report, tmp_path):
    report: dict = {}
    start = time.monotonic()
    with fresh_namespace(e2e_node, NAMESPACE), release(e2e_node, tmp_path, NAMESPACE, VALUES):
        wait_ready(e2e_node, NAMESPACE, timeout_s=400)
        _wait("two actors", lambda: len(pods(e2e_node, NAMESPACE, "actor")) == 2, e2e_node)  # the planner's minimum
        _pause_planner(e2e_node)
        _wait("two actors pushing", lambda: len(actors := pods(e2e_node, NAMESPACE, "actor")) == 2 and all(
            _metrics(e2e_node, a.metadata.name).get(ACKED, 0) > 0 for a in actors), e2e_node)
        report["install_to_two_actors_pushing_s"] = round(time.monotonic() - start, 1)
        shard_of = {a.metadata.name: int(_metrics(e2e_node, a.metadata.name)["kuberl_actor_buffer_shard"])
                    for a in pods(e2e_node, NAMESPACE, "actor")}
        fed = sorted({f"kuberl-buffer-{s}" for s in shard_of.values()})
        report["actor_shards"] = shard_of

        def fed_shards_serve() -> bool:   # every fed shard serves more batches than at `before`
            now = _served(e2e_node)
            return all(now[b] > before[b] for b in fed)

        walk = {}
        for n in (1, 3, 2):   # from 1 (the planner may have added learners before it was paused)
            asked = time.monotonic()
            _scale_learners(e2e_node, n)
            walk[f"to_{n}"] = _group_trains(e2e_node, n)
            before = _served(e2e_node)
            _wait(f"each fed shard {fed} serving the group of {n}", fed_shards_serve, e2e_node, 120)
            walk[f"to_{n}"]["ask_to_training_s"] = round(time.monotonic() - asked, 1)
        _wait("learner 2 gone", lambda: len(pods(e2e_node, NAMESPACE, "learner")) == 2, e2e_node)
        assert _restarts(e2e_node, "actor") == 0 and _restarts(e2e_node, "buffer") == 0
        report["learner_walk"] = walk

        # --- a fed shard's pod deleted ------------------------------------------------------------
        shard = fed[-1]
        pinned = [a for a, s in shard_of.items() if f"kuberl-buffer-{s}" == shard]
        version = _metrics(e2e_node, "kuberl-learner-0")[VERSION_METRIC]
        follow = _follow(e2e_node, shard, NAMESPACE)
        deleted = time.monotonic()
        kubectl(e2e_node, "-n", NAMESPACE, "delete", "pod", shard, "--wait=true", timeout_s=200)
        acked_at_gone = sum(pod_metrics(e2e_node, NAMESPACE, a)[ACKED] for a in pinned)  # nothing serves them
        out = _output(follow)
        last = re.search(r"buffer stopped: (\d+) fragments received \((\d+) samples\), (\d+) samples served, "
                         r"(\d+) held", out)
        assert last, f"no final counts in the deleted shard's log:\n{out[-2000:]}"
        stored, _, _, held = map(int, last.groups())
        assert acked_at_gone == stored > 0, (
            f"{shard} stored {stored} fragments; its actors {pinned} were acknowledged {acked_at_gone}")
        _wait(f"{shard} replaced and serving", lambda: _metrics(e2e_node, shard).get(RECEIVED, 0) > 0, e2e_node)
        _wait("the group training on", lambda: _metrics(e2e_node, "kuberl-learner-0").get(VERSION_METRIC, 0)
              >= version + 2, e2e_node)
        before = {b: 0.0 for b in fed}
        _wait(f"each fed shard {fed} serving again", fed_shards_serve, e2e_node, 120)
        assert _restarts(e2e_node, "actor") == 0 and _restarts(e2e_node, "learner") == 0, \
            "an actor or a learner restarted when a shard went: they must reconnect instead"
        report["shard_deletion"] = {"shard": shard, "actors": pinned, "fragments_stored_and_acknowledged": stored,
                                    "samples_held_at_sigterm_lost_with_it": held,
                                    "delete_to_training_s": round(time.monotonic() - deleted, 1)}
        e2e_report["shards_and_learner_group"] = report


ACTOR_LINE = re.compile(r"actor (\S+) stopped: (\d+) fragments cut, (\d+) acknowledged, (\d+) dropped, (\d+) rejected")
BUFFER_LINE = re.compile(r"buffer stopped: (\d+) fragments received \((\d+) samples\), (\d+) samples served, (\d+) held")
PLANNED = {**VALUES, "buffer": {**VALUES["buffer"], "shards": 1},
           "config": {**VALUES["config"], "planner": {"actor": {"min": 2, "max": 2}, "learner": {"min": 1, "max": 1},
                                                      "buffer": {"min": 1, "max": 2}}}}


def _shard_replicas(node) -> int:
    return int(kubectl(node, "-n", NAMESPACE, "get", "statefulset", "kuberl-buffer", "-o", "jsonpath={.spec.replicas}"))


def _placement(node) -> dict[str, int]:
    return {a.metadata.name: int(_metrics(node, a.metadata.name).get("kuberl_actor_buffer_shard", -1))
            for a in pods(node, NAMESPACE, "actor")}


def _logged_after(text: str, pattern: str, since: float) -> float | None:
    """Seconds from `since` (wall clock) to the first log line matching `pattern` (None: none does)."""
    for line in text.splitlines():
        stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ", line)
        if stamp and re.search(pattern, line):
            at = time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) + int(stamp.group(2)) / 1000
            if at >= since - 1:
                return round(at - since, 1)
    return None


def test_the_planner_adds_a_buffer_shard_and_drains_it_losing_nothing_acknowledged(e2e_node, e2e_images, e2e_report,
                                                                                   tmp_path):
    report: dict = {}
    with fresh_namespace(e2e_node, NAMESPACE), release(e2e_node, tmp_path, NAMESPACE, PLANNED):
        wait_ready(e2e_node, NAMESPACE, timeout_s=400)
        _wait("two actors pushing", lambda: len(actors := pods(e2e_node, NAMESPACE, "actor")) == 2 and all(
            _metrics(e2e_node, a.metadata.name).get(ACKED, 0) > 0 for a in actors), e2e_node)
        _pause_planner(e2e_node)   # the planner adds and drains only when asked
        assert _shard_replicas(e2e_node) == 1

        # --- the planner adds shard 1 ---------------------------------------------------------------
        asked = time.monotonic()
        decision = _ask(e2e_node, "buffer", 2)
        assert not decision.error and decision.buffer_shards_target == 2, decision
        assert _shard_replicas(e2e_node) == 2
        added = _wait("shard 1 fed by an actor and served to the learner", lambda: all(
            _metrics(e2e_node, "kuberl-buffer-1").get(m, 0) > 0 for m in (RECEIVED, SERVED)), e2e_node)
        _wait("one actor on each shard", lambda: sorted(_placement(e2e_node).values()) == [0, 1], e2e_node, 120)
        report["add"] = {"ask_to_fed_and_served_s": round(added, 1), "placement": _placement(e2e_node)}

        # --- the planner drains it ------------------------------------------------------------------
        follow = _follow(e2e_node, "kuberl-buffer-1", NAMESPACE)
        (planner,) = pods(e2e_node, NAMESPACE, "planner")
        asked, asked_wall = time.monotonic(), time.time()
        decision = _ask(e2e_node, "buffer", 1)
        assert not decision.error and decision.buffer_shards_target == 1, decision
        _wait("shard 1 drained and its pod gone", lambda: _shard_replicas(e2e_node) == 1 and not any(
            p.metadata.name == "kuberl-buffer-1" for p in pods(e2e_node, NAMESPACE, "buffer")), e2e_node, 300)
        drained_s = time.monotonic() - asked
        out = _output(follow)
        last = BUFFER_LINE.search(out)
        assert last, f"no final counts in the drained shard's log:\n{out[-2000:]}"
        stored_1, _, _, held_1 = map(int, last.groups())
        assert "draining" in out and held_1 == 0 and stored_1 > 0, out[-2000:]
        assert set(_placement(e2e_node).values()) == {0}
        # Where the drain's time went (the pods' log lines, seconds after the ask).
        planner_log = kubectl(e2e_node, "-n", NAMESPACE, "logs", planner.metadata.name)
        phases = {what: _logged_after(text, pattern, asked_wall) for what, text, pattern in (
            ("shard_told_to_drain", out, r"draining"), ("shard_drained", out, r"drained: "),
            ("planner_stopped_it", planner_log, r"drained and stopped"), ("shard_stopped", out, r"buffer stopped"))}

        # --- exact accounting: stop the actors, then compare --------------------------------------------
        actors = [a.metadata.name for a in pods(e2e_node, NAMESPACE, "actor")]
        follows = {a: _follow(e2e_node, a, NAMESPACE) for a in actors}
        kubectl(e2e_node, "-n", NAMESPACE, "scale", "deployment", "kuberl-actor", "--replicas=0")
        _wait("the actors gone", lambda: not pods(e2e_node, NAMESPACE, "actor"), e2e_node, 200)
        finals = {}
        for a, f in follows.items():
            out = _output(f)
            line = ACTOR_LINE.search(out)
            assert line, f"no final counts in {a}'s log:\n{out[-2000:]}"
            finals[a] = dict(zip(("cut", "acked", "dropped", "rejected"), map(int, line.groups()[1:])))
        stored_0 = int(_metrics(e2e_node, "kuberl-buffer-0")[RECEIVED])
        acked = sum(f["acked"] for f in finals.values())
        assert all(f["dropped"] == 0 for f in finals.values()), finals
        assert acked == stored_0 + stored_1, (f"acknowledged {acked}; shard 0 stored {stored_0}, the drained shard "
                                              f"{stored_1}: {finals}")
        assert _restarts(e2e_node, "buffer") == 0
        report["drain"] = {"ask_to_pod_gone_s": round(drained_s, 1), "phases_s": phases, "drained_shard_stored": stored_1,
                           "shard_0_stored": stored_0, "acknowledged": acked, "actors": finals}
        e2e_report["planner_shards"] = report

"""`kubectl delete pod` of the buffer, the learner and an actor: the run goes on and nothing is lost.

Each deletion is what Kubernetes does on a drain or an eviction: SIGTERM, the grace period, a
replacement pod. After each one the replacement must become Ready and training must go on (the
learner's policy version rises), and the reliability counters must show no loss:

- buffer: the actor keeps its pod (no restart) and re-sends what the old buffer had not acknowledged;
  it drops nothing (`actor/fragments_dropped_total` 0) and the new buffer refuses nothing as too old
  (`buffer/fragments_too_old_total` 0);
- learner: the replacement resumes from the checkpoint the old one wrote at SIGTERM (on the PVC), so its
  first policy version is at least the old one's last;
- actor: the replacement produces, and every fragment the old one cut was acknowledged before it went
  (it flushes at SIGTERM), as its final log line says (followed with `kubectl logs -f`).
"""

from __future__ import annotations

import re
import subprocess
import time

from tests.e2e.kube import (VERSION_METRIC, kubectl, metrics, pod_metrics, pods, provide_volumes, release_volumes,
                            render_overlay, wait_metric, wait_ready, with_config)
from tests.k8s.cluster import binaries

NAMESPACE = "kuberl"
DROPPED = "kuberl_actor_fragments_dropped_total"


def fixed_topology(config: dict) -> None:
    config["planner"]["actor"] = {"min": 1, "max": 1}   # the planner must not add or remove actors here
    config["learner"]["checkpoint_interval_s"] = 5


def _replaced(node, component: str, old: str, timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = [p for p in pods(node, NAMESPACE, component) if p.metadata.name != old
                 and p.metadata.deletion_timestamp is None
                 and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
        if ready:
            return ready[0].metadata.name
        time.sleep(1)
    raise AssertionError(f"no Ready replacement for {component} pod {old} within {timeout_s:.0f} s")


def _restarts(node, component: str) -> int:
    return sum(cs.restart_count for p in pods(node, NAMESPACE, component) for cs in p.status.container_statuses or [])


def test_deleted_pods_are_replaced_and_nothing_is_lost(e2e_node, e2e_images, e2e_report):
    provide_volumes(e2e_node)
    timings = {}
    try:
        kubectl(e2e_node, "apply", "-f", "-",
                input=with_config(render_overlay(e2e_node, "k8s/overlays/dev"), fixed_topology))
        wait_ready(e2e_node, NAMESPACE, timeout_s=400)
        wait_metric(e2e_node, NAMESPACE, "kuberl-learner", VERSION_METRIC, above=2)

        # --- the buffer ---------------------------------------------------------------------------
        (buffer,) = [p.metadata.name for p in pods(e2e_node, NAMESPACE, "buffer")]
        (actor,) = [p.metadata.name for p in pods(e2e_node, NAMESPACE, "actor")]
        version = metrics(e2e_node, NAMESPACE, "kuberl-learner")[VERSION_METRIC]
        start = time.monotonic()
        kubectl(e2e_node, "-n", NAMESPACE, "delete", "pod", buffer, "--wait=true", timeout_s=200)
        _replaced(e2e_node, "buffer", old="", timeout_s=300)   # a StatefulSet's replacement keeps the name
        wait_metric(e2e_node, NAMESPACE, "kuberl-learner", VERSION_METRIC, above=version + 1)
        timings["buffer_delete_to_training_s"] = round(time.monotonic() - start, 1)
        assert _restarts(e2e_node, "actor") == 0 and _restarts(e2e_node, "learner") == 0, \
            "the actor or the learner restarted when the buffer went: they must reconnect instead"
        assert pod_metrics(e2e_node, NAMESPACE, actor).get(DROPPED, 0) == 0
        (new_buffer,) = [p.metadata.name for p in pods(e2e_node, NAMESPACE, "buffer")]
        assert pod_metrics(e2e_node, NAMESPACE, new_buffer).get("kuberl_buffer_fragments_too_old_total", 0) == 0

        # --- the learner --------------------------------------------------------------------------
        (learner,) = [p.metadata.name for p in pods(e2e_node, NAMESPACE, "learner")]
        last = pod_metrics(e2e_node, NAMESPACE, learner)[VERSION_METRIC]
        start = time.monotonic()
        kubectl(e2e_node, "-n", NAMESPACE, "delete", "pod", learner, "--wait=true", timeout_s=200)
        new_learner = _replaced(e2e_node, "learner", old=learner)
        resumed = pod_metrics(e2e_node, NAMESPACE, new_learner)[VERSION_METRIC]
        # The old learner trained on while it drained; the final checkpoint holds its last version.
        # At most a few updates pass between the read and SIGTERM; far more would mean a foreign checkpoint.
        assert last <= resumed <= last + 20, f"the new learner resumed at version {resumed}; the old one was at {last}"
        wait_metric(e2e_node, NAMESPACE, "kuberl-learner", VERSION_METRIC, above=resumed + 1)
        timings["learner_delete_to_training_s"] = round(time.monotonic() - start, 1)
        timings["learner_versions"] = {"before": last, "resumed_at": resumed}

        # --- an actor -----------------------------------------------------------------------------
        # Its last log line (services/actor/main.py) has its final counts; follow the log to read it.
        follow = subprocess.Popen([binaries("KUBECTL")["KUBECTL"],
                                   f"--kubeconfig={e2e_node.cluster.write_kubeconfig(e2e_node.workdir / 'logs.kubeconfig')}",
                                   "-n", NAMESPACE, "logs", "-f", actor], stdout=subprocess.PIPE, text=True)
        start = time.monotonic()
        kubectl(e2e_node, "-n", NAMESPACE, "delete", "pod", actor, "--wait=true", timeout_s=200)
        out, _ = follow.communicate(timeout=60)
        final = re.search(r"actor \S+ stopped: (\d+) fragments cut, (\d+) acknowledged, (\d+) dropped, (\d+) rejected",
                          out)
        assert final, f"no final counts in the deleted actor's log:\n{out[-2000:]}"
        cut, acked, dropped, rejected = map(int, final.groups())
        assert (dropped, rejected) == (0, 0) and acked == cut, \
            f"the deleted actor cut {cut} fragments: {acked} acknowledged, {dropped} dropped, {rejected} rejected"
        timings["deleted_actor_fragments"] = {"cut": cut, "acknowledged": acked}
        new_actor = _replaced(e2e_node, "actor", old=actor)
        deadline = time.monotonic() + 120
        while pod_metrics(e2e_node, NAMESPACE, new_actor).get("kuberl_actor_env_steps_total", 0) == 0:
            assert time.monotonic() < deadline, f"the replacement actor {new_actor} did not step within 120 s"
            time.sleep(1)
        version = metrics(e2e_node, NAMESPACE, "kuberl-learner")[VERSION_METRIC]
        wait_metric(e2e_node, NAMESPACE, "kuberl-learner", VERSION_METRIC, above=version + 1)
        timings["actor_delete_to_training_s"] = round(time.monotonic() - start, 1)
        e2e_report["pod_deletion"] = timings
    finally:
        e2e_node.delete_namespace(NAMESPACE)
        release_volumes(e2e_node)

"""`kubectl delete pod` of the buffer, the learner and an actor: the run goes on and nothing acknowledged is lost.

Each deletion is what Kubernetes does on a drain or an eviction: SIGTERM, the grace period, a
replacement pod. After each one the replacement must become Ready and training must go on (the
learner's policy version rises). The accounting is the reliability issue's, made exact:

- buffer: the actor and the learner keep their pods (no restart) and reconnect. The buffer is deleted
  once the actor has been acknowledged fragments for several ack intervals. Once the old buffer pod
  is gone and before its replacement serves, the actor's `fragments_acked_total` cannot move; it is
  read then (A0). A0 is positive and equals what the old buffer stored, from its last log line: at
  SIGTERM it acknowledged its open streams, so the actor re-sends none of that to the new buffer.
  Every fragment the actor is acknowledged after that must be in the new buffer. What the old buffer
  held and had not served is gone with it (a PPO FIFO is not checkpointed, docs/deploy.md; its last
  line says how much); while no buffer serves, the actor's bounded send queue drops its oldest unsent
  fragments, counted in `actor/fragments_dropped_total` (reported here, never acknowledged);
- learner: the StatefulSet's replacement pod (the same name, kuberl-learner-0, and the same claim,
  checkpoints-kuberl-learner-0) resumes from the checkpoint the old one wrote at SIGTERM, so its first
  policy version is at least the old one's last. The actor's push path is sampled once a second
  meanwhile (send queue, drops, acks, stream errors, CPU) and reported, so drops can be told from
  their cause (docs/deploy.md: they were the actor still waiting to reach the new buffer);
- actor: the replacement produces. The deleted actor's final log line (followed with `kubectl logs
  -f`) gives its acknowledged total A1 and shows nothing rejected; the new buffer's
  `fragments_received_total` R, read as the old actor has gone, must be A1 - A0 plus at most what the
  replacement actor had sent by then (usually nothing yet: then it is exact).
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time

import yaml

from tests.e2e.adapt import adapt
from tests.e2e.kube import (ROOT, VERSION_METRIC, fresh_namespace, kubectl, metrics, pod_metrics, pod_ready, pods,
                            render_overlay, wait_metric, wait_ready, with_config)
from tests.k8s.cluster import binaries

NAMESPACE = "kuberl"
DROPPED = "kuberl_actor_fragments_dropped_total"
ACKED = "kuberl_actor_fragments_acked_total"
ACKED_BEFORE_DELETE = 20   # fragments: several ack intervals of pushing at the dev overlay's rate


def fixed_topology(config: dict) -> None:
    config["planner"]["actor"] = {"min": 1, "max": 1}   # the planner must not add or remove actors here
    config["planner"]["learner"] = {"min": 1, "max": 1}   # nor learners: one learner pod, kuberl-learner-0
    config["learner"]["checkpoint_interval_s"] = 5


def _replaced(node, component: str, old: str, timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = [p for p in pods(node, NAMESPACE, component) if p.metadata.name != old
                 and p.metadata.deletion_timestamp is None and pod_ready(p)]
        if ready:
            return ready[0].metadata.name
        time.sleep(1)
    raise AssertionError(f"no Ready replacement for {component} pod {old} within {timeout_s:.0f} s")


def _pushed(node, pod: str) -> float:
    try:
        return pod_metrics(node, NAMESPACE, pod).get("kuberl_actor_fragments_pushed_total", 0.0)
    except Exception:   # not serving yet: it has pushed nothing
        return 0.0


def _restarts(node, component: str) -> int:
    return sum(cs.restart_count for p in pods(node, NAMESPACE, component) for cs in p.status.container_statuses or [])


class _ActorWatch:
    """Samples an actor pod's push path once a second from a thread until `stop`: the send queue's
    depth, drops, stream errors, acks and CPU, so that drops can be told from their cause."""

    FIELDS = {"queue": "kuberl_actor_push_queue_fragments", "dropped": DROPPED, "acked": ACKED,
              "stream_errors": "kuberl_actor_push_stream_errors_total", "cpu_s": "kuberl_actor_cpu_seconds_total",
              "env_steps": "kuberl_actor_env_steps_total"}

    def __init__(self, node, pod: str):
        self.node, self.pod, self.samples, self._done = node, pod, [], threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(1.0):
            try:
                m = pod_metrics(self.node, NAMESPACE, self.pod)
            except Exception:   # a scrape that failed under load: the next one counts
                continue
            self.samples.append({"t": round(time.monotonic() - self._start, 1),
                                 **{k: m.get(v, 0.0) for k, v in self.FIELDS.items()}})

    def stop(self) -> dict:
        self._done.set()
        self._thread.join(10)
        if not self.samples:
            return {}
        first, last = self.samples[0], self.samples[-1]
        return {"seconds": last["t"], "max_queue": max(x["queue"] for x in self.samples),
                **{k: last[k] - first[k] for k in ("dropped", "acked", "stream_errors", "cpu_s", "env_steps")},
                "samples": self.samples}


def _follow(node, pod: str, namespace: str = NAMESPACE) -> subprocess.Popen:
    """`kubectl logs -f POD`: what a pod writes up to its end (its final counts)."""
    return subprocess.Popen([binaries("KUBECTL")["KUBECTL"],
                             f"--kubeconfig={node.cluster.write_kubeconfig(node.workdir / 'logs.kubeconfig')}",
                             "-n", namespace, "logs", "-f", pod], stdout=subprocess.PIPE, text=True)


def _output(follow: subprocess.Popen) -> str:
    try:
        out, _ = follow.communicate(timeout=60)
    finally:
        follow.kill()
    return out


def test_deleted_pods_are_replaced_and_nothing_is_lost(e2e_node, e2e_images, e2e_report):
    timings = {}
    with fresh_namespace(e2e_node, NAMESPACE):
        kubectl(e2e_node, "apply", "-f", "-",
                input=with_config(render_overlay(e2e_node, "k8s/overlays/dev"), fixed_topology))
        wait_ready(e2e_node, NAMESPACE, timeout_s=400)
        wait_metric(e2e_node, NAMESPACE, "kuberl-learner", VERSION_METRIC, above=2)

        # --- the buffer ---------------------------------------------------------------------------
        (buffer,) = [p.metadata.name for p in pods(e2e_node, NAMESPACE, "buffer")]
        (actor,) = [p.metadata.name for p in pods(e2e_node, NAMESPACE, "actor")]
        # Several ack intervals (push_ack_interval_s, 2 s) of pushing first: acknowledgements from the
        # old buffer are part of what is accounted below.
        deadline = time.monotonic() + 120
        while (first_acked := pod_metrics(e2e_node, NAMESPACE, actor).get(ACKED, 0)) < ACKED_BEFORE_DELETE:
            assert time.monotonic() < deadline, f"the actor had {first_acked} fragments acknowledged after 120 s"
            time.sleep(1)
        version = metrics(e2e_node, NAMESPACE, "kuberl-learner")[VERSION_METRIC]
        follow = _follow(e2e_node, buffer)
        start = time.monotonic()
        kubectl(e2e_node, "-n", NAMESPACE, "delete", "pod", buffer, "--wait=true", timeout_s=200)
        acked_at_gone = pod_metrics(e2e_node, NAMESPACE, actor)[ACKED]   # no buffer serves: frozen
        last = re.search(r"buffer stopped: (\d+) fragments received \((\d+) samples\), (\d+) samples served, "
                         r"(\d+) held", out := _output(follow))
        assert last, f"no final counts in the deleted buffer's log:\n{out[-2000:]}"
        stored_by_old, _, _, held_by_old = map(int, last.groups())
        assert acked_at_gone >= ACKED_BEFORE_DELETE
        assert acked_at_gone == stored_by_old, (
            f"the old buffer stored {stored_by_old} fragments and acknowledged {acked_at_gone} of them to the actor")
        timings["old_buffer"] = {"fragments_stored_and_acknowledged": stored_by_old,
                                 "samples_held_at_sigterm_lost_with_it": held_by_old}
        _replaced(e2e_node, "buffer", old="", timeout_s=300)   # a StatefulSet's replacement keeps the name
        wait_metric(e2e_node, NAMESPACE, "kuberl-learner", VERSION_METRIC, above=version + 1)
        timings["buffer_delete_to_training_s"] = round(time.monotonic() - start, 1)
        assert _restarts(e2e_node, "actor") == 0 and _restarts(e2e_node, "learner") == 0, \
            "the actor or the learner restarted when the buffer went: they must reconnect instead"
        timings["actor_fragments_dropped_while_no_buffer"] = pod_metrics(e2e_node, NAMESPACE, actor).get(DROPPED, 0)
        (new_buffer,) = [p.metadata.name for p in pods(e2e_node, NAMESPACE, "buffer")]

        # --- the learner --------------------------------------------------------------------------
        (learner,) = [p.metadata.name for p in pods(e2e_node, NAMESPACE, "learner")]
        assert learner == "kuberl-learner-0"   # rank 0 of the StatefulSet, whose claim holds the checkpoints
        last = pod_metrics(e2e_node, NAMESPACE, learner)[VERSION_METRIC]
        watch = _ActorWatch(e2e_node, actor)   # what the actor's push path does while the learner is replaced
        start = time.monotonic()
        kubectl(e2e_node, "-n", NAMESPACE, "delete", "pod", learner, "--wait=true", timeout_s=200)
        new_learner = _replaced(e2e_node, "learner", old="")   # a StatefulSet's replacement keeps the name
        resumed = pod_metrics(e2e_node, NAMESPACE, new_learner)[VERSION_METRIC]
        # The old learner trained on while it drained; the final checkpoint holds its last version.
        assert resumed >= last, f"the new learner resumed at version {resumed}, below the old one's {last}"
        wait_metric(e2e_node, NAMESPACE, "kuberl-learner", VERSION_METRIC, above=resumed + 1)
        timings["learner_delete_to_training_s"] = round(time.monotonic() - start, 1)
        timings["learner_versions"] = {"before": last, "resumed_at": resumed}
        timings["actor_fragments_dropped_after_learner_replaced"] = pod_metrics(e2e_node, NAMESPACE, actor).get(DROPPED, 0)
        timings["actor_while_learner_replaced"] = watch.stop()

        # --- an actor -----------------------------------------------------------------------------
        # Its last log line (services/actor/main.py) has its final counts; follow the log to read it.
        follow = _follow(e2e_node, actor)
        start = time.monotonic()
        kubectl(e2e_node, "-n", NAMESPACE, "delete", "pod", actor, "--wait=true", timeout_s=200)
        out = _output(follow)
        final = re.search(r"actor \S+ stopped: (\d+) fragments cut, (\d+) acknowledged, (\d+) dropped, (\d+) rejected",
                          out)
        assert final, f"no final counts in the deleted actor's log:\n{out[-2000:]}"
        cut, acked, dropped, rejected = map(int, final.groups())
        stored = pod_metrics(e2e_node, NAMESPACE, new_buffer)["kuberl_buffer_fragments_received_total"]
        successors = [p.metadata.name for p in pods(e2e_node, NAMESPACE, "actor") if p.metadata.name != actor]
        by_successor = sum(_pushed(e2e_node, name) for name in successors)   # read after `stored`
        assert rejected == 0, f"the deleted actor had {rejected} fragments refused"
        assert stored - by_successor <= acked - acked_at_gone <= stored, (
            f"acknowledged after the buffer's replacement: {acked - acked_at_gone}; the new buffer stored {stored} "
            f"(of which at most {by_successor}, what the replacement actor had sent, from it)")
        at_shutdown = re.search(r"buffer unreachable at shutdown: (\d+) fragments not delivered", out)
        timings["deleted_actor_fragments"] = {"cut": cut, "acknowledged": acked, "dropped": dropped,
                                              "dropped_at_shutdown": int(at_shutdown.group(1)) if at_shutdown else 0,
                                              "acknowledged_by_new_buffer": acked - acked_at_gone,
                                              "stored_by_new_buffer": stored, "from_replacement_actor": by_successor}
        new_actor = _replaced(e2e_node, "actor", old=actor)
        deadline = time.monotonic() + 120
        while pod_metrics(e2e_node, NAMESPACE, new_actor).get("kuberl_actor_env_steps_total", 0) == 0:
            assert time.monotonic() < deadline, f"the replacement actor {new_actor} did not step within 120 s"
            time.sleep(1)
        version = metrics(e2e_node, NAMESPACE, "kuberl-learner")[VERSION_METRIC]
        wait_metric(e2e_node, NAMESPACE, "kuberl-learner", VERSION_METRIC, above=version + 1)
        timings["actor_delete_to_training_s"] = round(time.monotonic() - start, 1)
        e2e_report["pod_deletion"] = timings


def dqn_with_replay_checkpoints(config: dict) -> None:
    """CartPole DQN, one actor and one learner, the replay large enough not to wrap in the test."""
    fixed_topology(config)
    config.pop("ppo", None)
    config["algorithm"] = "dqn"
    config["dqn"] = {"rollout_steps": 16, "buffer_size": 200_000, "batch_size": 64, "learning_starts": 1000,
                     "replay_ratio": 8.0, "hidden_sizes": [64, 64]}
    config["buffer"] = {"checkpoint_interval_s": 3600}   # only the final checkpoint, written at SIGTERM


def test_a_deleted_replay_buffer_with_its_claim_loses_nothing_acknowledged(e2e_node, e2e_images, e2e_report):
    """DQN with k8s/components/buffer-checkpoints (the replay's claim, --checkpoint-dir on it): the
    deleted buffer acknowledges what it stored (A0 = its count), writes its final checkpoint at SIGTERM,
    and the replacement restores every sample it held, so nothing acknowledged is lost."""
    overlay = e2e_node.workdir / "dqn-replay-overlay"
    overlay.mkdir(exist_ok=True)
    rel = lambda p: os.path.relpath(ROOT / p, overlay)   # noqa: E731 - kustomize takes no absolute dirs
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": NAMESPACE, "resources": [rel("k8s/overlays/dev")],
        "components": [rel("k8s/components/buffer-checkpoints")]}))
    with fresh_namespace(e2e_node, NAMESPACE):
        manifest = adapt(kubectl(e2e_node, "kustomize", str(overlay)))
        kubectl(e2e_node, "apply", "-f", "-", input=with_config(manifest, dqn_with_replay_checkpoints))
        wait_ready(e2e_node, NAMESPACE, timeout_s=400)
        wait_metric(e2e_node, NAMESPACE, "kuberl-learner", VERSION_METRIC, above=2)
        (buffer,) = [p.metadata.name for p in pods(e2e_node, NAMESPACE, "buffer")]
        (actor,) = [p.metadata.name for p in pods(e2e_node, NAMESPACE, "actor")]
        deadline = time.monotonic() + 120
        while pod_metrics(e2e_node, NAMESPACE, actor).get(ACKED, 0) < ACKED_BEFORE_DELETE:
            assert time.monotonic() < deadline, "the actor had too few fragments acknowledged after 120 s"
            time.sleep(1)
        version = metrics(e2e_node, NAMESPACE, "kuberl-learner")[VERSION_METRIC]
        follow = _follow(e2e_node, buffer)
        start = time.monotonic()
        kubectl(e2e_node, "-n", NAMESPACE, "delete", "pod", buffer, "--wait=true", timeout_s=200)
        acked_at_gone = pod_metrics(e2e_node, NAMESPACE, actor)[ACKED]
        out = _output(follow)
        last = re.search(r"buffer stopped: (\d+) fragments received \((\d+) samples\), (\d+) samples served, "
                         r"(\d+) held \(in its last checkpoint\)", out)
        assert last, f"no final counts, or no final checkpoint, in the deleted buffer's log:\n{out[-2000:]}"
        stored, samples, _, held = map(int, last.groups())
        assert acked_at_gone >= ACKED_BEFORE_DELETE and acked_at_gone == stored, (
            f"the old buffer stored {stored} fragments and acknowledged {acked_at_gone} of them to the actor")
        assert held == samples, f"the old buffer held {held} of the {samples} samples it took (a ring that wrapped?)"
        new_buffer = _replaced(e2e_node, "buffer", old="", timeout_s=300)
        restored = pod_metrics(e2e_node, NAMESPACE, new_buffer)["kuberl_buffer_checkpoint_restored_samples"]
        assert restored == held, f"the new buffer restored {restored} samples of the {held} the old one held"
        wait_metric(e2e_node, NAMESPACE, "kuberl-learner", VERSION_METRIC, above=version + 1)
        e2e_report["replay_buffer_deletion"] = {
            "fragments_stored_and_acknowledged": stored, "samples_held": held, "samples_restored": restored,
            "delete_to_training_s": round(time.monotonic() - start, 1)}

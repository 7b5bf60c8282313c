"""What the e2e tests do to and read from the cluster: render + adapt + apply, wait for pods, read metrics.

Everything goes through the real API server: kubectl for apply (as a user would), the Python client
for waiting, and the API server's service proxy for /metrics (as `kubectl proxy` users read them).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path

from tests.e2e.adapt import adapt
from tests.e2e.node import Node

ROOT = Path(__file__).resolve().parents[2]


def kubectl(node: Node, *args: str, input: str | None = None, timeout_s: float = 120) -> str:
    proc = node.cluster.kubectl(*args, input=input, timeout_s=timeout_s)
    assert proc.returncode == 0, f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}\n{proc.stdout}"
    return proc.stdout


def render_overlay(node: Node, overlay: str) -> str:
    """`kubectl kustomize` of an overlay, adapted for the 1.20 node (tests/e2e/adapt.py)."""
    return adapt(kubectl(node, "kustomize", str(ROOT / overlay)))


# Learner pods the 2-core e2e node has room for beside the other roles (each asks for 500m in the dev
# overlay and in test_helm's values); the tests cap planner.learner.max at it (fit_node).
NODE_LEARNERS = 2


def provide_volumes(node: Node, count: int = 1 + NODE_LEARNERS, size: str = "10Gi") -> list[str]:
    """Fresh hostPath PersistentVolumes (new names, empty directories under the node's work dir) for the
    PVCs the manifests make (there is no provisioner): one per learner pod (the StatefulSet's
    volumeClaimTemplates give each its own claim, checkpoints-kuberl-learner-<i>), up to NODE_LEARNERS,
    and one for the buffer's replay claim (k8s/components/buffer-checkpoints, Helm buffer.checkpoint).
    Fresh, so no test restores another's checkpoints. Owned by the images' uid 10001: fsGroup does not
    apply to hostPath volumes."""
    import os
    import uuid

    from kubernetes import client
    names = []
    with node.cluster.admin() as api:
        core = client.CoreV1Api(api)
        for _ in range(count):
            name = f"e2e-pv-{uuid.uuid4().hex[:8]}"
            path = node.workdir / "volumes" / name
            path.mkdir(parents=True)
            os.chown(path, 10001, 10001)
            core.create_persistent_volume({
                "metadata": {"name": name, "labels": {"kuberl-e2e": "volume"}},
                "spec": {"capacity": {"storage": size}, "accessModes": ["ReadWriteOnce"],
                         "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(path)}}})
            names.append(name)
    return names


def release_volumes(node: Node) -> None:
    """Delete every PV provide_volumes made and its directory (after the namespace, and so its claims,
    is gone)."""
    import shutil

    from kubernetes import client
    with node.cluster.admin() as api:
        core = client.CoreV1Api(api)
        for pv in core.list_persistent_volume(label_selector="kuberl-e2e=volume").items:
            core.delete_persistent_volume(pv.metadata.name)
            shutil.rmtree(node.workdir / "volumes" / pv.metadata.name, ignore_errors=True)


@contextmanager
def fresh_namespace(node: Node, namespace: str):
    """A test's deployment scope: fresh volumes for its claims (provide_volumes) and, on leaving, its
    namespace deleted (its pods and claims with it) and the volumes released."""
    provide_volumes(node)
    try:
        yield
    finally:
        node.delete_namespace(namespace)
        release_volumes(node)


def workloads_ready(node: Node, namespace: str) -> tuple[bool, str]:
    """(all ready, what is not): every Deployment and StatefulSet has as many ready replicas as it
    wants (at least one), and every pod of the namespace is Ready."""
    from kubernetes import client
    waiting = []
    with node.cluster.admin() as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        sets = apps.list_namespaced_deployment(namespace).items + apps.list_namespaced_stateful_set(namespace).items
        if not sets:
            waiting.append("no workloads yet")
        for s in sets:
            want = s.spec.replicas if s.spec.replicas is not None else 1
            ready = s.status.ready_replicas or 0
            if want < 1 or ready < want:
                waiting.append(f"{s.kind or type(s).__name__} {s.metadata.name}: {ready}/{want} ready")
        for pod in core.list_namespaced_pod(namespace).items:
            if not pod_ready(pod):
                states = [f"{cs.name}={_state(cs)}" for cs in pod.status.container_statuses or []]
                waiting.append(f"pod {pod.metadata.name}: {pod.status.phase} {' '.join(states)}")
    return not waiting, "; ".join(waiting)


def pod_ready(pod) -> bool:
    """Whether a pod (kubernetes client V1Pod) has condition Ready=True."""
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def _state(cs) -> str:
    if cs.state.waiting:
        return f"waiting({cs.state.waiting.reason})"
    if cs.state.terminated:
        return f"terminated({cs.state.terminated.reason}, code {cs.state.terminated.exit_code})"
    return "running" + ("" if cs.ready else " (not ready)") + (f", restarts {cs.restart_count}" if cs.restart_count else "")


def wait_ready(node: Node, namespace: str, timeout_s: float = 300) -> float:
    """Seconds until workloads_ready; fails with what is still waiting and the pods' recent logs."""
    start = time.monotonic()
    deadline = start + timeout_s
    what = ""
    while time.monotonic() < deadline:
        ok, what = workloads_ready(node, namespace)
        if ok:
            return time.monotonic() - start
        time.sleep(1)
    raise AssertionError(f"namespace {namespace} not ready within {timeout_s:.0f} s: {what}\n"
                         f"{pod_logs(node, namespace)}\nkubelet:\n{node.log('kubelet', 20)}")


def pod_logs(node: Node, namespace: str, lines: int = 15) -> str:
    from kubernetes import client
    out = []
    with node.cluster.admin() as api:
        core = client.CoreV1Api(api)
        for pod in core.list_namespaced_pod(namespace).items:
            for c in pod.spec.containers:
                try:
                    text = core.read_namespaced_pod_log(pod.metadata.name, namespace, container=c.name,
                                                        tail_lines=lines)
                except Exception as e:   # a pod not started yet has no log
                    text = f"(no log: {getattr(e, 'reason', e)})"
                out.append(f"--- {pod.metadata.name}/{c.name}\n{text}")
    return "\n".join(out)


def metrics(node: Node, namespace: str, service: str, port: str = "metrics") -> dict[str, float]:
    """A Service's /metrics read through the API server's service proxy, as {name: value} (samples
    without labels only)."""
    from kubernetes import client
    with node.cluster.admin() as api:
        text = client.CoreV1Api(api).connect_get_namespaced_service_proxy_with_path(
            f"{service}:{port}", namespace, "metrics", _preload_content=False).data.decode()
    return _parse_metrics(text)


def wait_metric(node: Node, namespace: str, service: str, name: str, above: float,
                timeout_s: float = 300) -> tuple[float, float]:
    """(value, seconds) once `name` exceeds `above`; fails with the last value and the pods' logs."""
    start = time.monotonic()
    deadline = start + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = metrics(node, namespace, service).get(name)
        except Exception as e:   # no ready endpoint for a moment (a pod restarting)
            last = f"unreadable: {e}"
        if isinstance(last, float) and last > above:
            return last, time.monotonic() - start
        time.sleep(2)
    raise AssertionError(f"{service} {name} did not exceed {above} within {timeout_s:.0f} s (last: {last})\n"
                         f"{pod_logs(node, namespace)}")


VERSION_METRIC = "kuberl_learner_policy_version"


def assert_trains(node: Node, namespace: str, report: dict, key: str, start: float, versions: int = 2) -> None:
    """Every pod Ready, then the learner's policy version rises by `versions` and the actors report env
    steps; records apply-to-ready and apply-to-training seconds (from `start`) under report[key]."""
    ready_s = wait_ready(node, namespace, timeout_s=400)
    first = metrics(node, namespace, "kuberl-learner").get(VERSION_METRIC, 0.0)
    version, waited = wait_metric(node, namespace, "kuberl-learner", VERSION_METRIC, above=first + versions - 1)
    steps = metrics(node, namespace, "kuberl-actor").get("kuberl_actor_env_steps_total", 0.0)
    assert steps > 0, "the actor pods report no env steps although the learner's version rose"
    report[key] = {"apply_to_ready_s": round(ready_s, 1), "apply_to_training_s": round(time.monotonic() - start, 1),
                   "policy_version_at_ready": first, "policy_version_later": version}


def fit_node(config: dict) -> None:
    """The experiment config (a with_config change) with no more learners than the node has room and
    volumes for (NODE_LEARNERS): a learner pod past that would stay Pending."""
    learner = config.setdefault("planner", {}).setdefault("learner", {})
    learner["max"] = min(learner.get("max", NODE_LEARNERS), NODE_LEARNERS)


def with_config(manifest: str, change) -> str:
    """The rendered manifest with the experiment config (the kuberl-config ConfigMap) passed through
    change(config_dict), as a user would edit k8s/base/config.yaml."""
    import yaml
    docs = [d for d in yaml.safe_load_all(manifest) if d]
    for d in docs:
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kuberl-config"):
            config = yaml.safe_load(d["data"]["config.yaml"])
            change(config)
            d["data"]["config.yaml"] = yaml.safe_dump(config)
    return yaml.safe_dump_all(docs, sort_keys=False)


def pod_metrics(node: Node, namespace: str, pod: str, port: int = 9400) -> dict[str, float]:
    """One pod's /metrics through the API server's pod proxy (unlabelled samples)."""
    from kubernetes import client
    with node.cluster.admin() as api:
        text = client.CoreV1Api(api).connect_get_namespaced_pod_proxy_with_path(
            f"{pod}:{port}", namespace, "metrics", _preload_content=False).data.decode()
    return _parse_metrics(text)


def pod_metrics_or_empty(node: Node, namespace: str, pod: str) -> dict[str, float]:
    """pod_metrics, or {} while the pod is not there or not serving yet."""
    try:
        return pod_metrics(node, namespace, pod)
    except Exception:
        return {}


def wait_until(node: Node, namespace: str, what: str, predicate, timeout_s: float = 300,
               log_pod: str = "kuberl-learner-0") -> float:
    """Seconds until `predicate()` holds, polled once a second; AssertionError naming `what` with the
    tail of `log_pod`'s log when it does not within `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(1)
    logs = kubectl(node, "-n", namespace, "logs", log_pod, "--tail=30")
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s; {log_pod}'s log:\n{logs}")


def _parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" in line or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        try:
            values[name] = float(value)
        except ValueError:
            continue
    return values


def pods(node: Node, namespace: str, component: str) -> list:
    from kubernetes import client
    with node.cluster.admin() as api:
        return client.CoreV1Api(api).list_namespaced_pod(
            namespace, label_selector=f"app.kubernetes.io/component={component}").items


class Simulator:
    """An outside simulator for the external-mode tests: 8 CartPole-v1 copies stepped by
    kuberl_client.gym.serve_gym_env against `address`, in a thread, as a game server or robot would;
    `client_kw` are serve_gym_env's TLS and token options. Used as a context manager, it is asked to
    stop and joined on the way out; `finish()` does that too and checks that it ended on request, without
    an error, having stepped episodes; it returns serve_gym_env's result."""

    def __init__(self, address: str, session_id: str, **client_kw):
        import gymnasium as gym

        self.address, self.session_id, self.client_kw = address, session_id, client_kw
        self.envs = gym.make_vec("CartPole-v1", num_envs=8, vectorization_mode="sync",
                                 vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
        self.stop = threading.Event()
        self.result: dict = {}
        self.thread = threading.Thread(target=self._run, name=f"e2e-simulator-{session_id}", daemon=True)
        self.started = 0.0

    def _run(self) -> None:
        from kuberl_client.gym import serve_gym_env

        try:
            self.result.update(serve_gym_env(self.envs, self.address, session_id=self.session_id, stop=self.stop,
                                             seed=0, **self.client_kw))
        except Exception as e:   # reported by finish()
            self.result["error"] = repr(e)

    def __enter__(self) -> Simulator:
        self.started = time.monotonic()
        self.thread.start()
        return self

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive(), "the simulator did not stop within 60 s of being asked"
        assert "error" not in self.result, self.result["error"]
        assert self.result["episodes"] > 0 and self.result["env_steps"] > 0, self.result
        return self.result

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)
        if not self.thread.is_alive():
            self.envs.close()


def assert_policies_train_and_actors_scale(node: Node, namespace: str, policies: tuple[str, ...], start: float) -> dict:
    """A run of several policies applied (a release of the chart, or k8s/overlays/policies) whose actor
    starts capped: every pod Ready, a learner StatefulSet per policy (kuberl-learner-<policy>, one pod),
    each policy's version rising; the planner scales the actor Deployment to 2, leaves each policy's
    learners at 1, and reports both it read (its Role names every policy's StatefulSet). Returns the
    seconds, from `start`, for the e2e report."""
    from kubernetes import client
    ready_s = wait_ready(node, namespace, timeout_s=400)
    assert sorted(p.metadata.name for p in pods(node, namespace, "learner")) == [
        f"kuberl-learner-{p}-0" for p in policies]   # (and no one-policy learner group beside them)
    versions = {}
    for policy in policies:   # each policy's learner trains on its own agents' samples
        versions[policy], _ = wait_metric(node, namespace, f"kuberl-learner-{policy}", VERSION_METRIC, above=2)
    training_s = time.monotonic() - start
    with node.cluster.admin() as api:
        apps = client.AppsV1Api(api)
        scaled_s = wait_until(
            node, namespace, "the planner scaled the actor Deployment to 2",
            lambda: (apps.read_namespaced_deployment("kuberl-actor", namespace).spec.replicas or 1) == 2,
            log_pod="deploy/kuberl-planner")
        assert [apps.read_namespaced_stateful_set(f"kuberl-learner-{p}", namespace).spec.replicas
                for p in policies] == [1] * len(policies)
    log = kubectl(node, "-n", namespace, "logs", "deploy/kuberl-planner")
    # (Why it scaled, each policy's learners weighed by its share, is in the planner's decisions:
    # tests/integration/test_planner_kube_e2e.py reads them.)
    assert f"scaled actor (Deployment {namespace}/kuberl-actor) to 2" in log, log[-3000:]
    planner = metrics(node, namespace, "kuberl-planner")
    for policy in policies:
        assert planner.get(f"kuberl_planner_policies_{policy}_learner_replicas") == 1, planner
        assert planner.get(f"kuberl_planner_policies_{policy}_learner_rate_per_replica", 0) > 0, planner
    return {"apply_to_ready_s": round(ready_s, 1), "apply_to_training_s": round(training_s, 1),
            "policy_versions": versions, "training_to_actors_scaled_s": round(scaled_s, 1)}

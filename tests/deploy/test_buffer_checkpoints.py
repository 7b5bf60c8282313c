"""The buffer's replay checkpoints on Kubernetes: Helm `buffer.checkpoint.*` and the kustomize component
k8s/components/buffer-checkpoints (docs/deploy.md, docs/reliability.md "Buffer checkpoints").

- Enabled, the chart renders a ReadWriteOnce PersistentVolumeClaim, mounts it into the buffer pod,
  passes `--checkpoint-dir` pointing into it (parsed by the buffer's own parser), makes the volume
  writable (fsGroup), gives the pod a grace period that covers the drain and two saves, and renders
  the interval and the number kept into the config; with existingClaim it mounts that claim and
  makes none; disabled, none of it (and the defaults render exactly as before: test_crosscheck's
  chart-vs-base agreement). The values schema rejects bad values.
- The kustomize component, over every overlay, renders and validates, and makes the same buffer pod
  and claim as the chart.
- Both apply with a server-side dry run on a real kube-apiserver (skipped where there is none).
- The buffer started with the rendered args and config checkpoints on SIGTERM within the rendered
  grace period, and a restart on the same directory restores the replay.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import yaml

from kuberl.v1 import buffer_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from services.buffer import main as buffer_main
from services.config import load_config
from tests.deploy.render import (OVERLAYS, ROOT, RenderError, container, helm_template, index, kustomize,
                                 kustomize_with, of_kind, validate, workloads)
from tests.deploy.test_crosscheck import _comparable
from tests.fragments import make_fragment

COMPONENT = "components/buffer-checkpoints"
MOUNT = "/var/lib/kuberl/replay"
ENABLED = ["--set", "buffer.checkpoint.enabled=true"]
DQN = ["--set", "config.algorithm=dqn"]
# The measured save of the largest ring docs/reliability.md names (the Pong config's 100k Atari
# transitions, 5.6 GB: 35-40 s on a local disk). At SIGTERM a save under way finishes and a final one
# follows, after the drain under SHUTDOWN_DEADLINE_S.
LARGEST_SAVE_S = 40


def buffer_parts(objects: list[dict]) -> tuple[dict, dict, dict, dict]:
    """The buffer's workload, its container, pod spec and volumes by name."""
    w = workloads(objects)["buffer"]
    pod = w["spec"]["template"]["spec"]
    return w, container(w), pod, {v["name"]: v for v in pod["volumes"]}


def checkpoint_dir_arg(c: dict, monkeypatch) -> str | None:
    """--checkpoint-dir as the buffer's own parser reads the container's args (no env to fall back on)."""
    monkeypatch.delenv("KUBERL_BUFFER_CHECKPOINT_DIR", raising=False)
    return buffer_main.parse_args(c["args"]).checkpoint_dir


def loaded_config(objects: list[dict], tmp_path):
    (cm,) = [o for o in of_kind(objects, "ConfigMap") if "config.yaml" in o.get("data", {})]
    (tmp_path / "config.yaml").write_text(cm["data"]["config.yaml"])
    return load_config(str(tmp_path / "config.yaml")), yaml.safe_load(cm["data"]["config.yaml"])


def assert_checkpoints_on_claim(objects: list[dict], claim: str, monkeypatch) -> None:
    """The buffer pod checkpoints into a volume of `claim`, can write it, and outlives its saves."""
    w, c, pod, volumes = buffer_parts(objects)
    directory = checkpoint_dir_arg(c, monkeypatch)
    assert directory == MOUNT
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == directory]
    assert not mount.get("readOnly")
    assert volumes[mount["name"]]["persistentVolumeClaim"] == {"claimName": claim}
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"] == 10001
    # A ReadWriteOnce volume: never two pods at once. A StatefulSet replaces its pod only after the old
    # one is gone (RollingUpdate; Recreate does not exist for it); a Deployment would need Recreate.
    if w["kind"] == "StatefulSet":
        assert w["spec"]["replicas"] == 1
        assert w["spec"].get("updateStrategy", {}).get("type", "RollingUpdate") == "RollingUpdate"
    else:
        assert w["spec"]["strategy"]["type"] == "Recreate"
    assert pod["terminationGracePeriodSeconds"] >= buffer_main.SHUTDOWN_DEADLINE_S + 2 * LARGEST_SAVE_S


# ---- Helm ------------------------------------------------------------------------------------------------
def test_helm_enabled_renders_a_claim_mount_flag_and_grace(monkeypatch, tmp_path):
    objects = helm_template(*ENABLED, *DQN)
    assert validate(objects) == []
    pvc = index(objects)[("PersistentVolumeClaim", "kuberl-buffer-replay")]
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert "storageClassName" not in pvc["spec"]                         # the cluster's default class
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert pvc["metadata"]["labels"]["app.kubernetes.io/component"] == "buffer"
    assert_checkpoints_on_claim(objects, "kuberl-buffer-replay", monkeypatch)
    cfg, raw = loaded_config(objects, tmp_path)
    assert (cfg.buffer.checkpoint_interval_s, cfg.buffer.keep_checkpoints) == (300, 2)
    assert cfg.buffer.checkpoint_dir is None and "checkpoint_dir" not in raw["buffer"]   # the flag sets it
    # The learners' claims (their StatefulSet's template) and mount are untouched.
    learner, plain = workloads(objects)["learner"], workloads(helm_template(*DQN))["learner"]
    assert container(learner) == container(plain)
    assert {k: v for k, v in learner["spec"].items() if k != "template"} == {
        k: v for k, v in plain["spec"].items() if k != "template"}
    assert [t["metadata"]["name"] for t in learner["spec"]["volumeClaimTemplates"]] == ["checkpoints"]


def test_helm_values_reach_the_claim_and_the_config(monkeypatch, tmp_path):
    objects = helm_template(*ENABLED, "--set", "buffer.checkpoint.size=50Gi",
                            "--set", "buffer.checkpoint.storageClassName=fast-ssd",
                            "--set", "buffer.checkpoint.intervalSeconds=600", "--set", "buffer.checkpoint.keep=3",
                            "--set", "buffer.checkpoint.terminationGracePeriodSeconds=300",
                            "--set", "nameOverride=rl")
    assert validate(objects) == []
    pvc = index(objects)[("PersistentVolumeClaim", "rl-buffer-replay")]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert pvc["spec"]["storageClassName"] == "fast-ssd"
    assert_checkpoints_on_claim(objects, "rl-buffer-replay", monkeypatch)
    assert buffer_parts(objects)[2]["terminationGracePeriodSeconds"] == 300
    cfg, _ = loaded_config(objects, tmp_path)
    assert (cfg.buffer.checkpoint_interval_s, cfg.buffer.keep_checkpoints) == (600, 3)


def test_helm_existing_claim_is_mounted_and_no_claim_is_made(monkeypatch):
    objects = helm_template(*ENABLED, "--set", "buffer.checkpoint.existingClaim=my-replay")
    assert validate(objects) == []
    assert of_kind(objects, "PersistentVolumeClaim") == []   # (the learners' come from their StatefulSet)
    assert_checkpoints_on_claim(objects, "my-replay", monkeypatch)


def test_helm_disabled_renders_none_of_it(monkeypatch, tmp_path):
    objects = helm_template()     # the default
    w, c, pod, volumes = buffer_parts(objects)
    assert of_kind(objects, "PersistentVolumeClaim") == []
    assert checkpoint_dir_arg(c, monkeypatch) is None
    assert set(volumes) == {"config", "tmp"}
    assert {m["name"] for m in c["volumeMounts"]} == {"config", "tmp"}
    assert "fsGroup" not in pod["securityContext"]
    assert pod["terminationGracePeriodSeconds"] == 30
    assert "updateStrategy" not in w["spec"]
    cfg, raw = loaded_config(objects, tmp_path)
    assert "buffer" not in raw and cfg.buffer.checkpoint_dir is None
    # Settings without enabled change nothing either.
    assert helm_template("--set", "buffer.checkpoint.intervalSeconds=600", "--set", "buffer.checkpoint.size=1Gi") == objects


@pytest.mark.parametrize("values, message", [
    (["--set", "buffer.checkpoint.enabled=yes"], "buffer.checkpoint.enabled: Invalid type. Expected: boolean"),
    (["--set", "buffer.checkpoint.size=10"], "buffer.checkpoint.size: Invalid type. Expected: string"),
    (["--set", "buffer.checkpoint.size=10GB"], "buffer.checkpoint.size: Does not match pattern"),
    (["--set", "buffer.checkpoint.intervalSeconds=0"], "buffer.checkpoint.intervalSeconds"),   # config: >= 1
    (["--set", "buffer.checkpoint.keep=0"], "buffer.checkpoint.keep"),
    (["--set", "buffer.checkpoint.terminationGracePeriodSeconds=1.5"], "terminationGracePeriodSeconds"),
    (["--set", "buffer.checkpoint.existingClaim=My_Claim"], "buffer.checkpoint.existingClaim"),
    (["--set", "buffer.checkpoint.accessMode=ReadWriteMany"], "accessMode"),                    # unknown key
])
def test_values_schema_rejects_bad_checkpoint_values(values, message):
    with pytest.raises(RenderError) as err:
        helm_template(*values)
    assert "values don't meet the specifications of the schema" in str(err.value)
    assert message in str(err.value)


@pytest.mark.parametrize("key, value", [("checkpoint_dir", "/var/lib/kuberl/replay"),
                                        ("checkpoint_interval_s", "60"), ("keep_checkpoints", "3")])
def test_checkpoint_settings_under_config_are_refused(key, value):
    """One place for them: the chart sets the config's buffer.checkpoint_* from buffer.checkpoint."""
    with pytest.raises(RenderError) as err:
        helm_template(*ENABLED, "--set", f"config.buffer.{key}={value}")
    assert f"config.buffer.{key}: the chart sets it; use buffer.checkpoint." in str(err.value)


# ---- kustomize -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_component_renders_and_validates(overlay, monkeypatch):
    plain = kustomize(overlay)
    objects = kustomize_with(overlay, COMPONENT)
    assert validate(objects) == []
    pvc = index(objects)[("PersistentVolumeClaim", "kuberl-buffer-replay")]
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"] and pvc["spec"]["resources"]["requests"]["storage"] == "10Gi"
    # The labels k8s/base gives its buffer objects, though the component adds no `labels:` transformer:
    # that would relabel every object of the overlay that adds it (its Namespace, say).
    assert pvc["metadata"]["labels"] == index(objects)[("Service", "kuberl-buffer")]["metadata"]["labels"]
    assert pvc["metadata"].get("namespace") == "kuberl"
    assert_checkpoints_on_claim(objects, "kuberl-buffer-replay", monkeypatch)
    # It adds to the buffer and nothing else: every other object is as the overlay renders it.
    changed = {(o["kind"], o["metadata"]["name"]) for o in objects} ^ {(o["kind"], o["metadata"]["name"]) for o in plain}
    assert changed == {("PersistentVolumeClaim", "kuberl-buffer-replay")}
    others = [o for o in objects if o["metadata"]["name"] not in ("kuberl-buffer", "kuberl-buffer-replay")]
    assert others == [o for o in kustomize_with(overlay) if o["metadata"]["name"] != "kuberl-buffer"]
    # The buffer keeps the overlay's own patches (e.g. the dev overlay's smaller requests).
    assert container(workloads(objects)["buffer"])["resources"] == container(workloads(plain)["buffer"])["resources"]


def test_kustomize_component_and_helm_make_the_same_buffer(tmp_path):
    def comparable(objects):
        out = _comparable(objects, tmp_path)
        for pod in out["pods"].values():   # the same mounts; kustomize's merge puts the new one first
            pod["container"]["volumeMounts"] = sorted(pod["container"]["volumeMounts"], key=lambda m: m["name"])
        return out
    base = comparable(kustomize_with("base", COMPONENT, namespace=None))
    chart = comparable(helm_template(*ENABLED))
    for key in base:
        assert chart[key] == base[key], key
    (k_pvc,) = [p for p in of_kind(kustomize_with("base", COMPONENT, namespace=None), "PersistentVolumeClaim")
                if p["metadata"]["name"] == "kuberl-buffer-replay"]
    h_pvc = index(helm_template(*ENABLED))[("PersistentVolumeClaim", "kuberl-buffer-replay")]
    assert k_pvc["spec"] == h_pvc["spec"]
    assert (workloads(kustomize_with("base", COMPONENT, namespace=None))["buffer"]["spec"]["updateStrategy"]
            == workloads(helm_template(*ENABLED))["buffer"]["spec"]["updateStrategy"])


def test_component_patch_refuses_a_buffer_whose_first_container_is_another(tmp_path):
    """The args patch addresses containers/0; its JSON-patch `test` op fails the build if that is not the
    buffer, rather than give the flag to another container."""
    work = tmp_path / "k8s"
    (work / "components").mkdir(parents=True)
    subprocess.run(["cp", "-r", str(ROOT / "k8s" / "base"), str(work / "base")], check=True)
    subprocess.run(["cp", "-r", str(ROOT / "k8s" / COMPONENT), str(work / COMPONENT)], check=True)
    sts = work / "base" / "buffer.yaml"
    doc = yaml.safe_load(sts.read_text())
    doc["spec"]["template"]["spec"]["containers"].insert(0, {"name": "sidecar", "image": "busybox", "args": []})
    sts.write_text(yaml.safe_dump(doc))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": ["k8s/base"], "components": [f"k8s/{COMPONENT}"]}))
    from tests.deploy.render import tool
    out = subprocess.run([tool("kubectl"), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "test" in out.stderr.lower(), out.stderr


# ---- a real kube-apiserver -------------------------------------------------------------------------------
@pytest.mark.parametrize("render", ["kustomize base+component", "helm enabled", "helm existingClaim"])
def test_applies_with_server_side_dry_run(render, k8s_cluster, k8s_namespace):
    from tests.deploy.test_kube_apiserver import apply, for_this_server
    rendered = {"kustomize base+component": lambda: kustomize_with("base", COMPONENT, namespace=None),
                "helm enabled": lambda: helm_template(*ENABLED, *DQN, namespace=k8s_namespace),
                "helm existingClaim": lambda: helm_template(*ENABLED, "--set", "buffer.checkpoint.existingClaim=mine",
                                                            namespace=k8s_namespace)}[render]()
    objects, _ = for_this_server(k8s_cluster, rendered)
    out = apply(k8s_cluster, k8s_namespace, objects, "--dry-run=server")
    assert out.returncode == 0, out.stderr
    applied = [line for line in out.stdout.splitlines() if line.endswith("serverside-applied (server dry run)")]
    assert len(applied) == len(objects), out.stdout
    assert any(line.startswith("statefulset.apps/") for line in applied)
    claims = of_kind(objects, "PersistentVolumeClaim")   # none with existingClaim: the user made it
    assert len(claims) == (render != "helm existingClaim")
    assert sum(line.startswith("persistentvolumeclaim/") for line in applied) == len(claims)


# ---- the buffer, as the rendered pod runs it ----------------------------------------------------------------
def start_buffer(c: dict, overrides: dict[str, str], workdir, tag: str) -> tuple[subprocess.Popen, str]:
    """`python -m services.buffer` with the container's args, the flags in `overrides` replaced."""
    args = [a for a in c["args"] if a.split("=", 1)[0] not in overrides]
    ready = workdir / f"{tag}.ready"
    args += [f"{k}={v}" for k, v in overrides.items()] + [f"--ready-file={ready}"]
    env = {k: v for k, v in os.environ.items() if k != "KUBERL_BUFFER_CHECKPOINT_DIR"}
    with open(workdir / f"{tag}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.buffer", *args], stdout=log, stderr=log, cwd=ROOT,
                                env=env)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, (workdir / f"{tag}.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the buffer did not start in 60 s"
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["address"]


def buffer_stats(address: str) -> dict[str, float]:
    with grpc.insecure_channel(address) as channel:
        stub = buffer_pb2_grpc.BufferStub(channel)
        return dict(stub.GetStats(pb.GetStatsRequest(), timeout=30).metrics)


def test_rendered_buffer_checkpoints_on_sigterm_and_restores(tmp_path):
    objects = helm_template(*ENABLED, *DQN)
    _, c, pod, _ = buffer_parts(objects)
    (tmp_path / "config.yaml").write_text(of_kind(objects, "ConfigMap")[0]["data"]["config.yaml"])
    volume = tmp_path / "replay"          # stands in for the claim mounted at MOUNT
    volume.mkdir()
    overrides = {"--config": str(tmp_path / "config.yaml"), "--listen": "127.0.0.1:0",
                 "--metrics-listen": "127.0.0.1:0", "--checkpoint-dir": str(volume)}
    assert f"--checkpoint-dir={MOUNT}" in c["args"]
    proc, address = start_buffer(c, overrides, tmp_path, "first")
    try:
        with grpc.insecure_channel(address) as channel:
            stub = buffer_pb2_grpc.BufferStub(channel)
            sent = [make_fragment("actor-a", seq, T=8, N=2, algorithm=pb.ALGORITHM_DQN, fill=seq) for seq in range(5)]
            ack = stub.PushTrajectories(iter(sent), timeout=30)
            assert ack.accepted == 5
        assert buffer_stats(address)["buffer/size_samples"] == 80
        assert list(volume.iterdir()) == []   # the interval (300 s) has not come round: only SIGTERM saves
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)      # as the kubelet does
        assert proc.wait(pod["terminationGracePeriodSeconds"]) == 0, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() - started < pod["terminationGracePeriodSeconds"]
    finally:
        proc.kill()
        proc.wait()
    assert [p.name for p in volume.iterdir()] == ["replay-000000000001.npz"]
    proc, address = start_buffer(c, overrides, tmp_path, "second")   # the replacement pod, same claim
    try:
        after = buffer_stats(address)
        assert after["buffer/size_samples"] == after["buffer/checkpoint_restored_samples"] == 80
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(pod["terminationGracePeriodSeconds"]) == 0

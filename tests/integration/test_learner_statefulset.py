"""Learners as the pods of a StatefulSet (services/learner/membership.py), as real processes against a
stand-in for the API server's `statefulsets/scale`: the group follows the replica count the planner
writes, forming again inside the same processes (no restart), and survives a pod that is killed and
comes back, as a StatefulSet brings it back."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
import torch.distributed as dist
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kuberl.v1 import learner_pb2_grpc
from services.common.local.procs import free_port
from services.learner.distributed import STORE_PREFIX, host_port
from services.learner.membership import MembershipError, ScaleReader, split_ordinal
from tests.helpers import TINY_PPO, Service, stats, wait_for, write_config

NAMESPACE, NAME = "rl", "kuberl-learner"
SCALE_PATH = f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/{NAME}/scale"


class FakeScaleApi:
    """`GET .../statefulsets/kuberl-learner/scale` answering the replicas the test sets; any other path
    404; `status` (when set) answers that HTTP status instead. Records the Authorization headers seen."""

    def __init__(self, replicas: int):
        self.replicas, self.status, self.auth = replicas, 0, set()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                api.auth.add(self.headers.get("Authorization", ""))
                if api.status or self.path != SCALE_PATH:
                    self.send_response(api.status or 404)
                    body = b'{"kind": "Status"}'
                else:
                    self.send_response(200)
                    body = json.dumps({"kind": "Scale", "spec": {"replicas": api.replicas}}).encode()
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api():
    fake = FakeScaleApi(replicas=1)
    yield fake
    fake.close()


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="kuberl.v1.Learner"),
                                                    timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _learner(tmp_path, config, buffer, api, rendezvous: str, ordinal: int) -> Service:
    return Service("learner", tmp_path, config, "--buffer", buffer.address, "--checkpoint-dir",
                   str(tmp_path / f"ck-{ordinal}"), "--membership", "statefulset", "--group", rendezvous,
                   "--learner-id", f"{NAME}-{ordinal}", "--kubernetes-api", api.url, env={"POD_NAMESPACE": NAMESPACE})


def _stat(lrn: Service, key: str) -> float:
    return stats(lrn.address, learner_pb2_grpc.LearnerStub)[key]



def test_the_group_follows_the_statefulsets_replicas_and_a_killed_pod_coming_back(tmp_path, api):
    config, buffer, rendezvous = _group_setup(tmp_path)
    first = _learner(tmp_path, config, buffer, api, rendezvous, 0)
    first.wait_ready(timeout=120)
    actor = Service("actor", tmp_path, config, "--buffer", buffer.address, "--learner", first.address)
    actor.wait_ready()
    second = None
    try:
        assert _stat(first, "learner/group_size") == 1 and _stat(first, "learner/rank") == 0
        wait_for(lambda: _stat(first, "learner/policy_version") >= 3, timeout=120, interval=0.5,
                 what="learner 0 training alone")

        # The planner writes replicas 2; the StatefulSet controller starts pod 1.
        api.replicas = 2
        second = _learner(tmp_path, config, buffer, api, rendezvous, 1)
        second.wait_ready(timeout=120)
        wait_for(lambda: _stat(first, "learner/group_size") == 2 and _stat(second, "learner/group_size") == 2,
                 timeout=120, interval=0.5, what="a group of 2")
        assert _stat(first, "learner/group_reforms_total") == 1 and _stat(second, "learner/rank") == 1
        version = _stat(first, "learner/policy_version")
        wait_for(lambda: _stat(second, "learner/policy_version") >= version + 3, timeout=120, interval=0.5,
                 what="the group of 2 training")
        assert _stat(second, "learner/samples_total") > 0
        assert "took rank 0's state" in second.output()
        assert first.popen.poll() is None, "learner 0 was formed into the new group without restarting"

        # Pod 1 is killed (a node failure); rank 0's group breaks and waits at the rendezvous until the
        # StatefulSet brings pod 1 back under the same name.
        second.kill()
        wait_for(lambda: "forming the group again" in first.output(), timeout=120, what="rank 0 seeing its peer gone")
        second = _learner(tmp_path, config, buffer, api, rendezvous, 1)
        second.wait_ready(timeout=120)
        wait_for(lambda: _stat(first, "learner/group_reforms_total") == 2 and _stat(second, "learner/group_size") == 2,
                 timeout=120, interval=0.5, what="the group formed again with the new pod 1")
        version = _stat(first, "learner/policy_version")
        wait_for(lambda: _stat(first, "learner/policy_version") >= version + 3, timeout=120, interval=0.5,
                 what="the re-formed group training")

        # Scaled down to 1: pod 1 leaves the group (not ready) before its SIGTERM; rank 0 trains alone.
        api.replicas = 1
        wait_for(lambda: _stat(first, "learner/group_size") == 1, timeout=120, interval=0.5,
                 what="rank 0 alone again")
        wait_for(lambda: not _serving(second.address), timeout=60, interval=0.5, what="pod 1 not ready")
        assert "lies outside the group of 1 learners" in second.output()
        assert second.terminate() == 0
        version = _stat(first, "learner/policy_version")
        wait_for(lambda: _stat(first, "learner/policy_version") >= version + 3, timeout=120, interval=0.5,
                 what="rank 0 training alone after the scale-down")
        assert _stat(first, "learner/group_reforms_total") == 3
    finally:
        codes = {"actor": actor.terminate(), "learner-0": first.terminate()}
        if second is not None:
            second.kill()
        codes["buffer"] = buffer.terminate()
    assert set(codes.values()) == {0}, (codes, first.output()[-3000:])
    # Only rank 0 writes checkpoints; each re-formation started from one.
    assert list((tmp_path / "ck-0").glob("ckpt-*.pt")) and not list((tmp_path / "ck-1").glob("ckpt-*.pt"))
    assert api.auth == {""}, "no token is sent where none is mounted and the API was given explicitly"


def test_scale_reader_names_what_is_wrong(tmp_path, api):
    reader = ScaleReader(NAMESPACE, NAME, api=api.url)
    assert reader.replicas() == 1
    token = tmp_path / "token"
    token.write_text("secret-token\n")
    assert ScaleReader(NAMESPACE, NAME, api=api.url, token_file=token).replicas() == 1
    assert "Bearer secret-token" in api.auth
    api.status = 403
    with pytest.raises(MembershipError, match=r"HTTP 403.*must be granted .*statefulsets/scale.*'kuberl-learner'"):
        reader.replicas()
    api.status = 0
    with pytest.raises(MembershipError, match=r"HTTP 404.*no such StatefulSet"):
        ScaleReader(NAMESPACE, "other", api=api.url).replicas()
    with pytest.raises(MembershipError, match=r"reading the ServiceAccount token .*automountServiceAccountToken"):
        ScaleReader(NAMESPACE, NAME, api=api.url, token_file=tmp_path / "missing").replicas()
    api.replicas = -1
    with pytest.raises(MembershipError, match="no valid spec.replicas"):
        reader.replicas()


def test_statefulset_membership_flags_are_checked(tmp_path, monkeypatch):
    assert split_ordinal("kuberl-learner-12") == ("kuberl-learner", 12)
    with pytest.raises(ValueError, match="is not <statefulset>-<ordinal>"):
        split_ordinal("learner")
    config = write_config(tmp_path / "c.yaml", TINY_PPO)
    for args, said in ((["--learner-id", "kuberl-learner-0", "--group", "h:1", "--rank", "1"], "do not give --rank"),
                       (["--learner-id", "learner", "--group", "h:1"], "is not <statefulset>-<ordinal>"),
                       (["--learner-id", "kuberl-learner-0"], "needs --group"),
                       (["--learner-id", "kuberl-learner-0", "--group", "h:1"], "KUBERNETES_SERVICE_HOST")):
        lrn = Service("learner", tmp_path, config, "--buffer", "127.0.0.1:1", "--membership", "statefulset", *args,
                      env={"POD_NAMESPACE": NAMESPACE, "KUBERNETES_SERVICE_HOST": ""})
        assert lrn.popen.wait(60) == 2 and said in lrn.output(), lrn.output()


def _group_setup(tmp_path):
    """A config that publishes every update, its buffer serving, and an address for rank 0's rendezvous."""
    config = write_config(tmp_path / "c.yaml", {**TINY_PPO, "learner": {**TINY_PPO["learner"],
                                                                        "publish_interval_updates": 1}})
    buffer = Service("buffer", tmp_path, config)
    buffer.wait_ready()
    return config, buffer, f"127.0.0.1:{free_port()}"


def _trains_on(learners: list[Service], size: int, what: str, updates: int = 3) -> None:
    """Every learner of `learners` is in a group of `size` and its policy version rises by `updates`."""
    wait_for(lambda: all(_stat(lrn, "learner/group_size") == size for lrn in learners), timeout=240, interval=0.5,
             what=f"a group of {size}")
    versions = [_stat(lrn, "learner/policy_version") for lrn in learners]
    wait_for(lambda: all(_stat(lrn, "learner/policy_version") >= v + updates for lrn, v in zip(learners, versions)),
             timeout=240, interval=0.5, what=what)


@pytest.mark.timeout(900)
def test_a_group_resized_with_members_staying_in_it_forms_again_at_once(tmp_path, api):
    """2 -> 3 -> 2 in the same processes: ranks 0 and 1 stay in every group, rank 2 joins and leaves. Then
    a scale-up to 3 whose pod never comes is taken back to 2 while the group of 3 forms."""
    config, buffer, rendezvous = _group_setup(tmp_path)
    api.replicas = 2
    learners = [_learner(tmp_path, config, buffer, api, rendezvous, i) for i in range(2)]
    for lrn in learners:
        lrn.wait_ready(timeout=120)
    actor = Service("actor", tmp_path, config, "--buffer", buffer.address, "--learner", learners[0].address)
    actor.wait_ready()
    third = None
    try:
        _trains_on(learners, 2, "the first group of 2 training")

        api.replicas = 3
        third = _learner(tmp_path, config, buffer, api, rendezvous, 2)
        third.wait_ready(timeout=240)
        _trains_on([*learners, third], 3, "the group of 3 training")
        assert [_stat(lrn, "learner/rank") for lrn in (*learners, third)] == [0, 1, 2]
        assert [_stat(lrn, "learner/group_reforms_total") for lrn in learners] == [1, 1]

        api.replicas = 2
        wait_for(lambda: not _serving(third.address), timeout=120, interval=0.5, what="pod 2 not ready")
        _trains_on(learners, 2, "the group of 2 training again")
        assert [_stat(lrn, "learner/group_reforms_total") for lrn in learners] == [2, 2]
        assert "lies outside the group of 2 learners" in third.output()
        assert third.terminate() == 0
        # Each group met in a generation of its own at rank 0's rendezvous.
        assert [f"formed (generation {g})" in learners[1].output() for g in (1, 2, 3)] == [True] * 3

        # The planner asks for 3 again, pod 2 never comes (no room on a node), and the planner takes the
        # count back while the group of 3 forms: it is given up, and the group of 2 trains on.
        api.replicas = 3
        wait_for(lambda: learners[0].output().count("joining a group of 3 learners") == 2, timeout=120,
                 interval=0.2, what="rank 0 forming a group of 3 again")
        api.replicas = 2
        _trains_on(learners, 2, "the group of 2 training after the scale-up was taken back")
        assert [_stat(lrn, "learner/group_reforms_total") for lrn in learners] == [3, 3]
        assert "while a group of 3 forms: giving it up" in learners[0].output()
        # Rank 0's store holds the keys of the group training now, and of no generation before it.
        store = dist.PrefixStore(STORE_PREFIX, dist.TCPStore(*host_port(rendezvous), is_master=False,
                                                              wait_for_workers=False, timeout=timedelta(seconds=10)))
        assert len({key.split("/")[1] for key in store.list_keys() if key.startswith("g/")}) == 1, store.list_keys()

        # Every group formed at its first try: none waited out the rendezvous timeout and broke.
        assert [_stat(lrn, "learner/group_formation_failures_total") for lrn in learners] == [0, 0]
        assert all(lrn.popen.poll() is None for lrn in learners), "ranks 0 and 1 re-formed without restarting"
    finally:
        codes = {"actor": actor.terminate()}
        codes.update({f"learner-{i}": lrn.terminate() for i, lrn in enumerate(learners)})
        if third is not None:
            third.kill()
        codes["buffer"] = buffer.terminate()
    assert set(codes.values()) == {0}, (codes, learners[0].output()[-3000:])


def _actor_version(actor: Service) -> float:
    from kuberl.v1 import actor_pb2_grpc
    return stats(actor.address, actor_pb2_grpc.ActorStub).get("actor/policy_version", 0.0)


@pytest.mark.timeout(1500)
@pytest.mark.over_60s("nine learner processes started (four, and a killed rank back at each of five sizes) and "
                      "twelve group formations: 33 s alone, 66 s beside the rest of `make test`")
def test_a_walk_1_2_3_4_3_2_1_with_a_member_killed_at_each_size_and_the_actor_fed_throughout(tmp_path, api):
    """One running group through every size from 1 to 4 and back, in the same processes for the ranks
    that stay. At each size of 2 or more its highest rank is killed (SIGKILL, a node failure) and comes
    back under the same name, as a StatefulSet brings it back: the survivors form the group again with
    it. The actor takes weights from rank 0 throughout, so its policy version rises at every size."""
    config, buffer, rendezvous = _group_setup(tmp_path)
    api.replicas = 1
    learners = [_learner(tmp_path, config, buffer, api, rendezvous, 0)]
    learners[0].wait_ready(timeout=120)
    actor = Service("actor", tmp_path, config, "--buffer", buffer.address, "--learner", learners[0].address)
    actor.wait_ready()
    gone: list[Service] = []
    walked = []
    try:
        for size in (1, 2, 3, 4, 3, 2, 1):
            api.replicas = size
            while len(learners) < size:   # the StatefulSet controller starts the new pod
                learners.append(_learner(tmp_path, config, buffer, api, rendezvous, len(learners)))
                learners[-1].wait_ready(timeout=240)
            while len(learners) > size:   # and removes the highest ordinal: it leaves the group first
                leaving = learners.pop()
                wait_for(lambda: not _serving(leaving.address), timeout=120, interval=0.5,
                         what=f"pod {len(learners)} not ready")
                assert leaving.terminate() == 0, leaving.output()[-2000:]
            fed = _actor_version(actor)
            _trains_on(learners, size, f"the group of {size} training")
            if size > 1:
                victim = learners.pop()
                victim.kill()
                gone.append(victim)
                learners.append(_learner(tmp_path, config, buffer, api, rendezvous, size - 1))
                learners[-1].wait_ready(timeout=240)
                _trains_on(learners, size, f"the group of {size} training again after pod {size - 1} was killed")
            wait_for(lambda: _actor_version(actor) > fed, timeout=120, interval=0.5,
                     what=f"the actor fed new weights at size {size}")
            walked.append(size)
        assert walked == [1, 2, 3, 4, 3, 2, 1]
        assert learners[0].popen.poll() is None, "rank 0 formed every group in its one process"
        assert _stat(learners[0], "learner/group_formation_failures_total") == 0
    finally:
        codes = {"actor": actor.terminate()}
        codes.update({f"learner-{i}": lrn.terminate() for i, lrn in enumerate(learners)})
        for g in gone:
            g.kill()
        codes["buffer"] = buffer.terminate()
    assert set(codes.values()) == {0}, (codes, learners[0].output()[-3000:])

"""A real Kubernetes control plane on loopback for tests: etcd + kube-apiserver (+ kube-controller-manager).

The binaries come from tests/k8s/provision.sh, which writes `$KUBERL_K8S_CACHE/env` (default
~/.cache/kuberl/k8s/env: KUBE_APISERVER=, KUBE_CONTROLLER_MANAGER=, ETCD=, HELM=, KUBECTL=) and, for
whatever it could not provide, a reason in `$KUBERL_K8S_CACHE/unavailable`. Tests that need a binary
that is absent skip with that reason. No kubelet or scheduler runs: Pods never start, and Endpoints
exist only where a test writes them.

Fixtures (registered suite-wide from tests/conftest.py):
    k8s_cluster              session   a started `Cluster` (etcd + kube-apiserver, RBAC on); started once
    k8s_namespace            function  a fresh namespace name for this test (deleted afterwards)
    k8s_admin                function  an admin `kubernetes.client.ApiClient` (closed afterwards)
    k8s_controller_manager   function  kube-controller-manager running for this test only (deployment,
                                       replicaset, HPA, serviceaccount, GC, namespace controllers);
                                       yields the `Cluster`. Per test because its controllers rewrite
                                       Deployment status (and so resourceVersions) in every namespace.

Plain API (usable without pytest, e.g. `with start_cluster(tmpdir) as c: ...`):
    binaries(*names) -> dict[str, str]        paths from the env file; raises Unavailable(reason)
    start_cluster(workdir) -> Cluster         blocks until /readyz answers 200 (a few seconds)
    Cluster.server / .ca_file                 https://127.0.0.1:PORT and the CA that signed its cert
    Cluster.admin()                           ApiClient as "admin" (group system:masters, token auth)
    Cluster.client(token=..)                  ApiClient with a bearer token (TOKENS holds the known users)
    Cluster.impersonating(user, group=None)   ApiClient as admin sending Impersonate-User (+ one group)
    Cluster.as_service_account(ns, name)      impersonates system:serviceaccount:NS:NAME
    Cluster.write_kubeconfig(path, user=.., namespace=..)   a kubeconfig for kubectl / helm / the planner
    Cluster.kubectl(*args, user=.., input=..) runs kubectl against it; returns CompletedProcess (no raise)
    Cluster.create_namespace(prefix) / Cluster.start_controller_manager() / .stop_controller_manager()
    Cluster.stop()                            SIGTERM, then SIGKILL after 5 s (1.20 can hang on SIGTERM)
    grant(api, namespace, name, rules, user=.. | service_account=.., resource_names=..)
        a Role from (apiGroup, resource, verbs) tuples (e.g. services.planner.rbac.RULES), optionally
        narrowed to named objects per resource, and a RoleBinding of it to a user or ServiceAccount
    expand(rules) -> set[(group, resource, verb)]

Token users (TOKENS): "admin" (system:masters) and "kuberl-planner" (no groups, no permissions until a
test grants some).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("KUBERL_K8S_CACHE", Path.home() / ".cache" / "kuberl" / "k8s"))
TOKENS = {"admin": "kuberl-admin-token", "kuberl-planner": "kuberl-planner-token"}
_GROUPS = {"admin": "system:masters", "kuberl-planner": ""}
CONTROLLERS = "deployment,replicaset,horizontalpodautoscaling,serviceaccount,serviceaccount-token,garbagecollector,namespace"
STOP_GRACE_S = 5.0


class Unavailable(Exception):
    """A binary the harness needs is not there; the message says why (from provision.sh where it can)."""


def binaries(*names: str) -> dict[str, str]:
    """Paths of the named binaries (KUBE_APISERVER, KUBE_CONTROLLER_MANAGER, ETCD, HELM, KUBECTL) from the
    provisioned env file. Raises Unavailable naming the reason when one is missing."""
    env_file = CACHE / "env"
    reasons = (CACHE / "unavailable").read_text().strip() if (CACHE / "unavailable").exists() else ""
    if not env_file.exists():
        raise Unavailable(f"{env_file} does not exist: run tests/k8s/provision.sh to build/cache the Kubernetes "
                          f"test binaries" + (f" ({reasons})" if reasons else ""))
    env = {}
    for line in env_file.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            env[key.strip()] = value.strip()
    out = {}
    for name in names:
        path = env.get(name, "")
        if not path or not os.access(path, os.X_OK):
            why = "; ".join(r for r in reasons.splitlines() if name.split("_")[-1].lower() in r.lower().replace("-", "_")) or reasons
            raise Unavailable(f"{name} is not available ({path or 'not in ' + str(env_file)})" + (f": {why}" if why else ""))
        out[name] = path
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_certs(d: Path, ips: tuple[str, ...] = ("127.0.0.1",)) -> None:
    """A CA, a serving cert for `ips` and localhost signed by it, and the service-account key pair."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "3",
             "-subj", "/CN=kuberl-test-ca", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "serving.key", "-out", "serving.csr",
             "-subj", "/CN=kube-apiserver", cwd=d)
    sans = ",".join([f"IP:{ip}" for ip in ips] + ["DNS:localhost", "DNS:kubernetes.default.svc"])
    (d / "serving.ext").write_text(f"subjectAltName={sans}\nbasicConstraints=CA:FALSE\n"
                                   "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "serving.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "serving.crt", "-days", "3", "-extfile", "serving.ext", cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


def stop_process(proc: subprocess.Popen | None, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL after grace_s: kube-apiserver 1.20 can hang on SIGTERM."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def spawn(workdir: Path, name: str, argv: list[str]) -> subprocess.Popen:
    """Start `argv` in its own session, output to WORKDIR/NAME.log (tests/e2e/node.py uses it too)."""
    with open(workdir / f"{name}.log", "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def wait_for(workdir: Path, name: str, proc: subprocess.Popen, ready, timeout_s: float) -> None:
    """Return once ready() is true; raise with the tail of NAME.log if the process exits or time runs out.
    An exception from ready() counts as not ready yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail(workdir / f'{name}.log')}")
        try:
            if ready():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{name} not ready within {timeout_s:.0f} s:\n{tail(workdir / f'{name}.log')}")


@dataclass
class Cluster:
    """A started etcd + kube-apiserver on loopback (and optionally kube-controller-manager).

    `address` is where the apiserver listens and what it advertises (tests/e2e puts it on the node's
    bridge so pods reach it); `apiserver_flags` are added to its command line."""
    workdir: Path
    bins: dict[str, str]
    address: str = "127.0.0.1"
    apiserver_flags: tuple[str, ...] = ()
    server: str = ""
    ca_file: Path = field(default=Path())
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    # ---- start / stop ----------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        self._procs[name] = spawn(self.workdir, name, argv)
        return self._procs[name]

    def _wait(self, name: str, ready, timeout_s: float) -> None:
        wait_for(self.workdir, name, self._procs[name], ready, timeout_s)

    def start(self) -> Cluster:
        certs = self.workdir / "certs"
        # 10.0.0.1: the `kubernetes` Service's ClusterIP (first of --service-cluster-ip-range), which
        # in-cluster clients verify the certificate against.
        _make_certs(certs, tuple(dict.fromkeys(("127.0.0.1", self.address, "10.0.0.1"))))
        self.ca_file = certs / "ca.crt"
        tokens = self.workdir / "tokens.csv"
        tokens.write_text("".join(f'{tok},{user},{user},"{_GROUPS[user]}"\n' for user, tok in TOKENS.items()))

        client, peer = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{client}"
        self._spawn("etcd", [
            self.bins["ETCD"], "--name", "kuberl-test", "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"kuberl-test=http://127.0.0.1:{peer}", "--log-level", "warn"])
        self._wait("etcd", lambda: http_status(f"{etcd_url}/health") == 200, 30)

        port = free_port()
        self.server = f"https://{self.address}:{port}"
        self._spawn("kube-apiserver", [
            self.bins["KUBE_APISERVER"], f"--etcd-servers={etcd_url}",
            f"--bind-address={self.address}", f"--advertise-address={self.address}", f"--secure-port={port}",
            "--insecure-port=0",
            f"--cert-dir={certs / 'apiserver'}", f"--tls-cert-file={certs / 'serving.crt'}",
            f"--tls-private-key-file={certs / 'serving.key'}", f"--token-auth-file={tokens}",
            "--authorization-mode=RBAC", "--service-cluster-ip-range=10.0.0.0/24",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={certs / 'sa.pub'}", f"--service-account-signing-key-file={certs / 'sa.key'}",
            "--profiling=false", "--v=1", *self.apiserver_flags])
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        self._wait("kube-apiserver",
                   lambda: http_status(f"{self.server}/readyz", TOKENS["admin"], ctx) == 200, 90)
        return self

    def start_controller_manager(self, timeout_s: float = 60, controllers: str = CONTROLLERS) -> None:
        """Start kube-controller-manager (CONTROLLERS; HPA sync every second); returns once it has synced
        (its serviceaccount controller created the namespace's `default` ServiceAccount in a probe ns)."""
        if "kube-controller-manager" in self._procs and self._procs["kube-controller-manager"].poll() is None:
            return
        bins = binaries("KUBE_CONTROLLER_MANAGER")
        kubeconfig = self.write_kubeconfig(self.workdir / "kcm.kubeconfig")
        certs = self.workdir / "certs"
        self._spawn("kube-controller-manager", [
            bins["KUBE_CONTROLLER_MANAGER"], f"--kubeconfig={kubeconfig}", f"--controllers={controllers}",
            "--port=0", "--secure-port=0", "--leader-elect=false", "--use-service-account-credentials=false",
            f"--service-account-private-key-file={certs / 'sa.key'}", f"--root-ca-file={self.ca_file}",
            "--horizontal-pod-autoscaler-sync-period=1s", "--concurrent-deployment-syncs=2", "--v=1"])
        from kubernetes import client

        probe = self.create_namespace("kcm-probe")
        with self.admin() as api:
            core = client.CoreV1Api(api)

            def synced():
                try:
                    core.read_namespaced_service_account("default", probe)
                    return True
                except client.ApiException:
                    return False
            self._wait("kube-controller-manager", synced, timeout_s)

    def stop_controller_manager(self) -> None:
        stop_process(self._procs.pop("kube-controller-manager", None))

    def stop(self) -> None:
        for name in ("kube-controller-manager", "kube-apiserver", "etcd"):
            stop_process(self._procs.pop(name, None))

    # ---- clients ---------------------------------------------------------------------------------------
    def configuration(self, token: str):
        from kubernetes import client
        cfg = client.Configuration()
        cfg.host = self.server
        cfg.ssl_ca_cert = str(self.ca_file)
        cfg.api_key = {"authorization": token}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        return cfg

    def client(self, token: str):
        """An ApiClient authenticating with a bearer token (see TOKENS). Close it (or use `with`)."""
        from kubernetes import client
        return client.ApiClient(self.configuration(token))

    def admin(self):
        """An ApiClient as "admin" (system:masters)."""
        return self.client(TOKENS["admin"])

    def impersonating(self, user: str, group: str | None = None):
        """An ApiClient that authenticates as admin and acts as `user` (Impersonate-User), optionally in one
        group: the Python client sends each header once, so at most one Impersonate-Group."""
        api = self.admin()
        api.default_headers["Impersonate-User"] = user
        if group:
            api.default_headers["Impersonate-Group"] = group
        return api

    def as_service_account(self, namespace: str, name: str):
        """An ApiClient acting as ServiceAccount NAME in NAMESPACE (RBAC subjects of kind ServiceAccount
        match it); no ServiceAccount object is needed."""
        return self.impersonating(f"system:serviceaccount:{namespace}:{name}")

    def write_kubeconfig(self, path: Path | str, user: str = "admin", namespace: str | None = None) -> Path:
        """A kubeconfig for one of the TOKENS users (context "kuberl-test"), for kubectl, helm or the planner."""
        import yaml
        path = Path(path)
        context = {"cluster": "kuberl-test", "user": user}
        if namespace:
            context["namespace"] = namespace
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kuberl-test",
            "clusters": [{"name": "kuberl-test", "cluster": {"server": self.server, "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": user, "user": {"token": TOKENS[user]}}],
            "contexts": [{"name": "kuberl-test", "context": context}],
        }))
        return path

    def kubectl(self, *args: str, user: str = "admin", input: str | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess:
        """Run kubectl against this cluster (raises Unavailable without kubectl; does not raise on failure)."""
        kubectl = binaries("KUBECTL")["KUBECTL"]
        kubeconfig = self.write_kubeconfig(self.workdir / f"{user}.kubeconfig", user=user)
        return subprocess.run([kubectl, f"--kubeconfig={kubeconfig}", *args], input=input, capture_output=True,
                              text=True, timeout=timeout_s, check=False)

    def create_namespace(self, prefix: str = "t") -> str:
        from kubernetes import client
        name = f"{prefix[:40].lower().strip('-')}-{uuid.uuid4().hex[:6]}"
        with self.admin() as api:
            client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
        return name


def http_status(url: str, token: str | None = None, ctx: ssl.SSLContext | None = None) -> int:
    """The HTTP status of a GET (0 when nothing answers); tests/e2e/node.py uses it too."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=2, context=ctx) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ssl.SSLError):
        return 0


@contextlib.contextmanager
def start_cluster(workdir: Path | str):
    """Start etcd + kube-apiserver under `workdir`; stop both on exit. Raises Unavailable without binaries."""
    bins = binaries("ETCD", "KUBE_APISERVER")
    if shutil.which("openssl") is None:
        raise Unavailable("openssl is not installed (needed for the serving cert and service-account keys)")
    cluster = Cluster(Path(workdir), bins)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


# ---- RBAC helpers ------------------------------------------------------------------------------------------
def expand(rules) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verbs) rules -> the set of (apiGroup, resource, verb) they allow."""
    return {(g, r, v) for g, r, verbs in rules for v in verbs}


def grant(api, namespace: str, name: str, rules, *, user: str | None = None, service_account: str | None = None,
          resource_names: dict[str, list[str]] | None = None) -> None:
    """Create Role NAME holding `rules` ((apiGroup, resource, verbs) tuples), those whose resource is in
    `resource_names` only on the objects named there, and bind it to a user or to a ServiceAccount of
    `namespace`."""
    from kubernetes import client
    assert (user is None) != (service_account is None), "grant to exactly one of user / service_account"
    rbac = client.RbacAuthorizationV1Api(api)
    names = resource_names or {}
    rbac.create_namespaced_role(namespace, {
        "metadata": {"name": name},
        "rules": [{"apiGroups": [g], "resources": [r], "verbs": list(verbs),
                   **({"resourceNames": list(names[r])} if r in names else {})} for g, r, verbs in rules]})
    subject = ({"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"} if user else
               {"kind": "ServiceAccount", "name": service_account, "namespace": namespace})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [subject]})


# ---- pytest fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory):
    """etcd + kube-apiserver for the whole session; skips (with the reason) where the binaries are absent."""
    try:
        ctx = start_cluster(tmp_path_factory.mktemp("k8s"))
        cluster = ctx.__enter__()
    except Unavailable as e:
        pytest.skip(f"no Kubernetes API server for tests: {e}")
    try:
        yield cluster
    finally:
        ctx.__exit__(None, None, None)


@pytest.fixture
def k8s_namespace(k8s_cluster, request):
    """A fresh namespace for this test, deleted afterwards (without waiting for it to go)."""
    from kubernetes import client
    name = k8s_cluster.create_namespace("t-" + "".join(c if c.isalnum() else "-" for c in request.node.name))
    yield name
    with k8s_cluster.admin() as api, contextlib.suppress(client.ApiException):
        client.CoreV1Api(api).delete_namespace(name)


@pytest.fixture
def k8s_admin(k8s_cluster):
    with k8s_cluster.admin() as api:
        yield api


@pytest.fixture
def k8s_controller_manager(k8s_cluster):
    """kube-controller-manager running during this test; skips where its binary is absent."""
    try:
        binaries("KUBE_CONTROLLER_MANAGER")
    except Unavailable as e:
        pytest.skip(f"no kube-controller-manager for tests: {e}")
    k8s_cluster.start_controller_manager()
    try:
        yield k8s_cluster
    finally:
        k8s_cluster.stop_controller_manager()

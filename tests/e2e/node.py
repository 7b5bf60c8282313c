"""A real single-node Kubernetes cluster for the end-to-end tests (`make e2e`), started and torn down by PID.

On top of tests/k8s/cluster.py's etcd + kube-apiserver (+ kube-controller-manager with every default
controller) it runs a node: dockerd (kubelet 1.20's dockershim runs pods on it, and the project's
images are built into it, so nothing is loaded or pulled), kubelet, kube-scheduler, kube-proxy
(iptables), a CNI bridge, and dnsmasq answering Service names. Every address stays inside the machine:

    bridge kuberl0 10.244.0.1/24   the node's address: apiserver, kubelet, DNS and NodePorts listen on it;
                                   pods get 10.244.0.2.. from CNI host-local
    10.0.0.0/24                    Service ClusterIPs (kube-proxy DNATs them; --masquerade-all, so replies
                                   come back through the host even between pods on the bridge)

Binaries come from tests/k8s/provision.sh run with KUBERL_K8S_NODE=1 (kubelet, kube-scheduler,
kube-proxy and the pause binary built from the same Debian kubernetes 1.20.2 source tree) and from
Debian packages (docker.io, runc, containernetworking-plugins, dnsmasq-base, iptables, conntrack):
tests/e2e/provision.sh installs them. `Node.start()` raises Unavailable naming what is missing.

Teardown (`Node.stop()`) deletes the test namespaces and waits for their pods to go (so kubelet removes
the pods' containers, network namespaces and CNI rules), stops every process by PID (SIGTERM, then
SIGKILL), removes leftover pod containers, unmounts what kubelet and dockerd mounted, and undoes its
host changes (undo_host: the bridge, the KUBE-*/CNI-* iptables chains and the rules jumping to them,
the sysctls kubelet and kube-proxy set, the directories they made). dockerd's data root is kept in the
cache ($KUBERL_E2E_CACHE, default ~/.cache/kuberl/e2e/docker), so built images survive runs. A node
whose harness died is swept at the next start, or by `make e2e-clean`; a live one is never touched.

Why each unusual setting is there (../docs/deploy.md has the list for users):
    tests/e2e/runc-clamp   dockerd's default runtime: raises kubelet's negative oomScoreAdj to 0 (this VM's
                           root lacks CAP_SYS_RESOURCE, and runc fails on a negative value)
    dnsmasq --address=/#/  unknown names get NXDOMAIN, not REFUSED (gRPC's c-ares resolver fails the
                           whole lookup on REFUSED, even when a search domain would have matched)
    --cgroups-per-qos=false   no systemd here: kubelet does not build a QoS cgroup tree; docker still
                              applies each container's limits
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.k8s.cluster import CACHE as K8S_CACHE
from tests.k8s.cluster import (Cluster, Unavailable, binaries, free_port, http_status, spawn, stop_process, tail,
                               wait_for)

E2E_CACHE = Path(os.environ.get("KUBERL_E2E_CACHE", Path.home() / ".cache" / "kuberl" / "e2e"))
NODE_NAME = "kuberl-e2e-node"
BRIDGE = "kuberl0"
NODE_IP = "10.244.0.1"
POD_CIDR = "10.244.0.0/24"
CLUSTER_DOMAIN = "cluster.local"
PAUSE_IMAGE = "k8s.gcr.io/pause:3.2"   # what kubelet 1.20 asks for by default
BASE_IMAGE = "kuberl-e2e/python:3.11-bookworm"
DEBIAN_PACKAGES = {"dockerd": "docker.io", "runc": "runc", "dnsmasq": "dnsmasq-base", "iptables-save": "iptables",
                   "conntrack": "conntrack", "ip": "iproute2"}
CNI_BIN_DIR = Path("/usr/lib/cni")
STATE = E2E_CACHE / "node-state.json"   # the running node, for sweep()
HERE = Path(__file__).resolve().parent


def _which_all() -> dict[str, str]:
    found, missing = {}, []
    for cmd, pkg in DEBIAN_PACKAGES.items():
        path = shutil.which(cmd)
        if path is None:
            missing.append(f"{cmd} (Debian package {pkg})")
        else:
            found[cmd] = path
    if not (CNI_BIN_DIR / "bridge").exists():
        missing.append(f"{CNI_BIN_DIR}/bridge (Debian package containernetworking-plugins)")
    if missing:
        raise Unavailable("not installed: " + ", ".join(missing) + "; run tests/e2e/provision.sh")
    if os.geteuid() != 0:
        raise Unavailable("the node needs root (it runs dockerd and kubelet, and adds a bridge and iptables rules)")
    return found


def _run(*argv: str, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=timeout, **kw)


@dataclass
class Node:
    """A started cluster + node. `cluster` is the tests/k8s Cluster (admin clients, kubectl, kubeconfigs)."""
    workdir: Path
    cluster: Cluster | None = None
    docker_host: str = ""
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    _host_before: dict | None = None
    _dns_stop: threading.Event = field(default_factory=threading.Event)
    _dns_thread: threading.Thread | None = None
    _bridge_added: bool = False

    # ---- processes -----------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        self._procs[name] = spawn(self.workdir, name, argv)
        self._save_state()
        return self._procs[name]

    def _save_state(self) -> None:
        """What sweep() needs to undo this node if this process dies before stop()."""
        STATE.parent.mkdir(parents=True, exist_ok=True)
        STATE.write_text(json.dumps({
            "owner_pid": os.getpid(), "owner_start": _start_time(os.getpid()),
            "workdir": str(self.workdir.resolve()), "docker_host": self.docker_host,
            "bridge_added": self._bridge_added, "host_before": self._host_before}))

    def _wait(self, name: str, ready, timeout_s: float) -> None:
        wait_for(self.workdir, name, self._procs[name], ready, timeout_s)

    def log(self, name: str, n: int = 40) -> str:
        return tail(self.workdir / f"{name}.log", n)

    def docker(self, *args: str, check: bool = True, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
        return _run("docker", "-H", self.docker_host, *args, check=check, timeout=timeout, **kw)

    # ---- start ---------------------------------------------------------------------------------------
    def start(self) -> Node:
        _which_all()
        for line in sweep():
            print(f"[e2e] swept what an earlier run left: {line}")
        bins = binaries("ETCD", "KUBE_APISERVER", "KUBE_CONTROLLER_MANAGER", "KUBELET", "KUBE_SCHEDULER",
                        "KUBE_PROXY", "PAUSE")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._host_before = host_snapshot()
        self._save_state()
        self._start_bridge()
        self._save_state()
        self._start_dockerd()
        self._prune_store()
        self._ensure_pause_image(bins["PAUSE"])
        self.cluster = Cluster(self.workdir / "control-plane", bins, address=NODE_IP, apiserver_flags=(
            "--kubelet-preferred-address-types=InternalIP",
            "--allow-privileged=false",
        ))
        (self.workdir / "control-plane").mkdir(exist_ok=True)
        self.cluster.start()
        self.cluster.start_controller_manager(controllers="*")
        kubeconfig = self.cluster.write_kubeconfig(self.workdir / "node.kubeconfig")
        self._start_dns()
        self._start_kubelet(bins["KUBELET"], kubeconfig)
        self._spawn("kube-scheduler", [
            bins["KUBE_SCHEDULER"], f"--kubeconfig={kubeconfig}", "--leader-elect=false", "--port=0",
            "--secure-port=0", "--v=1"])
        proxy_health, proxy_metrics = free_port(), free_port()
        self._spawn("kube-proxy", [
            bins["KUBE_PROXY"], f"--kubeconfig={kubeconfig}", "--proxy-mode=iptables", f"--cluster-cidr={POD_CIDR}",
            f"--hostname-override={NODE_NAME}", f"--bind-address={NODE_IP}", "--masquerade-all=true",
            f"--healthz-bind-address=127.0.0.1:{proxy_health}", f"--metrics-bind-address=127.0.0.1:{proxy_metrics}",
            "--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0",
            "--conntrack-tcp-timeout-close-wait=0", f"--nodeport-addresses={NODE_IP}/32", "--v=1"])
        self._wait_node_ready(120)
        # kube-proxy answers /healthz 200 once it has written the Service rules at least once.
        self._wait("kube-proxy", lambda: http_status(f"http://127.0.0.1:{proxy_health}/healthz") == 200, 60)
        if self._procs["kube-scheduler"].poll() is not None:
            raise RuntimeError(f"kube-scheduler exited:\n{self.log('kube-scheduler')}")
        return self

    def _start_bridge(self) -> None:
        """The bridge CNI's `bridge` plugin attaches pods to; made here so the node address exists
        before the apiserver binds it."""
        if _run("ip", "link", "show", BRIDGE, check=False).returncode != 0:
            _run("ip", "link", "add", BRIDGE, "type", "bridge")
            self._bridge_added = True
        _run("ip", "addr", "replace", f"{NODE_IP}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        cni = self.workdir / "cni"
        cni.mkdir(exist_ok=True)
        (cni / "10-kuberl-e2e.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "kuberl-e2e",
            "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP}]],
                          "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(self.workdir / "cni-ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ]}, indent=1))

    def _start_dockerd(self) -> None:
        run = self.workdir / "docker"
        run.mkdir(exist_ok=True)
        data = E2E_CACHE / "docker"
        data.mkdir(parents=True, exist_ok=True)
        sock = run / "docker.sock"
        self.docker_host = f"unix://{sock}"
        # --bridge=none --iptables=false: pods are networked by kubelet's CNI, builds use --network host,
        # and dockerd must not set FORWARD to DROP (it would cut pod-to-pod traffic).
        self._spawn("dockerd", [
            "dockerd", f"--data-root={data}", f"--exec-root={run / 'exec'}", f"--pidfile={run / 'dockerd.pid'}",
            f"--host={self.docker_host}", "--bridge=none", "--iptables=false", "--ip-masq=false",
            "--storage-driver=overlay2", f"--add-runtime=clamp={HERE / 'runc-clamp'}", "--default-runtime=clamp"])
        self._wait("dockerd", lambda: self.docker("version", check=False, timeout=10).returncode == 0, 60)

    def _prune_store(self) -> None:
        """Empties what earlier runs left in the cached store: stopped containers and untagged images.
        The store is this harness's own (--data-root under E2E_CACHE), so nothing of the host's is touched;
        tagged images (the base, pause, the roles' last build) stay and keep the layer cache."""
        for kind in ("container", "image"):
            out = self.docker(kind, "prune", "--force", check=False, timeout=600).stdout.strip().splitlines()
            if out and out[-1].startswith("Total reclaimed space:") and not out[-1].endswith(" 0B"):
                print(f"[e2e] {kind} prune: {out[-1]}")

    def _ensure_pause_image(self, pause_bin: str) -> None:
        if self.docker("image", "inspect", PAUSE_IMAGE, check=False).returncode == 0:
            return
        ctx = self.workdir / "pause-image"
        ctx.mkdir(exist_ok=True)
        shutil.copy(pause_bin, ctx / "pause")
        (ctx / "Dockerfile").write_text('FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n')
        self.docker("build", "--quiet", "-t", PAUSE_IMAGE, str(ctx), env={**os.environ, "DOCKER_BUILDKIT": "0"})

    def _start_kubelet(self, kubelet: str, kubeconfig: Path) -> None:
        root = self.workdir / "kubelet"
        root.mkdir(exist_ok=True)
        resolv = self.workdir / "kubelet-resolv.conf"   # pods get no search domains from the host
        resolv.write_text("")
        self._spawn("kubelet", [
            kubelet, f"--kubeconfig={kubeconfig}", f"--hostname-override={NODE_NAME}", f"--node-ip={NODE_IP}",
            f"--address={NODE_IP}", "--read-only-port=0", "--healthz-port=0",
            "--container-runtime=docker", f"--docker-endpoint={self.docker_host}",
            f"--pod-infra-container-image={PAUSE_IMAGE}",
            "--network-plugin=cni", f"--cni-bin-dir={CNI_BIN_DIR}", f"--cni-conf-dir={self.workdir / 'cni'}",
            f"--cluster-dns={NODE_IP}", f"--cluster-domain={CLUSTER_DOMAIN}", f"--resolv-conf={resolv}",
            f"--root-dir={root}", f"--cert-dir={self.workdir / 'kubelet-pki'}",
            "--fail-swap-on=false", "--cgroup-driver=cgroupfs", "--cgroups-per-qos=false",
            "--enforce-node-allocatable=", "--anonymous-auth=true", "--authorization-mode=AlwaysAllow",
            "--eviction-hard=memory.available<100Mi,nodefs.available<2%,imagefs.available<2%",
            "--image-gc-high-threshold=100", "--image-gc-low-threshold=99",
            "--serialize-image-pulls=false", "--max-pods=40", "--v=1"])

    def _wait_node_ready(self, timeout_s: float) -> None:
        from kubernetes import client

        def ready() -> bool:
            with self.cluster.admin() as api:
                node = client.CoreV1Api(api).read_node(NODE_NAME)
            return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
        self._wait("kubelet", ready, timeout_s)

    # ---- DNS: dnsmasq + a loop that writes Services and Endpoints as host records --------------------
    def _start_dns(self) -> None:
        hosts = self.workdir / "dns-hosts"
        hosts.write_text("")
        self._spawn("dnsmasq", [
            "dnsmasq", "--keep-in-foreground", "--no-resolv", "--no-hosts", f"--addn-hosts={hosts}",
            f"--listen-address={NODE_IP}", "--bind-interfaces", "--port=53", "--address=/#/",
            f"--pid-file={self.workdir / 'dnsmasq.pid'}", "--log-facility=-", "--user=root"])
        self._dns_thread = threading.Thread(target=self._dns_loop, args=(hosts,), name="e2e-dns", daemon=True)
        self._dns_thread.start()

    def dns_records(self) -> list[tuple[str, str]]:
        """(ip, name) for every Service (its ClusterIP) and, for headless Services, every ready endpoint
        (the Service name and, for StatefulSet pods, POD.SERVICE)."""
        from kubernetes import client
        records = []
        with self.cluster.admin() as api:
            core = client.CoreV1Api(api)
            for svc in core.list_service_for_all_namespaces().items:
                base = f"{svc.metadata.name}.{svc.metadata.namespace}.svc.{CLUSTER_DOMAIN}"
                if svc.spec.cluster_ip and svc.spec.cluster_ip != "None":
                    records.append((svc.spec.cluster_ip, base))
                    continue
                with contextlib.suppress(client.ApiException):
                    eps = core.read_namespaced_endpoints(svc.metadata.name, svc.metadata.namespace)
                    for subset in eps.subsets or []:
                        for addr in subset.addresses or []:
                            records.append((addr.ip, base))
                            if addr.hostname:
                                records.append((addr.ip, f"{addr.hostname}.{base}"))
        return records

    def _dns_loop(self, hosts: Path) -> None:
        last = None
        while not self._dns_stop.wait(0.5):
            try:
                text = "".join(f"{ip} {name}\n" for ip, name in sorted(self.dns_records()))
            except Exception:   # the apiserver is starting or stopping
                continue
            if text != last:
                hosts.write_text(text)
                proc = self._procs.get("dnsmasq")
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGHUP)
                last = text

    # ---- teardown ------------------------------------------------------------------------------------
    def delete_namespace(self, name: str, timeout_s: float = 120) -> None:
        """Delete a namespace and wait until it is gone: its pods too (kubelet has torn their sandboxes
        down), so the next test can create it again."""
        from kubernetes import client
        with self.cluster.admin() as api:
            core = client.CoreV1Api(api)
            with contextlib.suppress(client.ApiException):
                core.delete_namespace(name)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                try:
                    core.read_namespace(name)
                except client.ApiException as e:
                    if e.status == 404:
                        return
                time.sleep(1)
        raise RuntimeError(f"namespace {name} still there {timeout_s:.0f} s after its deletion")

    def stop(self) -> None:
        """Tear everything down; every step runs even if an earlier one failed (errors are printed)."""
        self._dns_stop.set()
        steps = [("delete namespaces", self._delete_all_namespaces)]
        steps += [(f"stop {name}", lambda name=name: self._stop(name))
                  for name in ("kube-proxy", "kube-scheduler", "kubelet", "dnsmasq")]
        steps += [("stop the control plane", lambda: self.cluster is not None and self.cluster.stop()),
                  ("remove pod containers", self._remove_pod_containers),
                  ("stop dockerd", lambda: self._stop("dockerd", grace_s=20)),
                  ("unmount", lambda: [_unmount_under(r) for r in (self.workdir, E2E_CACHE / "docker")]),
                  ("undo host changes", lambda: undo_host(self._host_before, self._bridge_added))]
        for what, step in steps:
            try:
                step()
            except Exception as e:   # noqa: BLE001 - the remaining steps must still run
                print(f"[e2e] teardown: {what} failed: {e!r}")
        STATE.unlink(missing_ok=True)

    def _delete_all_namespaces(self) -> None:
        if self.cluster is None or not self.cluster.server:
            return
        from kubernetes import client
        with self.cluster.admin() as api:
            names = [n.metadata.name for n in client.CoreV1Api(api).list_namespace().items]
        for name in names:
            if name not in ("default", "kube-system", "kube-public", "kube-node-lease"):
                with contextlib.suppress(RuntimeError):
                    self.delete_namespace(name, timeout_s=60)

    def _remove_pod_containers(self) -> None:
        """Pods that outlived the namespace deletion (a timeout): remove their containers."""
        if not self.docker_host:
            return
        ids = self.docker("ps", "-aq", "--filter", "name=k8s_", check=False, timeout=60).stdout.split()
        if ids:
            self.docker("rm", "-f", *ids, check=False, timeout=120)

    def _stop(self, name: str, grace_s: float = 10) -> None:
        stop_process(self._procs.get(name), grace_s)


def _unmount_under(root: Path) -> list[str]:
    prefix = str(root.resolve())
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    gone = sorted((m for m in mounts if m == prefix or m.startswith(prefix + "/")), key=len, reverse=True)
    for mnt in gone:
        _run("umount", "-l", mnt, check=False)
    return gone


# What kubelet, kube-proxy and the CNI plugins change on the host besides iptables, restored at stop.
SYSCTLS = ("kernel/panic", "kernel/panic_on_oops", "vm/overcommit_memory", "kernel/keys/root_maxkeys",
           "kernel/keys/root_maxbytes", "net/ipv4/conf/all/route_localnet", "net/ipv4/ip_forward")
HOST_DIRS = ("/var/lib/kubelet", "/var/lib/dockershim", "/var/lib/cni", "/var/log/pods", "/var/log/containers")
OURS = ("KUBE-", "CNI-")   # the iptables chains kubelet, kube-proxy and the CNI plugins make


def host_snapshot() -> dict:
    sysctls = {}
    for key in SYSCTLS:
        path = Path("/proc/sys") / key
        with contextlib.suppress(OSError):
            sysctls[key] = path.read_text().strip()
    return {"sysctls": sysctls, "dirs_absent": [d for d in HOST_DIRS if not Path(d).exists()]}


def remove_our_iptables() -> int:
    """Delete the KUBE-*/CNI-* chains of filter, nat and mangle and every rule elsewhere that jumps to
    them; rules anything else added are left alone. Returns how many rules and chains went."""
    import shlex
    removed = 0
    for table in ("filter", "nat", "mangle"):
        out = _run("iptables-save", "-t", table, check=False).stdout
        chains = [line[1:].split()[0] for line in out.splitlines()
                  if line.startswith(":") and line[1:].startswith(OURS)]
        for line in out.splitlines():
            if not line.startswith("-A "):
                continue
            parts = shlex.split(line)
            target = parts[parts.index("-j") + 1] if "-j" in parts else ""
            if not parts[1].startswith(OURS) and target.startswith(OURS):
                if _run("iptables", "-t", table, "-D", *parts[1:], check=False).returncode == 0:
                    removed += 1
        for flag in ("-F", "-X"):
            for chain in chains:
                _run("iptables", "-t", table, flag, chain, check=False)
        removed += len(chains)
    return removed


def undo_host(before: dict | None, bridge_added: bool) -> list[str]:
    """Undo what a node changed on the host: the bridge (if it made it), its iptables chains, the
    sysctls kubelet and kube-proxy set, and the directories they made that were not there before."""
    done = []
    if bridge_added and _run("ip", "link", "show", BRIDGE, check=False).returncode == 0:
        _run("ip", "link", "del", BRIDGE, check=False)
        done.append(f"deleted bridge {BRIDGE}")
    n = remove_our_iptables()
    if n:
        done.append(f"removed {n} iptables rules and chains (KUBE-*, CNI-*)")
    if before:
        for key, value in before.get("sysctls", {}).items():
            path = Path("/proc/sys") / key
            with contextlib.suppress(OSError):
                if path.read_text().strip() != value:
                    path.write_text(value)
                    done.append(f"restored sysctl {key.replace('/', '.')}={value}")
        for d in before.get("dirs_absent", []):
            if Path(d).exists():
                _unmount_under(Path(d))
                shutil.rmtree(d, ignore_errors=True)
                done.append(f"removed {d}")
    return done


def _pids_mentioning(*needles: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(n in cmd for n in needles):
            pids.append(int(d.name))
    return pids


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_alive(st: dict) -> bool:
    """Whether the harness process that started the node in STATE still runs (same PID, same start)."""
    pid = st.get("owner_pid")
    return bool(pid) and _start_time(pid) is not None and _start_time(pid) == st.get("owner_start")


def sweep() -> list[str]:
    """Undo a node whose harness died before stop() (SIGKILL, a lost terminal), from STATE: remove its
    pod containers, kill every process whose command line names its work dir or the docker data root,
    unmount, and undo its host changes (undo_host). Never touches a node whose harness still runs.
    Returns what it did; [] when nothing was left."""
    if not STATE.exists():
        return []
    st = json.loads(STATE.read_text())
    if owner_alive(st):
        raise RuntimeError(f"an e2e node is running (harness pid {st['owner_pid']}, work dir {st['workdir']}): "
                           f"one at a time on a machine")
    done = []
    workdir = st["workdir"]
    if st.get("docker_host"):
        docker = ["docker", "-H", st["docker_host"]]
        with contextlib.suppress(subprocess.TimeoutExpired):
            ids = _run(*docker, "ps", "-aq", "--filter", "name=k8s_", check=False, timeout=30).stdout.split()
            if ids:
                _run(*docker, "rm", "-f", *ids, check=False, timeout=120)
                done.append(f"removed {len(ids)} pod containers")
    pids = _pids_mentioning(workdir, str(E2E_CACHE / "docker"))
    if pids:
        done.append(f"stopped {len(pids)} processes of {workdir}")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.2)
        pids = [p for p in pids if Path(f"/proc/{p}").exists()]
    for root in (Path(workdir), E2E_CACHE / "docker"):
        if root.exists() and _unmount_under(root):
            done.append(f"unmounted under {root}")
    done += undo_host(st.get("host_before"), st.get("bridge_added", False))
    STATE.unlink(missing_ok=True)
    return done


def iptables_rules() -> list[str]:
    """Every rule, every chain that is not built in, and every built-in chain's policy that is not ACCEPT,
    in every table (sorted, without counters): what must be the same before start and after stop."""
    out, table = [], ""
    if shutil.which("iptables-save") is None:
        return out
    for line in _run("iptables-save").stdout.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith("-A "):
            out.append(f"{table} {line}")
        elif line.startswith(":"):
            chain, policy = line[1:].split()[:2]
            if policy == "-" or policy != "ACCEPT":
                out.append(f"{table} chain {chain} {policy}")
    return sorted(out)


def image_tags(prefix: str = "kuberl/", tag: str | None = None) -> dict[str, str]:
    """The four role images' tags, as k8s/ and the chart name them."""
    if tag is None:
        import tomllib
        tag = tomllib.loads((HERE.parent.parent / "pyproject.toml").read_text())["project"]["version"]
    return {role: f"{prefix}{role}:{tag}" for role in ("actor", "buffer", "learner", "planner")}


__all__ = ["Node", "Unavailable", "image_tags", "iptables_rules", "K8S_CACHE", "E2E_CACHE", "NODE_IP", "BASE_IMAGE"]


if __name__ == "__main__":   # `python -m tests.e2e.node sweep` (make e2e-clean)
    import sys
    if sys.argv[1:] != ["sweep"]:
        sys.exit("usage: python -m tests.e2e.node sweep")
    print("\n".join(sweep()) or "nothing left behind")

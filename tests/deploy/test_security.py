"""The deployment switch for mutual TLS and tokens (k8s/components/tls, tokens, simulator-ingress,
k8s/overlays/secure; the chart's tls.*, auth.*, networkPolicy.simulatorsFrom), checked against the code.

Each secure render's Secrets are made as the kubelet would mount them, with real certificates carrying
the names the chart's cert-manager Certificates (or docs/security.md's openssl recipe) give; every role's
config is then resolved from its rendered args and environment by the role's own code, and every
role-to-role flow of docs/architecture.md does a real mutual-TLS handshake with those settings: so a
mount path, a Secret key, an environment variable or a certificate name that does not fit fails here,
not in a cluster. The NetworkPolicy side is tests/deploy/test_crosscheck.py's flow evaluation.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from unittest import mock

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.net.auth import ROLE_RPCS, TokenStore
from services.common.net.tokens import read_client_token
from services.common.net.grpcutil import start_server
from services.config import load_role_config
from services.common.net.tls import open_channel
from tests.certs import Pki
from tests.deploy.render import (HELM_SECURE, RenderError, container, expand_vars, helm_template, kustomize, of_kind,
                                 pod_env, workloads)
from tests.deploy.test_crosscheck import config_of, parser_of

SECURE = {"kustomize secure": lambda: kustomize("overlays/secure"), "helm secure": lambda: helm_template(*HELM_SECURE)}
# Who dials whom (docs/architecture.md section 6): each pair must complete a mutual-TLS handshake.
FLOWS = (("actor", "buffer"), ("actor", "learner"), ("learner", "buffer"),
         ("planner", "actor"), ("planner", "buffer"), ("planner", "learner"))
TLS_KEYS = ("tls.crt", "tls.key", "ca.crt")       # what cert-manager writes, and docs/security.md's recipe
TOKEN_KEYS = {"tokens": "s3cret-envsession envsession\ns3cret-planner read\n", "planner": "s3cret-planner\n"}


def dns_names(render: list[dict], role: str, workload: dict) -> tuple[str, ...]:
    """The names the role's certificate carries: its cert-manager Certificate's, where the render has
    one, else docs/security.md's openssl recipe (the Service's names, kuberl-role, 127.0.0.1)."""
    secret = tls_volume(workload)["secret"]["secretName"]
    certs = [c for c in of_kind(render, "Certificate") if c["spec"]["secretName"] == secret]
    if certs:
        (cert,) = certs
        return (*cert["spec"]["dnsNames"], *cert["spec"].get("ipAddresses", []))
    return (f"kuberl-{role}", f"kuberl-{role}.kuberl", f"kuberl-{role}.kuberl.svc", "kuberl-role", "127.0.0.1")


def tls_volume(workload: dict) -> dict:
    (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"]
                 if v.get("secret", {}).get("secretName", "").endswith("-tls")]
    return volume


def mounted_secrets(workload: dict, root: Path, role: str, render: list[dict], pki: Pki) -> dict[str, str]:
    """Make each Secret volume of `workload` under `root` with the keys a user (or cert-manager) puts in
    it, and return the container's environment with the mount paths moved there."""
    c, spec = container(workload), workload["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    assert secrets, f"{role}: no Secret is mounted"
    moved = {}
    for mount in c["volumeMounts"]:
        if mount["name"] not in secrets:
            continue
        assert mount.get("readOnly") and "subPath" not in mount, f"{role}: mount {mount} (a subPath never updates)"
        where = root / role / mount["name"]
        where.mkdir(parents=True)
        if secrets[mount["name"]].endswith("-tls"):
            issued = pki.issue(f"kuberl-{role}", sans=dns_names(render, role, workload), filename=f"{role}")
            for key, src in zip(TLS_KEYS, (issued.cert, issued.key, issued.ca)):
                (where / key).write_bytes(src.read_bytes())
        else:
            for key, text in TOKEN_KEYS.items():
                (where / key).write_text(text)
        moved[mount["mountPath"]] = str(where)
    env = pod_env(workload)
    for name, value in env.items():
        for mount_path, where in moved.items():
            if value.startswith(mount_path + "/"):
                env[name] = where + value[len(mount_path):]
    return env


def role_configs(render: list[dict], tmp_path: Path) -> dict[str, object]:
    """Each role's config as its process resolves it: the ConfigMap's config, the rendered args and
    environment (with the Secrets made under tmp_path), through the role's own parser and loader."""
    config_of(render, tmp_path)  # writes tmp_path/config.yaml, and checks it loads
    pki = Pki(tmp_path / "ca")
    configs = {}
    for role, w in workloads(render).items():
        env = mounted_secrets(w, tmp_path / "mounts", role, render, pki)
        args = [expand_vars(a, env) for a in container(w)["args"] if not a.startswith("--config=")]
        with mock.patch.dict(os.environ, env):
            configs[role] = load_role_config(parser_of(role)([*args, f"--config={tmp_path / 'config.yaml'}"]))
    return configs


@pytest.fixture(scope="module", params=list(SECURE))
def secure(request, tmp_path_factory):
    render = SECURE[request.param]()
    return render, role_configs(render, tmp_path_factory.mktemp(request.param.replace(" ", "-")))


def test_every_role_serves_mutual_tls_with_its_mounted_certificate_and_accepts_the_mounted_tokens(secure):
    _, configs = secure
    for role, cfg in configs.items():
        assert cfg.tls.enabled and cfg.tls.client_auth == "require", role
        # The Secret's tokens load as the role's interceptor loads them, with their scopes.
        assert TokenStore(cfg.auth.token_files).scopes("s3cret-envsession") == frozenset({"envsession"}), role
    planner = configs["planner"]
    assert read_client_token(planner.auth.client_token_file, "auth.client_token_file") == "s3cret-planner"


def test_every_flow_completes_a_mutual_tls_handshake_with_the_rendered_settings(secure):
    """A server with each role's settings on 127.0.0.1, dialled with each of its clients' settings: the
    certificate names and the name every role checks (tls.server_name) must fit, and both ends' CA."""
    _, configs = secure

    async def check(server_role: str, client_role: str) -> int:
        srv = await start_server("127.0.0.1:0", lambda s: None, [f"kuberl.v1.{server_role.title()}"],
                                 max_message_bytes=1 << 20, tls=configs[server_role].tls)
        try:
            await srv.set_serving(True)
            async with open_channel(srv.address, configs[client_role].tls, aio=True) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
                return reply.status
        finally:
            await srv.close()

    for client_role, server_role in FLOWS:
        assert asyncio.run(check(server_role, client_role)) == health_pb2.HealthCheckResponse.SERVING, \
            f"{client_role} -> {server_role}"


def test_each_internal_rpc_is_served_to_the_role_that_calls_it_only(secure):
    """tls.role_names as the buffer and the learner resolve it, against the certificates every role
    mounts: each internal RPC (services/common/net/auth.ROLE_RPCS) admits its calling role and refuses the
    others' certificates with PERMISSION_DENIED. (The servers here stand in for the RPCs' handlers: one
    that is reached answers FAILED_PRECONDITION.)"""
    _, configs = secure

    async def reached(request, context):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "reached")

    async def code(server_role: str, method: str, client_role: str) -> grpc.StatusCode:
        service, name = method.strip("/").split("/")
        handlers = grpc.method_handlers_generic_handler(service, {name: grpc.unary_unary_rpc_method_handler(reached)})
        srv = await start_server("127.0.0.1:0", lambda s: s.add_generic_rpc_handlers((handlers,)), [service],
                                 max_message_bytes=1 << 20, tls=configs[server_role].tls)
        try:
            async with open_channel(srv.address, configs[client_role].tls, aio=True) as channel:
                try:
                    await channel.unary_unary(method)(b"", timeout=30)
                except grpc.aio.AioRpcError as err:
                    return err.code()
                return grpc.StatusCode.OK
        finally:
            await srv.close()

    for method, caller in ROLE_RPCS.items():
        server_role = method.split(".")[-1].split("/")[0].lower()
        names = configs[server_role].tls.role_names
        assert names, f"{server_role}: tls.role_names is not set"
        for client_role in configs:
            # (an optional caller, the planner for SetTopology, that role_names does not name: any certificate)
            admitted = client_role == caller or caller not in names
            want = grpc.StatusCode.FAILED_PRECONDITION if admitted else grpc.StatusCode.PERMISSION_DENIED
            assert asyncio.run(code(server_role, method, client_role)) == want, f"{client_role} -> {method}"


def test_the_default_renders_serve_plaintext_and_ask_no_tokens(tmp_path):
    """Secure is a switch: the base and the chart's defaults mount no Secret and leave tls and auth as the
    config says (off)."""
    for render in (kustomize("base"), helm_template()):
        for role, w in workloads(render).items():
            env = pod_env(w)
            assert not [k for k in env if k.startswith(("KUBERL_TLS_", "KUBERL_AUTH_", "KUBERL_TOKEN"))], role
            assert not [v for v in w["spec"]["template"]["spec"]["volumes"] if "secret" in v], role


def test_chart_actor_client_auth_none_lets_simulators_without_certificates_in(tmp_path):
    render = helm_template(*HELM_SECURE, "--set", "tls.actorClientAuth=none")
    configs = role_configs(render, tmp_path)
    assert configs["actor"].tls.client_auth == "none"
    assert {role: cfg.tls.client_auth for role, cfg in configs.items() if role != "actor"} == \
        dict.fromkeys(("buffer", "learner", "planner"), "require")


def test_chart_certificates_name_what_peers_dial():
    """Each cert-manager Certificate writes the Secret its role mounts, for server and client auth, with
    the Service name its peers dial (--buffer, --learner) and the shared name every role checks."""
    render = helm_template(*HELM_SECURE, "--set", "nameOverride=rl", "--set", "tls.serverName=rl-peer")
    ws = workloads(render)
    certs = {c["spec"]["secretName"]: c for c in of_kind(render, "Certificate")}
    assert len(certs) == 4
    for role, w in ws.items():
        cert = certs[tls_volume(w)["secret"]["secretName"]]["spec"]
        assert f"rl-{role}" in cert["dnsNames"] and "rl-peer" in cert["dnsNames"]
        assert {"server auth", "client auth"} <= set(cert["usages"]) and cert["issuerRef"]["name"] == "kuberl-ca"
        assert pod_env(w)["KUBERL_TLS_SERVER_NAME"] == "rl-peer"
    for arg in (*container(ws["actor"])["args"], *container(ws["learner"])["args"]):
        if arg.startswith(("--buffer=", "--learner=")):
            host = arg.split("///")[1].rsplit(":", 1)[0]
            assert any(host in c["spec"]["dnsNames"] for c in certs.values()), arg


def test_chart_refuses_cert_manager_without_an_issuer():
    with pytest.raises(RenderError, match="tls.certManager.issuerRef.name: name the cert-manager CA Issuer"):
        helm_template("--set", "tls.enabled=true", "--set", "tls.certManager.enabled=true")
    with pytest.raises(RenderError, match="actorClientAuth"):
        helm_template("--set", "tls.actorClientAuth=optional")

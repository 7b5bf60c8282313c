"""TLS on every gRPC endpoint, mutual between roles (services/common/net/tls.py, docs/security.md), with real
certificates made here (tests/certs.py): a CA, role certificates for 127.0.0.1/localhost, an expired
one, one from a CA nobody trusts.

A handshake that fails is seen by the client as UNAVAILABLE (gRPC cannot connect); nothing here waits
on time except generous upper bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ipaddress
import json
import logging
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
import yaml
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kuberl.v1 import actor_pb2_grpc, buffer_pb2_grpc, learner_pb2_grpc
from kuberl.v1 import buffer_pb2 as pb_buffer
from kuberl.v1 import common_pb2 as pb
from kuberl.v1 import learner_pb2 as pb_learner
from kuberl_client import EnvSessionClient, SessionError
from services.actor import main as actor_main
from services.buffer import main as buffer_main
from services.cli.main import main as kuberl
from services.common.net.tls import TlsConfig
from services.config import config_from_dict
from services.common.net.grpcutil import MiB, start_server
from services.common.net.tls import open_channel
from services.learner import main as learner_main
from services.planner import main as planner_main
from services.planner.backend import ApplyResult, Replica, RoleState
from services.planner.core import Planner
from tests.certs import Issued, Pki
from tests.helpers import ROOT, TINY_PPO, Service, write_config
from tests.integration.test_pipeline import stack

WAIT_S = 120.0
FRESH = [("grpc.use_local_subchannel_pool", 1)]  # a connection (and handshake) of this channel's own


@pytest.fixture
def pki(tmp_path) -> Pki:
    return Pki(tmp_path / "pki")


@pytest.fixture
def role(pki) -> Issued:
    return pki.issue("role")


def settings(issued: Issued | None = None, **fields) -> TlsConfig:
    base = issued.tls() if issued is not None else {"enabled": True}
    return TlsConfig(**{**base, **fields})


async def check(address: str, tls: TlsConfig | None, service: str = "") -> int:
    """Health/Check over a new connection; raises AioRpcError when refused."""
    async with open_channel(address, tls, aio=True, options=FRESH) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        return reply.status


async def refused(address: str, tls: TlsConfig | None) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await check(address, tls)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    return err.value.details()


@contextlib.asynccontextmanager
async def server(tls: TlsConfig | None, listen: str = "127.0.0.1:0"):
    """A server with health and reflection only (what every role serves), SERVING."""
    srv = await start_server(listen, lambda s: None, [], max_message_bytes=MiB, tls=tls)
    await srv.set_serving(True)
    try:
        yield srv.address
    finally:
        await srv.close()


SERVING = health_pb2.HealthCheckResponse.SERVING


# -- refusals ------------------------------------------------------------------------------------------
async def test_mutual_tls_refuses_every_client_without_a_good_certificate(pki, role, tmp_path):
    expired = pki.issue("expired", days=(-10, -1))
    rogue = Pki(tmp_path / "rogue", name="another CA").issue("role")
    async with server(settings(role)) as address:
        async with open_channel(address, settings(role), aio=True, options=FRESH) as good:
            stub = health_pb2_grpc.HealthStub(good)
            assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)).status == SERVING
            await refused(address, None)                                     # plaintext
            await refused(address, settings(ca_file=str(pki.ca)))            # TLS, no client certificate
            await refused(address, settings(rogue, ca_file=str(pki.ca)))     # a certificate from another CA
            await refused(address, settings(expired))                        # expired
            # The good client's connection was never disturbed, and a new one is served too.
            assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)).status == SERVING
        assert await check(address, settings(role)) == SERVING


async def test_clients_verify_the_server_certificate_and_its_name(pki, role, tmp_path):
    other_ca = Pki(tmp_path / "other")
    named = pki.issue("buffer", sans=("kuberl-buffer.ns.svc",))   # not 127.0.0.1
    expired = pki.issue("expired", days=(-10, -1))
    async with server(settings(named)) as address:
        await refused(address, settings(role, ca_file=str(other_ca.ca)))    # a CA that did not sign it
        await refused(address, settings(role))                              # 127.0.0.1 is not its name
        assert await check(address, settings(role, server_name="kuberl-buffer.ns.svc")) == SERVING
        await refused(address, settings(role, server_name="kuberl-learner.ns.svc"))
    async with server(settings(expired, client_auth="none")) as address:
        await refused(address, settings(ca_file=str(pki.ca)))


async def test_client_auth_none_serves_clients_without_a_certificate(pki, role, tmp_path):
    other_ca = Pki(tmp_path / "other")
    async with server(settings(role, client_auth="none")) as address:
        assert await check(address, settings(ca_file=str(pki.ca))) == SERVING
        assert await check(address, settings(role)) == SERVING             # a certificate does no harm
        await refused(address, settings(ca_file=str(other_ca.ca)))         # the server is still verified
        await refused(address, None)                                        # and TLS still required


# -- rotation ------------------------------------------------------------------------------------------
def _replace(src: Issued, dst: Issued) -> None:
    """Put src's certificate and key where dst's are, each file swapped in at once (as the kubelet
    updates a mounted Secret)."""
    for a, b in ((src.cert, dst.cert), (src.key, dst.key)):
        tmp = b.with_suffix(".new")
        tmp.write_bytes(a.read_bytes())
        os.replace(tmp, b)


async def test_rotated_certificate_files_are_served_to_new_connections_without_a_restart(pki, role, caplog):
    served = pki.issue("old", sans=("old.kuberl",), filename="served")  # the files the server reads
    new = pki.issue("new", sans=("new.kuberl",))
    mismatched = pki.issue("mismatched", sans=("new.kuberl",))
    old_name, new_name = settings(role, server_name="old.kuberl"), settings(role, server_name="new.kuberl")
    async with server(settings(served)) as address:
        async with open_channel(address, old_name, aio=True, options=FRESH) as before:
            stub = health_pb2_grpc.HealthStub(before)
            assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)).status == SERVING
            await refused(address, new_name)

            # A half-done rotation (the new certificate with another key) is not served: the old one stays.
            mismatched.key.replace(pki.dir / "mismatched-swapped-key.pem")
            _replace(Issued(new.cert, pki.dir / "mismatched-swapped-key.pem", pki.ca), served)
            with caplog.at_level(logging.WARNING, logger="services.common.net.tls"):
                assert await check(address, old_name) == SERVING
            assert "do not load, still serving the previous certificate" in caplog.text
            assert "is not the private key" in caplog.text

            _replace(new, served)
            assert await check(address, new_name) == SERVING
            await refused(address, old_name)
            # The connection made before the rotation goes on with what it agreed on.
            assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)).status == SERVING


# -- the plaintext warning -----------------------------------------------------------------------------
@pytest.mark.parametrize("listen,tls,warned", [("0.0.0.0:0", False, True), ("127.0.0.1:0", False, False),
                                               ("0.0.0.0:0", True, False)],
                         ids=["any-address-plaintext", "loopback-plaintext", "any-address-tls"])
async def test_plaintext_on_an_address_others_reach_is_warned_about_once(role, caplog, listen, tls, warned):
    with caplog.at_level(logging.WARNING, logger="services.common.net.grpcutil"):
        async with server(settings(role) if tls else None, listen):
            pass
    records = [r for r in caplog.records if r.name == "services.common.net.grpcutil" and "without TLS" in r.message]
    assert len(records) == (1 if warned else 0), caplog.text
    if warned:
        assert records[0].levelno == logging.WARNING and "0.0.0.0:0" in records[0].message


# -- every role, and the clients -----------------------------------------------------------------------
class StaticBackend:
    """A planner backend that reports the given replicas and changes nothing."""
    name, leader = "static", True

    def __init__(self, **addresses: str):
        self.addresses = addresses

    async def start(self) -> None:
        pass

    async def observe(self):
        return {r: RoleState(desired=1, replicas=[Replica(f"{r}-0", self.addresses[r])]) for r in ("actor", "learner")}

    async def buffers(self):
        return [Replica("buffer-0", self.addresses["buffer"])]

    async def apply(self, targets: dict[str, int], *, dry_run: bool = False):
        return ApplyResult(applied=dict(targets), dry_run=True)

    async def close(self) -> None:
        pass


async def _stats(address: str, stub_cls, tls: TlsConfig) -> dict[str, float]:
    async with open_channel(address, tls, aio=True) as ch:
        return dict((await stub_cls(ch).GetStats(pb.GetStatsRequest(), timeout=30)).metrics)


async def _services(address: str, tls: TlsConfig) -> set[str]:
    async with open_channel(address, tls, aio=True) as ch:
        call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        async for resp in call:
            return {s.name for s in resp.list_services_response.service}
    return set()


async def test_every_role_trains_over_mutual_tls_and_the_planner_and_cli_read_them(role, tmp_path, capsys):
    data = {**TINY_PPO, "tls": role.tls(), "planner": {"enabled": False}}
    cfg = config_from_dict(data)
    config = write_config(tmp_path / "c.yaml", data)
    async with stack(cfg, tmp_path / "ck", actor_id="actor-tls") as (buffer, learner, actor):
        # The learner's second version, and the actor holding one: the weights stream reaches the actor
        # between its fragments, after the learner has published (on a loaded machine, seconds after).
        async with asyncio.timeout(WAIT_S):
            while (await _stats(learner, learner_pb2_grpc.LearnerStub, cfg.tls)).get("learner/policy_version", 0) < 2:
                await asyncio.sleep(0.1)
            while (a := await _stats(actor, actor_pb2_grpc.ActorStub, cfg.tls)).get("actor/policy_version", 0) < 1:
                await asyncio.sleep(0.1)
        b = await _stats(buffer, buffer_pb2_grpc.BufferStub, cfg.tls)
        assert a["actor/policy_version"] >= 1 and a["actor/fragments_pushed_total"] >= 1
        assert b["buffer/samples_served_total"] > 0 and b["buffer/fragments_invalid_total"] == 0
        for address, name in ((buffer, "kuberl.v1.Buffer"), (learner, "kuberl.v1.Learner"), (actor, "kuberl.v1.Actor")):
            assert await check(address, cfg.tls, name) == SERVING                 # health on the same port
            assert name in await _services(address, cfg.tls)                      # and reflection
            await refused(address, None)

        backend = StaticBackend(actor=actor, learner=learner, buffer=buffer)
        async with planner_main.serving(cfg, backend, listen="127.0.0.1:0") as (endpoints, planner):
            await planner.observer.measure()   # GetStats of every role, over mutual TLS
            assert planner.metrics.counters["planner/stats_errors_total"] == 0
            assert all(planner.observer.rates[r][f"{r}-0"].last_ok is not None for r in ("actor", "learner"))
            assert "buffer-0" in planner.observer.buffer_stats
            await refused(endpoints.grpc, None)
            capsys.readouterr()
            assert await asyncio.to_thread(kuberl, ["status", "--planner", endpoints.grpc, "--config", str(config)]) == 0
            assert "backend static" in capsys.readouterr().out

        # `kuberl stats` with the flags alone; without them it is refused.
        flags = ["--tls-ca", str(role.ca), "--tls-cert", str(role.cert), "--tls-key", str(role.key)]
        assert await asyncio.to_thread(kuberl, ["stats", buffer, *flags]) == 0
        assert json.loads(capsys.readouterr().out)["role"] == "buffer"
        with pytest.raises(SystemExit) as exited:   # a bad flag: argparse's exit code 2
            await asyncio.to_thread(kuberl, ["stats", buffer, "--config", str(tmp_path / "none.yaml")])
        assert exited.value.code == 2
        assert f"--config: cannot read {tmp_path / 'none.yaml'}: No such file" in capsys.readouterr().err
        assert await asyncio.to_thread(kuberl, ["stats", buffer]) == 1
        assert "UNAVAILABLE" in capsys.readouterr().out


ROLE_NAMES = {"actor": ["kuberl-actor"], "learner": ["kuberl-learner", "kuberl-learner-spare"]}


def _certificate(pki: Pki, stem, cn: str, sans: list) -> TlsConfig:
    """A client's settings with a certificate from `pki` of CN `cn` and exactly these subjectAltName
    entries (none: no extension), which tests/certs.Pki.issue does not make."""
    import datetime

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
               .issuer_name(pki.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(pki.key, hashes.SHA256())
    stem.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    stem.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return TlsConfig(enabled=True, cert_file=str(stem.with_suffix(".pem")), key_file=str(stem.with_suffix(".key")),
                     ca_file=str(pki.ca))


async def _code(address: str, tls: TlsConfig, call) -> tuple[grpc.StatusCode, str]:
    """The status and details of `call(channel)` (an awaitable RPC, or an async iterator of one)."""
    async with open_channel(address, tls, aio=True, options=FRESH) as ch:
        try:
            got = call(ch)
            if hasattr(got, "__aiter__"):
                async for _ in got:
                    break
            else:
                await got
        except grpc.aio.AioRpcError as err:
            return err.code(), err.details()
    return grpc.StatusCode.OK, ""


async def test_role_names_serve_each_internal_rpc_only_to_the_role_that_calls_it(pki, tmp_path):
    """Each role holds its own certificate (CN and DNS name kuberl-<role>); with tls.role_names the run
    trains, and a certificate of the wrong role gets PERMISSION_DENIED, counted, on each internal RPC
    while reads stay open to any certificate."""
    certs = {r: pki.issue(f"kuberl-{r}", sans=(f"kuberl-{r}", "127.0.0.1", "localhost"))
             for r in ("actor", "buffer", "learner", "planner")}
    cfg = {r: config_from_dict({**TINY_PPO, "tls": certs[r].tls(role_names=ROLE_NAMES), "planner": {"enabled": False}})
           for r in certs}
    tls = {r: c.tls for r, c in cfg.items()}
    async with buffer_main.serving(cfg["buffer"], listen="127.0.0.1:0") as buffer, \
            learner_main.serving(cfg["learner"], listen="127.0.0.1:0", buffer=buffer.grpc,
                                 checkpoint_dir=str(tmp_path / "ck")) as learner, \
            actor_main.serving(cfg["actor"], listen="127.0.0.1:0", buffer=buffer.grpc, learner=learner.grpc,
                               actor_id="actor-roles") as actor:
        async with asyncio.timeout(WAIT_S):
            while (await _stats(learner.grpc, learner_pb2_grpc.LearnerStub, tls["planner"])).get(
                    "learner/policy_version", 0) < 2:
                await asyncio.sleep(0.1)
        a = await _stats(actor.grpc, actor_pb2_grpc.ActorStub, tls["planner"])
        assert a["actor/policy_version"] >= 1 and a["actor/fragments_pushed_total"] >= 1

        def push(ch):
            return buffer_pb2_grpc.BufferStub(ch).PushTrajectories(iter([]), timeout=30)

        def progress(ch):
            return buffer_pb2_grpc.BufferStub(ch).ReportProgress(pb_buffer.LearnerProgress(), timeout=30)

        # Names only from a certificate's DNS names (or its CN when it has none): not from URI, email or
        # IP entries, nor from the CN beside DNS names.
        odd = _certificate(pki, tmp_path / "odd", "kuberl-learner", [
            x509.DNSName("sim-1"), x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
            x509.UniformResourceIdentifier("kuberl-actor"), x509.RFC822Name("kuberl-learner")])
        learner_names = "kuberl-learner, localhost"   # (its 127.0.0.1 is an IP entry: not a name)
        wrong = {   # what: (server, client settings, call, the RPC's calling role, the names the refusal reports)
            "push as a learner": (buffer.grpc, tls["learner"], push, "actor", learner_names),
            "batches as an actor": (buffer.grpc, tls["actor"], lambda ch: buffer_pb2_grpc.BufferStub(ch).StreamBatches(
                pb_buffer.BatchRequest(learner_id="x", batch_size=1), timeout=30), "learner", "kuberl-actor, localhost"),
            "progress as the planner": (buffer.grpc, tls["planner"], progress, "learner", "kuberl-planner, localhost"),
            "weights as the buffer": (learner.grpc, tls["buffer"], lambda ch: learner_pb2_grpc.LearnerStub(
                ch).SubscribeWeights(pb_learner.WeightsRequest(subscriber_id="x"), timeout=30), "actor", "kuberl-buffer, localhost"),
            "push with kuberl-actor as a URI": (buffer.grpc, odd, push, "actor", "sim-1"),
            "progress with kuberl-learner as CN beside a DNS name": (buffer.grpc, odd, progress, "learner", "sim-1"),
            # A client still writing when it is refused hears PERMISSION_DENIED, not INTERNAL: the buffer
            # reads what it sends up to its half-close before answering.
            "push of 2,000 frames as a learner": (buffer.grpc, tls["learner"], lambda ch: ch.stream_unary(
                "/kuberl.v1.Buffer/PushTrajectories")(iter([b"x" * 65536] * 2000), timeout=60), "actor", learner_names),
        }
        for what, (address, client_tls, call, caller, presented) in wrong.items():
            code, details = await _code(address, client_tls, call)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (what, code, details)
            # (the names the server accepts are in its log, not in the refusal)
            assert details.endswith(f" is served to {caller}s only: the client certificate names {presented}, "
                                    f"not one of tls.role_names.{caller}"), (what, details)
        b = await _stats(buffer.grpc, buffer_pb2_grpc.BufferStub, tls["planner"])   # reads: any certificate
        lrn = await _stats(learner.grpc, learner_pb2_grpc.LearnerStub, tls["actor"])
        assert b["buffer/auth_wrong_role_total"] == 6 and lrn["learner/auth_wrong_role_total"] == 1, (b, lrn)
        assert b["buffer/fragments_invalid_total"] == 0 and b["buffer/samples_served_total"] > 0
        # A second name of a role is as good as the first, in any case; a CN counts where there is no DNS name.
        spare = pki.issue("spare", sans=("KUBERL-Learner-Spare", "127.0.0.1"))
        code, details = await _code(buffer.grpc, settings(spare), lambda ch: buffer_pb2_grpc.BufferStub(
            ch).ReportProgress(pb_buffer.LearnerProgress(learner_id="spare", policy_version=1), timeout=30))
        assert code == grpc.StatusCode.OK, (code, details)
        cn_only = _certificate(pki, tmp_path / "cn", "kuberl-actor", [])
        code, details = await _code(buffer.grpc, cn_only, lambda ch: buffer_pb2_grpc.BufferStub(ch).PushTrajectories(
            iter([]), timeout=30))
        assert code == grpc.StatusCode.OK, (code, details)

        # SetTopology (the planner's shard list): any certificate from the CA while role_names does not
        # name the planner (the empty list is refused as malformed, not as the wrong caller) ...
        def topology(ch):
            return buffer_pb2_grpc.BufferStub(ch).SetTopology(pb_buffer.SetTopologyRequest(), timeout=30)
        code, details = await _code(buffer.grpc, tls["actor"], topology)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "topology.addresses: empty" in details, (code, details)
    # ... and the planner's alone where it does.
    named = config_from_dict({**TINY_PPO, "tls": certs["buffer"].tls(role_names={**ROLE_NAMES, "planner": ["kuberl-planner"]}),
                              "planner": {"enabled": False}})
    async with buffer_main.serving(named, listen="127.0.0.1:0") as guarded:
        code, details = await _code(guarded.grpc, tls["actor"], topology)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "served to planners only" in details, (code, details)
        code, details = await _code(guarded.grpc, tls["planner"], topology)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)


async def test_role_names_need_verified_client_certificates(role):
    """A buffer cannot authorise by certificate what it does not ask for: refused before it binds."""
    from services.common.net.tls import TlsError

    cfg = config_from_dict({**TINY_PPO, "tls": role.tls(role_names=ROLE_NAMES, client_auth="none")})
    with pytest.raises(TlsError, match="tls.role_names is set, so kuberl.v1.Buffer authorises its callers by their "
                                       "certificates, but tls.client_auth is none"):
        async with buffer_main.serving(cfg, listen="127.0.0.1:0"):
            pass
    async with server(settings(role, role_names=ROLE_NAMES, client_auth="none")) as address:   # no internal RPCs
        assert await check(address, settings(ca_file=str(role.ca))) == SERVING


async def test_a_planner_whose_certificate_files_break_counts_stats_errors_and_goes_on(role, pki, tmp_path):
    """Files mid-rotation (a certificate with another key) make a read fail, not the planner."""
    other = pki.issue("other")
    cfg = config_from_dict({**TINY_PPO, "tls": role.tls(key_file=str(other.key)), "planner": {"enabled": False}})
    planner = Planner(cfg, StaticBackend(actor="127.0.0.1:1", learner="127.0.0.1:1", buffer="127.0.0.1:1"))
    await planner.observer.measure()
    assert planner.metrics.counters["planner/stats_errors_total"] == 3 and not planner.observer.stats.channels
    await planner.close()


def external(tls: dict) -> dict:
    cfg = copy.deepcopy(TINY_PPO)
    cfg["env"] = {"id": "CartPole-v1", "mode": "external"}
    return {**cfg, "tls": tls}


def _session(actor: str, steps: int, **tls) -> int:
    """A kuberl_client session of `steps` steps; returns the policy version of the last actions."""
    rng = np.random.default_rng(0)
    with EnvSessionClient(actor, session_id="tls-sim", num_envs=2, obs_shape=(4,), num_actions=2, timeout_s=60,
                          wait_for_ready=False, **tls) as client:
        actions = client.reset(rng.standard_normal((2, 4)).astype(np.float32))
        for _ in range(steps):
            assert actions.shape == (2,)
            actions = client.step(rng.standard_normal((2, 4)).astype(np.float32), np.ones(2, np.float32),
                                  np.zeros(2, bool), np.zeros(2, bool))
        return client.policy_version


@pytest.mark.parametrize("client_auth", ["require", "none"])
async def test_kuberl_client_sessions_over_tls(role, tmp_path, client_auth):
    cfg = config_from_dict(external(role.tls(client_auth=client_auth)))
    async with stack(cfg, tmp_path / "ck", actor_id="actor-tls") as (_, _, actor):
        mine = {"cert_file": str(role.cert), "key_file": str(role.key)} if client_auth == "require" else {}
        version = await asyncio.to_thread(_session, actor, 20, ca_file=str(role.ca), **mine)
        # Every step reached the actor over TLS, and was answered with weights it held.
        a = await _stats(actor, actor_pb2_grpc.ActorStub, cfg.tls)
        assert a["actor/env_steps_total"] == 20 * 2 and version <= a["actor/policy_version"], (version, a)
        with pytest.raises(SessionError) as err:
            await asyncio.to_thread(_session, actor, 1)      # plaintext
        assert err.value.code == "UNAVAILABLE"
        if client_auth == "require":
            with pytest.raises(SessionError) as err:
                await asyncio.to_thread(_session, actor, 1, ca_file=str(role.ca))   # no client certificate
            assert err.value.code == "UNAVAILABLE"


def test_kuberl_client_names_the_parameter_and_file_it_cannot_use(role, tmp_path):
    other = Pki(tmp_path / "other").issue("other")
    kw = dict(session_id="s", num_envs=1, obs_shape=(4,), num_actions=2)
    with pytest.raises(ValueError, match=r"^ca_file: cannot read .*missing\.pem: No such file"):
        EnvSessionClient("127.0.0.1:1", ca_file=str(tmp_path / "missing.pem"), **kw)
    with pytest.raises(ValueError, match=r"^cert_file is set but key_file is not"):
        EnvSessionClient("127.0.0.1:1", ca_file=str(role.ca), cert_file=str(role.cert), **kw)
    with pytest.raises(ValueError, match=r"^key_file: .*other-key\.pem is not the private key of the certificate"):
        EnvSessionClient("127.0.0.1:1", cert_file=str(role.cert), key_file=str(other.key), **kw)


# -- processes: flags, exit codes, the Node.js example, `kuberl up` --------------------------------------
def test_a_role_with_a_tls_file_it_cannot_use_exits_2_naming_the_setting_and_the_file(role, tmp_path):
    config = write_config(tmp_path / "c.yaml", {**TINY_PPO, "tls": {"enabled": True}})
    missing = tmp_path / "missing.pem"
    for args, said in (
            ([], "tls.enabled is true but tls.cert_file (--tls-cert, $KUBERL_TLS_CERT), tls.key_file"),
            (["--tls-cert", str(role.cert), "--tls-key", str(role.key), "--tls-ca", str(missing)],
             f"tls.ca_file (--tls-ca, $KUBERL_TLS_CA): cannot read {missing}: No such file or directory"),
            (["--tls-cert", str(role.cert), "--tls-key", str(role.ca), "--tls-ca", str(role.ca)],
             f"tls.key_file (--tls-key, $KUBERL_TLS_KEY): {role.ca} holds no PEM private key")):
        buffer = Service("buffer", tmp_path, config, *args)
        assert buffer.popen.wait(60) == 2, buffer.output()
        assert "buffer cannot start: " + said in buffer.output(), buffer.output()


def node_or_skip() -> str:
    from tests.integration.test_node_simulator import node_example
    return node_example("node-cartpole")


def test_roles_given_tls_by_flags_serve_the_node_example_given_it_by_environment(role, tmp_path):
    node = node_or_skip()
    config = write_config(tmp_path / "c.yaml", external({"client_auth": "none"}))
    flags = ["--tls-cert", str(role.cert), "--tls-key", str(role.key), "--tls-ca", str(role.ca)]
    procs: list[Service] = []
    try:
        for name, extra in (("buffer", []), ("learner", ["--checkpoint-dir", str(tmp_path / "ck")]), ("actor", [])):
            peers = [a for r in procs for a in (f"--{r.role}", r.address)]
            procs.append(Service(name, tmp_path, config, *flags, *extra, *peers))
            procs[-1].wait_ready(timeout=3 * WAIT_S)
        actor = procs[-1].address

        def simulate(env: dict) -> subprocess.CompletedProcess:
            return subprocess.run([node, "cartpole.js", "--actor", actor, "--envs", "2", "--steps", "50",
                                   "--connect-timeout", "5", "--reply-timeout", str(int(WAIT_S))],
                                  cwd=ROOT / "examples" / "node-cartpole", capture_output=True, text=True,
                                  timeout=2 * WAIT_S, env={**os.environ, **env})

        run = simulate({"KUBERL_TLS_CA": str(role.ca)})
        assert run.returncode == 0, run.stdout + run.stderr
        assert json.loads(run.stdout.strip().splitlines()[-1])["steps"] == 50
        plain = simulate({})
        assert plain.returncode == 1 and "cannot connect to the actor" in plain.stderr, plain.stdout + plain.stderr
        for p in reversed(procs):
            assert p.terminate() == 0, p.output()
    finally:
        for p in procs:
            p.kill()


def test_kuberl_up_runs_every_role_over_mutual_tls(role, tmp_path):
    config = write_config(tmp_path / "c.yaml", {
        **TINY_PPO, "tls": role.tls(), "topology": {"actors": 1},
        "run": {"target_return": None, "max_env_steps": 3000, "poll_interval_s": 0.2}})
    out = subprocess.run([sys.executable, "-m", "services.cli.main", "up", str(config), "--run-dir", str(tmp_path),
                          "--name", "run", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=4 * WAIT_S)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["reason"] == "max_env_steps", summary
    assert summary["policy_version"] >= 1, summary
    assert summary["exit_codes"] and set(summary["exit_codes"].values()) == {0}, summary
    assert "--config" in out.stdout  # the planner API hint says how to dial it over TLS
    run_cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())   # what every process read
    assert run_cfg["tls"] == {**role.tls(), "client_auth": "require", "server_name": "", "role_names": {}}


def test_kuberl_up_refuses_tls_files_it_cannot_use_before_starting_anything(role, tmp_path):
    config = write_config(tmp_path / "c.yaml", TINY_PPO)
    out = subprocess.run([sys.executable, "-m", "services.cli.main", "up", str(config), "--run-dir", str(tmp_path),
                          "--tls-cert", str(role.cert), "--tls-key", str(role.key)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "tls.enabled is true but tls.ca_file (--tls-ca, $KUBERL_TLS_CA) is not set" in out.stderr
    assert not any(tmp_path.glob("*/logs"))

"""TLS for every kuberl gRPC endpoint: the credentials servers serve and clients dial with (docs/security.md).

The settings are the config's `tls` section (`TlsConfig`, below), with each process's
--tls-* flags over it (services/common/service/runtime.with_tls_flags). Everything is read from PEM files, so
that a Kubernetes Secret (cert-manager's) mounted at the configured paths is all a pod needs:

- `server_credentials`: what a role's server serves. The certificate, key and CA are read again when
  one of the files changes (its mtime, size or inode), at the next TLS handshake: a rotated
  certificate is served to new connections without a restart (connections already open keep theirs).
  A change that does not load (a key that does not match the certificate, half-written files) is
  logged and the previous configuration kept until the files change again.
- `open_channel`: every client's channel (roles to each other, the planner to every role, the CLI,
  kuberl_client): TLS with the CA, and this process's certificate as its client certificate, or
  plaintext when TLS is off. The only place channel credentials are made.
- `check_role`: a role's settings before it starts: enabled needs a certificate, its key and a CA,
  each readable PEM, the key matching the certificate; a TlsError names the setting and the file.

Certificates given to a channel are read when the channel is made: a process's client certificate is
not reloaded on rotation (docs/security.md, "What is still open").
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, overload

import grpc

from services.common.atomic import stamps
from services.common.settings import ConfigError, require

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsConfig:
    """TLS on every gRPC endpoint, from PEM files (a mounted Secret; see docs/security.md). Each process's
    --tls-cert/--tls-key/--tls-ca/--tls-client-auth/--tls-server-name flags override these
    (services/common/service/runtime.with_tls_flags); the files are checked when a role starts."""
    enabled: bool = False      # serve and dial every gRPC endpoint over TLS (the files below)
    cert_file: str = ""        # this process's certificate chain: served, and presented when dialling other roles
    key_file: str = ""         # cert_file's private key (unencrypted)
    ca_file: str = ""          # the CA bundle that verifies peers: servers dialled, and clients under client_auth: require
    client_auth: str = "require"  # "require": servers accept only clients with a certificate from ca_file (mTLS);
    #                               "none": server-side TLS only (e.g. an actor whose simulators have no certificate)
    server_name: str = ""      # the name checked in servers' certificates ("" = the host dialled)
    # Authorisation per role of the roles' internal RPCs: the certificate names (DNS names of its
    # subjectAltName, or its CN) that prove a client is an actor or a learner. Set, the buffer serves
    # PushTrajectories/WatchInsertLimit only to actors and StreamBatches/ReportProgress only to learners, and a learner
    # SubscribeWeights only to actors (services/common/net/auth.ROLE_RPCS); empty: any certificate from ca_file.
    role_names: dict[str, tuple[str, ...]] = field(default_factory=dict, hash=False)  # each role's certificate names

    def __post_init__(self) -> None:
        require(self.client_auth in ("require", "none"), "client_auth", self.client_auth,
                "must be 'require' (servers verify client certificates: mutual TLS) or 'none'")
        if self.role_names:
            require(set(PEER_ROLES) <= set(self.role_names) <= set(PEER_ROLES) | set(OPTIONAL_PEER_ROLES),
                    "role_names", dict(self.role_names),
                    f"must name the certificates of exactly these roles, the callers of the internal RPCs: "
                    f"{', '.join(PEER_ROLES)} (and may name {', '.join(OPTIONAL_PEER_ROLES)}'s)")
            for role, names in self.role_names.items():
                require(bool(names) and all(isinstance(n, str) and n.strip() for n in names),
                        f"role_names.{role}", names, "must be a list of certificate names (DNS names or CN)")


PEER_ROLES = ("actor", "learner")  # the roles whose certificates tls.role_names names
OPTIONAL_PEER_ROLES = ("planner",)  # named too, the buffers take SetTopology from it alone


def parse_role_names(text: str, setting: str = "--tls-role-names") -> dict[str, tuple[str, ...]]:
    """`actor=kuberl-actor,learner=kuberl-learner` (several names of a role joined by `|`) as a
    `tls.role_names` mapping; ConfigError naming `setting` when malformed."""
    out: dict[str, tuple[str, ...]] = {}
    for part in (p.strip() for p in text.split(",")):
        role, eq, names = part.partition("=")
        role = role.strip()
        if not part or not eq or role in out:
            raise ConfigError(setting, f"{text!r} is invalid: write ROLE=NAME[|NAME...] for each of "
                                       f"{', '.join(PEER_ROLES)}, separated by commas")
        out[role] = tuple(n.strip() for n in names.split("|") if n.strip())
    return out



class TlsError(ValueError):
    """TLS settings that cannot work; the message names the setting and the file."""


@dataclass(frozen=True)
class Names:
    """How errors name each setting: config keys (with the flags that override them) for a role,
    parameter names for kuberl_client."""
    cert: str = "tls.cert_file (--tls-cert, $KUBERL_TLS_CERT)"
    key: str = "tls.key_file (--tls-key, $KUBERL_TLS_KEY)"
    ca: str = "tls.ca_file (--tls-ca, $KUBERL_TLS_CA)"


ROLE_NAMES = Names()


def _read(path: str, setting: str, marker: bytes, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise TlsError(f"{setting}: cannot read {path}: {err.strerror or err}") from None
    if marker not in data:
        raise TlsError(f"{setting}: {path} holds no PEM {what} (no '{marker.decode()}' line)")
    return data


def read_cert(path: str, setting: str) -> bytes:
    return _read(path, setting, b"-----BEGIN CERTIFICATE-----", "certificate")


def read_key(path: str, setting: str) -> bytes:
    data = _read(path, setting, b"PRIVATE KEY-----", "private key")
    if b"ENCRYPTED" in data:
        raise TlsError(f"{setting}: {path} is an encrypted private key; gRPC needs it unencrypted "
                       f"(keep it in a Secret readable only by the role)")
    return data


def _refuse_password() -> NoReturn:
    raise TlsError("encrypted private key")


def read_pair(cert_file: str, key_file: str, names: Names = ROLE_NAMES) -> tuple[bytes, bytes]:
    """(certificate chain, key) as PEM; TlsError when either cannot be read or the key is not the
    certificate's."""
    cert, key = read_cert(cert_file, names.cert), read_key(key_file, names.key)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert_file, key_file, password=_refuse_password)
    except ssl.SSLError as err:
        if err.reason == "KEY_VALUES_MISMATCH":
            raise TlsError(f"{names.key}: {key_file} is not the private key of the certificate in {cert_file}, "
                           f"{names.cert}") from None
        raise TlsError(f"{names.cert} / {names.key}: {cert_file} and {key_file} do not load as a certificate "
                       f"and its key: {err}") from None
    return cert, key


def read_ca(ca_file: str, names: Names = ROLE_NAMES) -> bytes:
    """The CA bundle as PEM; TlsError when it cannot be read or holds no certificate OpenSSL loads."""
    data = read_cert(ca_file, names.ca)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=ca_file)
    except ssl.SSLError as err:
        raise TlsError(f"{names.ca}: {ca_file} does not load as a CA bundle: {err}") from None
    return data


def check_role(tls: TlsConfig, names: Names = ROLE_NAMES) -> None:
    """A role's settings, before it starts: with TLS on it serves a certificate, presents it as its
    client certificate and verifies its peers, so it needs all three files, loadable."""
    if not tls.enabled:
        return
    missing = [name for name, path in ((names.cert, tls.cert_file), (names.key, tls.key_file),
                                       (names.ca, tls.ca_file)) if not path]
    if missing:
        raise TlsError(f"tls.enabled is true but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                       f"not set: a role serves its certificate and key and verifies peers with the CA")
    read_pair(tls.cert_file, tls.key_file, names)
    read_ca(tls.ca_file, names)


# -- servers ------------------------------------------------------------------------------------------
class _Reloading:
    """The server's certificate configuration, read again when a file changes (gRPC asks at each
    handshake, from its own threads)."""

    def __init__(self, tls: TlsConfig):
        self.tls = tls
        self.paths = (tls.cert_file, tls.key_file, tls.ca_file)
        self.lock = threading.Lock()
        self.stamp = self._stamp()
        self.initial = self._load()

    def _stamp(self) -> tuple[tuple[int, int, int] | None, ...]:
        return stamps(self.paths)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        cert, key = read_pair(self.tls.cert_file, self.tls.key_file)
        ca = read_ca(self.tls.ca_file) if self.tls.client_auth == "require" else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration if the files changed and load, else None (keep the current one)."""
        try:
            with self.lock:
                stamp = self._stamp()
                if None in stamp:
                    return None  # a file is being replaced: look again at the next handshake
                if stamp == self.stamp:
                    return None
                self.stamp = stamp  # a change that does not load is reported once, not at every handshake
                try:
                    config = self._load()
                except TlsError as err:
                    log.warning("TLS files changed but do not load, still serving the previous certificate: %s", err)
                    return None
            log.info("TLS files changed: serving the certificate in %s to new connections", self.tls.cert_file)
            return config
        except Exception:  # never into gRPC's handshake thread
            log.exception("reloading the TLS files failed; still serving the previous certificate")
            return None


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """A server's TLS credentials, reloaded when the files change; client certificates required and
    verified against the CA when `client_auth` is "require"."""
    check_role(tls)
    reloading = _Reloading(tls)
    # (the fetcher's None keeps the current configuration, as gRPC documents; its stubs leave None out)
    return grpc.dynamic_ssl_server_credentials(reloading.initial, reloading.fetch,  # type: ignore[arg-type]
                                               require_client_authentication=tls.client_auth == "require")


# -- clients ------------------------------------------------------------------------------------------
def channel_credentials(tls: TlsConfig, names: Names = ROLE_NAMES) -> grpc.ChannelCredentials:
    """Credentials that verify the server against `ca_file` (empty: the system's roots) and present
    `cert_file`/`key_file` as the client certificate (both or neither)."""
    if bool(tls.cert_file) != bool(tls.key_file):
        given, other = (names.cert, names.key) if tls.cert_file else (names.key, names.cert)
        raise TlsError(f"{given} is set but {other} is not: a client certificate needs its key")
    cert = key = None
    if tls.cert_file:
        cert, key = read_pair(tls.cert_file, tls.key_file, names)
    ca = read_ca(tls.ca_file, names) if tls.ca_file else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


@overload
def open_channel(target: str, tls: TlsConfig | None, *, options: Sequence[tuple[str, Any]] = (),
                 aio: Literal[False] = False, names: Names = ROLE_NAMES) -> grpc.Channel: ...


@overload
def open_channel(target: str, tls: TlsConfig | None, *, options: Sequence[tuple[str, Any]] = (),
                 aio: Literal[True], names: Names = ROLE_NAMES,
                 interceptors: Sequence[Any] = ()) -> grpc.aio.Channel: ...


def open_channel(target: str, tls: TlsConfig | None, *, options: Sequence[tuple[str, Any]] = (), aio: bool = False,
                 names: Names = ROLE_NAMES, interceptors: Sequence[Any] = ()) -> grpc.Channel | grpc.aio.Channel:
    """A channel to `target` (a grpc.aio one with `aio`, with `interceptors`): TLS as `tls` says,
    plaintext when it is None or off. `tls.server_name` replaces the host of `target` as the name checked
    in the server's certificate."""
    extra = {"interceptors": list(interceptors)} if aio and interceptors else {}
    module = grpc.aio if aio else grpc   # (a module: what it makes is typed by the declared return)
    channel: grpc.Channel | grpc.aio.Channel
    if tls is None or not tls.enabled:
        channel = module.insecure_channel(target, options=list(options), **extra)
        return channel
    override = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    channel = module.secure_channel(target, channel_credentials(tls, names), options=[*options, *override], **extra)
    return channel

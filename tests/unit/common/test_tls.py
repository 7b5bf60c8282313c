"""The `tls` config section, the --tls-* flags over it, and the checks of the TLS files (services/common/net/tls.py):
every error names the setting (and the flag that overrides it) and the file."""

from __future__ import annotations

import logging
import os

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from services.common.net.tls import ConfigError, TlsConfig
from services.config import config_from_dict
from services.common.service.runtime import base_parser, with_tls_flags
from services.common.net.tls import TlsError, _Reloading, channel_credentials, check_role
from tests.certs import Pki


@pytest.fixture
def pki(tmp_path) -> Pki:
    return Pki(tmp_path / "pki")


def test_tls_is_off_by_default_and_mutual_when_on():
    tls = config_from_dict({}).tls
    assert tls == TlsConfig() and not tls.enabled and tls.client_auth == "require"
    assert config_from_dict({"tls": {"enabled": True, "client_auth": "none"}}).tls.client_auth == "none"


@pytest.mark.parametrize("data,match", [
    ({"client_auth": "optional"}, r"^tls.client_auth: 'optional' is invalid: must be 'require'"),
    ({"cert": "x.pem"}, r"^tls.cert: unknown key \(known keys here: ca_file, cert_file, client_auth, enabled, "),
    ({"enabled": "yes"}, r"^tls.enabled: must be bool"),
])
def test_bad_tls_settings_name_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"tls": data})


def parse(*argv: str):
    return base_parser("buffer", 50051, "test").parse_args(list(argv))


def test_flags_override_the_config_and_a_file_turns_tls_on():
    cfg = config_from_dict({"tls": {"cert_file": "/cfg/cert.pem", "key_file": "/cfg/key.pem", "ca_file": "/cfg/ca.pem"}})
    assert with_tls_flags(cfg, parse()) is cfg
    tls = with_tls_flags(cfg, parse("--tls-cert", "/pod/cert.pem", "--tls-client-auth", "none")).tls
    assert tls == TlsConfig(enabled=True, cert_file="/pod/cert.pem", key_file="/cfg/key.pem", ca_file="/cfg/ca.pem",
                            client_auth="none")
    # --tls-client-auth or --tls-server-name alone change how, not whether.
    assert not with_tls_flags(cfg, parse("--tls-client-auth", "none")).tls.enabled


def test_role_names_from_the_config_the_flag_or_the_environment(monkeypatch):
    names = {"actor": ("kuberl-actor",), "learner": ("kuberl-learner", "kuberl-learner-b")}
    cfg = config_from_dict({"tls": {"role_names": {"actor": ["kuberl-actor"],
                                                   "learner": ["kuberl-learner", "kuberl-learner-b"]}}})
    assert cfg.tls.role_names == names
    flag = with_tls_flags(config_from_dict({}), parse("--tls-role-names",
                                                      "actor=kuberl-actor, learner=kuberl-learner|kuberl-learner-b"))
    assert flag.tls.role_names == names and not flag.tls.enabled   # (how, not whether)
    monkeypatch.setenv("KUBERL_TLS_ROLE_NAMES", "actor=a,learner=l")
    assert with_tls_flags(config_from_dict({}), parse()).tls.role_names == {"actor": ("a",), "learner": ("l",)}
    # The planner's certificate may be named too (the buffers then take SetTopology from it alone).
    monkeypatch.setenv("KUBERL_TLS_ROLE_NAMES", "actor=a,learner=l,planner=p")
    assert with_tls_flags(config_from_dict({}), parse()).tls.role_names["planner"] == ("p",)


@pytest.mark.parametrize("text,match", [
    ("actor=kuberl-actor", r"^--tls-role-names \(\$KUBERL_TLS_ROLE_NAMES\): .*must name the certificates of "
                           r"exactly these roles, the callers of the internal RPCs: actor, learner"),
    ("actor=a,learner=l,buffer=b", r"exactly these roles, .*: actor, learner \(and may name planner's\)"),
    ("actor=a,learner=", r"role_names.learner: \(\) is invalid: must be a list of certificate names"),
    ("actor:a,learner:l", r"^--tls-role-names \(\$KUBERL_TLS_ROLE_NAMES\): 'actor:a,learner:l' is invalid: write "
                          r"ROLE=NAME\[\|NAME\.\.\.\] for each of actor, learner"),
    ("actor=a,actor=b", r"is invalid: write ROLE=NAME"),
])
def test_bad_role_names_name_the_flag(text, match):
    with pytest.raises(ConfigError, match=match):
        with_tls_flags(config_from_dict({}), parse("--tls-role-names", text))


def test_bad_role_names_in_the_config_name_the_key():
    with pytest.raises(ConfigError, match=r"^tls.role_names: .* must name the certificates of exactly these roles"):
        config_from_dict({"tls": {"role_names": {"actor": ["a"]}}})
    with pytest.raises(ConfigError, match=r"^tls.role_names.actor: \(\) is invalid"):
        config_from_dict({"tls": {"role_names": {"actor": [], "learner": ["l"]}}})


def test_tls_files_come_from_the_environment_under_the_flags(monkeypatch):
    monkeypatch.setenv("KUBERL_TLS_CERT", "/env/cert.pem")
    monkeypatch.setenv("KUBERL_TLS_KEY", "/env/key.pem")
    monkeypatch.setenv("KUBERL_TLS_CA", "/env/ca.pem")
    tls = with_tls_flags(config_from_dict({}), parse("--tls-ca", "/flag/ca.pem")).tls
    assert (tls.enabled, tls.cert_file, tls.key_file, tls.ca_file) == (True, "/env/cert.pem", "/env/key.pem",
                                                                       "/flag/ca.pem")


def test_tls_off_checks_nothing(tmp_path):
    check_role(TlsConfig(cert_file=str(tmp_path / "missing.pem")))


def role_tls(issued, **fields) -> TlsConfig:
    return TlsConfig(**{**issued.tls(), **fields})


def test_every_unusable_file_is_named_with_its_setting(pki, tmp_path):
    role = pki.issue("role")
    not_pem = tmp_path / "notes.txt"
    not_pem.write_text("hello")
    bad_ca = tmp_path / "bad-ca.pem"
    bad_ca.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    key = load_pem_private_key(role.key.read_bytes(), None)
    encrypted = tmp_path / "encrypted-key.pem"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    other = pki.issue("other")
    missing = tmp_path / "missing.pem"
    cases = [
        (TlsConfig(enabled=True, ca_file=str(pki.ca)),
         "tls.enabled is true but tls.cert_file (--tls-cert, $KUBERL_TLS_CERT), tls.key_file (--tls-key, "
         "$KUBERL_TLS_KEY) are not set"),
        (role_tls(role, cert_file=str(missing)),
         f"tls.cert_file (--tls-cert, $KUBERL_TLS_CERT): cannot read {missing}: No such file or directory"),
        (role_tls(role, cert_file=str(not_pem)),
         f"tls.cert_file (--tls-cert, $KUBERL_TLS_CERT): {not_pem} holds no PEM certificate"),
        (role_tls(role, key_file=str(role.cert)),
         f"tls.key_file (--tls-key, $KUBERL_TLS_KEY): {role.cert} holds no PEM private key"),
        (role_tls(role, key_file=str(encrypted)),
         f"tls.key_file (--tls-key, $KUBERL_TLS_KEY): {encrypted} is an encrypted private key"),
        (role_tls(role, key_file=str(other.key)),
         f"tls.key_file (--tls-key, $KUBERL_TLS_KEY): {other.key} is not the private key of the certificate in "
         f"{role.cert}, tls.cert_file"),
        (role_tls(role, ca_file=str(bad_ca)),
         f"tls.ca_file (--tls-ca, $KUBERL_TLS_CA): {bad_ca} does not load as a CA bundle"),
    ]
    for tls, said in cases:
        with pytest.raises(TlsError) as err:
            check_role(tls)
        assert str(err.value).startswith(said), (str(err.value), said)
    check_role(role_tls(role))


def test_a_client_needs_no_certificate_but_a_certificate_needs_its_key(pki):
    role = pki.issue("role")
    channel_credentials(TlsConfig(enabled=True, ca_file=str(pki.ca)))
    channel_credentials(TlsConfig(enabled=True))   # the system's CAs
    with pytest.raises(TlsError, match=r"^tls.key_file \(--tls-key, \$KUBERL_TLS_KEY\) is set but tls.cert_file"):
        channel_credentials(TlsConfig(enabled=True, key_file=str(role.key)))


def test_the_server_reads_its_files_again_only_when_they_change_and_load(pki, caplog):
    served, new, other = pki.issue("served"), pki.issue("new"), pki.issue("other")
    reloading = _Reloading(role_tls(served))
    assert reloading.initial is not None
    assert reloading.fetch() is None                       # unchanged: keep what is served
    os.replace(new.cert, served.cert)                      # a new certificate, the old key: refused
    with caplog.at_level(logging.WARNING, logger="services.common.net.tls"):
        assert reloading.fetch() is None
        assert reloading.fetch() is None                   # reported once, not at every handshake
    assert caplog.text.count("do not load") == 1
    os.replace(new.key, served.key)                        # now the pair is whole
    assert reloading.fetch() is not None
    assert reloading.fetch() is None
    served.key.unlink()                                    # mid-swap: nothing to read, keep serving
    assert reloading.fetch() is None
    os.replace(other.key, served.key)
    os.replace(other.cert, served.cert)
    assert reloading.fetch() is not None

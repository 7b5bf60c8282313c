"""Token files, scopes and session caps (services/common/net/auth.py) and the auth config section."""

from __future__ import annotations

import os

import grpc
import pytest

from services.common.net import auth
from services.common.net.auth import TokenStore, parse_tokens, scope_of
from services.common.net.tokens import AuthError, read_client_token
from services.config import ConfigError, config_from_dict, load_role_config


def _write(path, text: str) -> str:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return str(path)


def test_token_lines_scopes_and_comments(tmp_path):
    tokens = parse_tokens("# comment\n\nabc   # trailing\ndef read,planner:write\n", "f")
    assert [scopes for _, scopes in tokens] == [frozenset(auth.SCOPES), frozenset({"read", "planner:write"})]
    with pytest.raises(AuthError, match="f:1: an unknown scope after the token"):
        parse_tokens("abc admin", "f")
    with pytest.raises(AuthError, match="f:2: a line is"):
        parse_tokens("a\nabc read extra", "f")


def test_store_rereads_changed_files_and_keeps_the_last_good_tokens(tmp_path):
    path = tmp_path / "tokens"
    store = TokenStore([_write(path, "old\n")])
    assert store.scopes("old") == frozenset(auth.SCOPES) and store.scopes("new") is None
    _write(path, "old\nnew envsession\n")
    assert store.scopes("new") == frozenset({"envsession"}) and store.scopes("old") is not None
    _write(path, "new envsession\n")
    assert store.scopes("old") is None
    _write(path, "# nothing\n")                          # a file that does not load: the previous tokens stay
    assert store.scopes("new") == frozenset({"envsession"})
    assert store.scopes("") is None and store.scopes("n" * 10_000) is None


def test_a_deleted_token_file_revokes_its_tokens_and_the_others_still_reload(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    store = TokenStore([_write(old, "old-token\n"), _write(new, "new-token\n")])
    assert store.scopes("old-token") and store.scopes("new-token")
    os.remove(old)                                       # revoked by taking the file out of the Secret
    assert store.scopes("old-token") is None and store.scopes("new-token")
    _write(new, "new-token\nnewer-token\n")             # the remaining file is still followed
    assert store.scopes("newer-token")
    os.remove(new)                                       # none left: refused, the last tokens stay
    assert store.scopes("newer-token")


def test_store_refuses_missing_or_empty_files(tmp_path):
    with pytest.raises(AuthError, match="auth.token_files: cannot read"):
        TokenStore([str(tmp_path / "none")])
    with pytest.raises(AuthError, match="hold no token"):
        TokenStore([_write(tmp_path / "empty", "# only a comment\n")])


def test_scopes_of_rpcs():
    assert scope_of("/kuberl.v1.Actor/EnvSession", False) == "envsession"
    assert scope_of("/kuberl.v1.Planner/SetReplicas", False) == "planner:write"
    assert scope_of("/kuberl.v1.Planner/GetStatus", False) is None
    assert scope_of("/kuberl.v1.Planner/GetStatus", True) == "read"
    assert scope_of("/kuberl.v1.Buffer/GetStats", True) == "read"
    for internal in ("/kuberl.v1.Buffer/PushTrajectories", "/kuberl.v1.Buffer/StreamBatches",
                     "/kuberl.v1.Buffer/ReportProgress", "/kuberl.v1.Learner/SubscribeWeights",
                     "/grpc.health.v1.Health/Check"):
        assert scope_of(internal, True) is None


def test_caps_count_open_sessions_and_new_ones_a_minute():
    caps = auth._Caps(max_open=1, per_minute=0, metrics=None)
    caps.acquire("token:a")
    with pytest.raises(auth._Refused) as err:
        caps.acquire("token:a")
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions_per_token" in err.value.details
    caps.acquire("token:b")
    caps.release("token:a")
    caps.acquire("token:a")
    rate = auth._Caps(max_open=0, per_minute=2, metrics=None)
    rate.acquire("peer:x")
    rate.acquire("peer:x")
    with pytest.raises(auth._Refused, match="new_sessions_per_minute"):
        rate.acquire("peer:x")


def test_client_token_file_and_config(tmp_path):
    assert read_client_token(_write(tmp_path / "t", "# mine\n  tok read\n")) == "tok"
    with pytest.raises(AuthError, match="token_file: .* holds no token"):
        read_client_token(_write(tmp_path / "e", "\n"))
    cfg = config_from_dict({"auth": {"token_files": ["/a", "/b"], "protect_reads": True}})
    assert cfg.auth.token_files == ("/a", "/b") and cfg.auth.protect_reads
    with pytest.raises(ConfigError, match="auth.max_sessions_per_token"):
        config_from_dict({"auth": {"max_sessions_per_token": -1}})
    with pytest.raises(ConfigError, match="auth.new_sessions_per_minute"):
        config_from_dict({"auth": {"new_sessions_per_minute": -1.0}})
    with pytest.raises(ConfigError, match=r"auth.token_files\[0\]"):
        config_from_dict({"auth": {"token_files": [""]}})


def test_full_buckets_are_forgotten_when_there_are_many(monkeypatch):
    monkeypatch.setattr(auth, "MAX_BUCKETS", 3)
    caps = auth._Caps(max_open=0, per_minute=1, metrics=None)
    for key in ("a", "b", "c"):
        caps.acquire(key)
        caps.release(key)
    for bucket in caps.buckets.values():
        bucket.level = bucket.capacity           # refilled
    caps.acquire("d")
    assert set(caps.buckets) == {"d"}


def test_role_flags_and_environment_over_the_auth_section(tmp_path, monkeypatch):
    """How a pod that mounts the token Secret gets its files with the shared ConfigMap's config
    (k8s/components/tokens): $KUBERL_AUTH_TOKEN_FILES and $KUBERL_TOKEN_FILE, or the flags over them."""
    from services.common.service.runtime import base_parser

    config = tmp_path / "c.yaml"
    config.write_text("auth: {token_files: [/from/config], protect_reads: true}\n")
    planner, other = _write(tmp_path / "planner", "p1\n"), _write(tmp_path / "other", "p2\n")
    monkeypatch.setenv("KUBERL_AUTH_TOKEN_FILES", "/run/a/tokens, /run/b/tokens")
    monkeypatch.setenv("KUBERL_TOKEN_FILE", planner)
    cfg = load_role_config(base_parser("planner", 0, "").parse_args(["--config", str(config)]))
    assert cfg.auth.token_files == ("/run/a/tokens", "/run/b/tokens")
    assert cfg.auth.client_token_file == planner and cfg.auth.protect_reads
    cfg = load_role_config(base_parser("planner", 0, "").parse_args(
        ["--config", str(config), "--auth-token-files", "/x", "--token-file", other]))
    assert (cfg.auth.token_files, cfg.auth.client_token_file) == (("/x",), other)
    # The token a role sends must be there at start (a Secret without the key): not a warning per call.
    with pytest.raises(AuthError, match=r"auth.client_token_file \(--token-file, \$KUBERL_TOKEN_FILE\): cannot read "
                                        r"/run/a/planner"):
        load_role_config(base_parser("planner", 0, "").parse_args(["--config", str(config), "--token-file",
                                                                   "/run/a/planner"]))
    monkeypatch.delenv("KUBERL_AUTH_TOKEN_FILES")
    monkeypatch.delenv("KUBERL_TOKEN_FILE")
    cfg = load_role_config(base_parser("planner", 0, "").parse_args(["--config", str(config)]))
    assert (cfg.auth.token_files, cfg.auth.client_token_file) == (("/from/config",), "")
    with pytest.raises(ConfigError, match=r"--auth-token-files \(\$KUBERL_AUTH_TOKEN_FILES\): ' , ' names no file"):
        load_role_config(base_parser("planner", 0, "").parse_args(["--config", str(config), "--auth-token-files", " , "]))

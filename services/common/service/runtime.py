"""Process lifecycle shared by every service: argument parsing, logging, uvloop, signals, exit codes.

`run_service` runs `serve(args, stop)` on uvloop; SIGTERM and SIGINT set `stop`, after which the
service runs its own shutdown sequence. A crash in any background loop ends the process with
exit code 1 (Kubernetes restarts it); a clean stop exits 0; a config or TLS setting that cannot work
(a ConfigError or TlsError raised as the service starts, an address it cannot bind among them) exits
2, as a bad flag does.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar
from pathlib import Path

from services.common.local.procs import die_with_parent

if TYPE_CHECKING:
    from services.common.config import CommonConfig

log = logging.getLogger(__name__)

# The experiment's config: a CommonConfig, or services.config.ExperimentConfig (a subclass) kept as itself.
C = TypeVar("C", bound="CommonConfig")


def base_parser(role: str, default_port: int, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"kuberl {role}", description=description)
    p.add_argument("--config", default=os.environ.get("KUBERL_CONFIG"),
                   help="experiment config YAML (default: $KUBERL_CONFIG, else built-in CartPole PPO)")
    p.add_argument("--listen", default=f"0.0.0.0:{default_port}",
                   help=f"host:port to serve gRPC on; port 0 picks a free one (default 0.0.0.0:{default_port})")
    p.add_argument("--metrics-listen", default=os.environ.get("KUBERL_METRICS_LISTEN", "0.0.0.0:9400"),
                   help="host:port for the Prometheus /metrics endpoint; '' turns it off (default 0.0.0.0:9400)")
    p.add_argument("--ready-file", default=None,
                   help="write {address, metrics, pid} as JSON here once serving (used by `kuberl up`)")
    p.add_argument("--log-level", default=os.environ.get("KUBERL_LOG_LEVEL", "INFO"))
    add_tls_arguments(p)
    g = p.add_argument_group("tokens (over the config's auth section; docs/security.md)")
    g.add_argument("--auth-token-files", default=os.environ.get("KUBERL_AUTH_TOKEN_FILES") or None, metavar="FILE[,FILE]",
                   help="files of the bearer tokens this role accepts (default $KUBERL_AUTH_TOKEN_FILES, "
                        "else auth.token_files)")
    g.add_argument("--token-file", default=os.environ.get("KUBERL_TOKEN_FILE") or None, metavar="FILE",
                   help="file whose first token this role sends when it calls others, as the CLI's --token-file "
                        "(default $KUBERL_TOKEN_FILE, else auth.client_token_file)")
    return p


def add_tls_arguments(p: argparse.ArgumentParser, server: bool = True) -> None:
    """The --tls-* flags: every role's, and the CLI's (no --tls-client-auth for a command that serves
    nothing). Each overrides its key of the config's `tls` section; a certificate, key or CA given here
    (or by $KUBERL_TLS_*) turns TLS on (docs/security.md)."""
    g = p.add_argument_group("TLS (over the config's tls section; docs/security.md)")
    g.add_argument("--tls-cert", default=os.environ.get("KUBERL_TLS_CERT") or None, metavar="FILE",
                   help="PEM certificate chain served and presented as client certificate (default $KUBERL_TLS_CERT, "
                        "else tls.cert_file)")
    g.add_argument("--tls-key", default=os.environ.get("KUBERL_TLS_KEY") or None, metavar="FILE",
                   help="its PEM private key (default $KUBERL_TLS_KEY, else tls.key_file)")
    g.add_argument("--tls-ca", default=os.environ.get("KUBERL_TLS_CA") or None, metavar="FILE",
                   help="PEM CA bundle that verifies peers (default $KUBERL_TLS_CA, else tls.ca_file)")
    if server:
        g.add_argument("--tls-client-auth", choices=("require", "none"),
                       default=os.environ.get("KUBERL_TLS_CLIENT_AUTH") or None,
                       help="require and verify client certificates (mutual TLS), or not (default "
                            "$KUBERL_TLS_CLIENT_AUTH, else tls.client_auth)")
        g.add_argument("--tls-role-names", default=os.environ.get("KUBERL_TLS_ROLE_NAMES") or None,
                       metavar="actor=NAME,learner=NAME",
                       help="authorise the internal RPCs per role: the certificate names of actors and learners, "
                            "several joined by | (default $KUBERL_TLS_ROLE_NAMES, else tls.role_names)")
    g.add_argument("--tls-server-name", default=os.environ.get("KUBERL_TLS_SERVER_NAME") or None, metavar="NAME",
                   help="the name checked in servers' certificates instead of the host dialled "
                        "(default $KUBERL_TLS_SERVER_NAME, else tls.server_name)")


TLS_FLAGS = {"tls_cert": "cert_file", "tls_key": "key_file", "tls_ca": "ca_file", "tls_client_auth": "client_auth",
             "tls_server_name": "server_name", "tls_role_names": "role_names"}


def with_tls_flags(cfg: C, args: argparse.Namespace) -> C:
    """`cfg` (a services.common.config.CommonConfig) with the --tls-* flags of `args` over its `tls` section. A certificate,
    key or CA given by flag or environment turns TLS on. ConfigError naming the flag when one is malformed."""
    from services.common.settings import ConfigError
    from services.common.net.tls import parse_role_names

    given: dict[str, Any] = {key: getattr(args, flag) for flag, key in TLS_FLAGS.items()
                             if getattr(args, flag, None) is not None}
    if not given:
        return cfg
    if "role_names" in given:
        given["role_names"] = parse_role_names(given["role_names"], "--tls-role-names ($KUBERL_TLS_ROLE_NAMES)")
    on = cfg.tls.enabled or bool({"cert_file", "key_file", "ca_file"} & given.keys())
    try:
        return dataclasses.replace(cfg, tls=dataclasses.replace(cfg.tls, enabled=on, **given))
    except ConfigError as err:
        if "role_names" in given and "role_names" in str(err):
            raise ConfigError("--tls-role-names ($KUBERL_TLS_ROLE_NAMES)", str(err)) from None
        raise


def with_auth_flags(cfg: C, args: argparse.Namespace) -> C:
    """`cfg` with a role's --auth-token-files and --token-file over its `auth` section: what lets one
    ConfigMap serve pods that mount their token Secret (k8s/components/tokens, the chart's auth values)."""
    from services.common.settings import ConfigError

    given: dict[str, Any] = {}
    if getattr(args, "auth_token_files", None) is not None:
        files = tuple(f.strip() for f in args.auth_token_files.split(",") if f.strip())
        if not files:
            raise ConfigError("--auth-token-files ($KUBERL_AUTH_TOKEN_FILES)", f"{args.auth_token_files!r} names no file")
        given["token_files"] = files
    if getattr(args, "token_file", None) is not None:
        given["client_token_file"] = args.token_file
    return dataclasses.replace(cfg, auth=dataclasses.replace(cfg.auth, **given)) if given else cfg


def add_client_arguments(p: argparse.ArgumentParser) -> None:
    """A client command's TLS flags (`kuberl stats`, the planner commands, the images' healthcheck), and
    --config, whose tls section they dial with: inside a pod, $KUBERL_CONFIG is the role's own."""
    p.add_argument("--config", default=os.environ.get("KUBERL_CONFIG"),
                   help="experiment config YAML whose tls section to dial with (default $KUBERL_CONFIG; none: "
                        "plaintext unless --tls-* flags are given)")
    add_tls_arguments(p, server=False)
    p.add_argument("--token-file", default=os.environ.get("KUBERL_TOKEN_FILE") or None, metavar="FILE",
                   help="file whose first token is sent as 'authorization: Bearer' (default $KUBERL_TOKEN_FILE; "
                        "else $KUBERL_TOKEN itself; else the config's auth.client_token_file; docs/security.md)")


def configure_logging(level: str, role: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {role}[%(process)d] %(name)s: %(message)s")


@dataclass(frozen=True)
class Endpoints:
    """Where a running service listens: gRPC, and the Prometheus /metrics endpoint (None if off)."""
    grpc: str
    metrics: str | None = None


def write_ready_file(path: str | None, endpoints: Endpoints) -> None:
    if not path:
        return
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps({"address": endpoints.grpc, "metrics": endpoints.metrics, "pid": os.getpid()}))
    tmp.replace(path)


def stop_cleanly_until_serving() -> None:
    """Until run_service installs its own handlers, SIGTERM ends the process at once with exit code 0.

    Every role's `__main__` calls this before importing its service (torch alone takes seconds). A
    process asked to stop while still importing has served nothing, holds nothing and has nothing to
    flush; the default action would end it with -15, which `kuberl up`, the planner's local backend and
    Kubernetes all read as a crash (seen: an actor the planner added just before a run's target was
    reached, stopped mid-import)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))


def run_service(role: str, args: argparse.Namespace,
                serve: Callable[[argparse.Namespace, asyncio.Event], Awaitable[None]]) -> int:
    """Run a service until SIGTERM/SIGINT; return the process exit code."""
    die_with_parent()
    configure_logging(args.log_level, role)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(args, stop)

    import uvloop

    from services.common.net.tokens import AuthError
    from services.common.settings import ConfigError
    from services.common.net.tls import TlsError

    try:
        uvloop.run(main())
    except (AuthError, ConfigError, TlsError) as err:  # raised before serving: the config or a flag cannot work
        log.critical("%s cannot start: %s", role, err)   # (an address a role cannot bind: Lifecycle.serve)
        return 2
    except Exception as exc:  # a background loop crashed: end loudly, let the supervisor restart us
        for failure in (exc.exceptions if isinstance(exc, BaseExceptionGroup) else [exc]):
            log.critical("%s failed: %s", role, failure, exc_info=failure)
        return 1
    log.info("%s stopped cleanly", role)
    return 0


def exit_process(code: int) -> NoReturn:
    """End a service process once its shutdown sequence has run: flush logs and stdio, then leave
    without interpreter finalisation. By then every server, channel and checkpoint is closed; what is
    left are library threads (gRPC's poller, torch's pools), and joining those at exit is where a
    process can hang (seen with gRPC in pytest's final garbage collection), leaving its supervisor to
    kill it and count a failure."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)

"""The channel a command (`kuberl stats`, `kuberl plan`) opens to a running service."""

from __future__ import annotations

import argparse
import os

from services.common.net.tokens import AuthError, read_client_token, with_token
from services.common.service.runtime import with_tls_flags
from services.common.net.tls import TlsError, open_channel
from services.config import ConfigError, ExperimentConfig, load_config


def client_channel(p: argparse.ArgumentParser, args: argparse.Namespace, target: str):
    """A blocking channel to `target` as --config's tls section and the --tls-* flags say; a config or
    TLS file that cannot work ends the command as a bad flag does (exit code 2). A client needs no
    certificate of its own unless the server requires one (client_auth: require). Every call carries the
    bearer token of --token-file, $KUBERL_TOKEN or auth.client_token_file, when there is one."""
    try:
        cfg = with_tls_flags(load_config(args.config) if args.config else ExperimentConfig(), args)
        token_file = getattr(args, "token_file", None)
        if token_file:
            token = read_client_token(token_file, "--token-file")
        elif os.environ.get("KUBERL_TOKEN"):
            token = os.environ["KUBERL_TOKEN"].strip()
        elif cfg.auth.client_token_file:
            token = read_client_token(cfg.auth.client_token_file, "auth.client_token_file")
        else:
            token = None
        return with_token(open_channel(target, cfg.tls), token, cfg.tls.enabled)
    except (AuthError, ConfigError, TlsError) as err:
        p.error(str(err))
    except OSError as err:  # the config file
        p.error(f"--config: cannot read {args.config}: {err.strerror or err}")

"""The remote commands' connection to servers: the credentials a trainer passes to `Client`
(TLS roots, client certificate, bearer token), from flags and the environment."""

from __future__ import annotations

import argparse
import os

from tokenfeed.client import Client
from tokenfeed.server.errors import ConfigError

TOKEN_ENV = "TOKENFEED_TOKEN"


def credentials(args) -> dict:
    """The client's credential options from the remote commands' flags (docs/client.md): the
    same TLS roots, client certificate and token a trainer passes to `Client`."""
    out: dict = {}
    for flag in ("tls_root_certs", "tls_client_cert", "tls_client_key", "tls_server_name"):
        if getattr(args, flag):
            out[flag] = getattr(args, flag)
    if args.tls and not out:
        out["tls"] = True  # the system's roots
    if args.token_file:
        out["token_file"] = args.token_file
    elif args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            raise ConfigError(f"--token-env: the environment variable {args.token_env} is unset")
        out["token"] = token
    elif os.environ.get(TOKEN_ENV):
        out["token"] = os.environ[TOKEN_ENV]
    return out


def remote(args, job: str | None = None):
    try:
        return Client(args.target, job=job, **credentials(args))
    except ValueError as e:  # an unreadable certificate or token file
        raise ConfigError(str(e)) from e


def add_credentials(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("credentials (a server with server.tls or server.auth)")
    g.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    g.add_argument("--tls-root-certs", metavar="PEM", help="TLS, trusting these roots")
    g.add_argument("--tls-client-cert", metavar="PEM", help="client certificate (mTLS)")
    g.add_argument("--tls-client-key", metavar="PEM", help="its private key")
    g.add_argument("--tls-server-name", help="the name the server's certificate must carry")
    g.add_argument("--token-file", help="a file holding the bearer token")
    g.add_argument(
        "--token-env",
        metavar="VAR",
        help=f"environment variable holding the bearer token (default: {TOKEN_ENV}, when set; "
        "a token is never taken on the command line, where other users can read it)",
    )

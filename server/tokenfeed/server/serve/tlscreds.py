"""The gRPC port's TLS credentials from the files `server.tls` names (mTLS when it names a
client CA), checked when the server starts: grpc would report any problem with them as a failure
to bind."""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.settings.config import TlsSpec


def _read_pem(path: str, key: str, origin: str, marker: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{origin}: {key}: cannot read {path!r}: {e.strerror}") from None
    if marker.encode() not in data:
        raise ConfigError(f"{origin}: {key}: {path!r} holds no PEM {marker.strip('-')}")
    return data


def server_credentials(tls: TlsSpec, origin: str = "<config>") -> grpc.ServerCredentials:
    """The gRPC port's credentials; mTLS when `client_ca_file` is set. The files are checked
    here (readable, PEM, the key matching the certificate) because grpc reports any problem
    with them as a failure to bind."""
    cert = _read_pem(tls.cert_file, "server.tls.cert_file", origin, "-----BEGIN CERTIFICATE")
    key = _read_pem(tls.key_file, "server.tls.key_file", origin, "PRIVATE KEY-----")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # The password callback refuses encrypted keys instead of prompting on a terminal.
        context.load_cert_chain(tls.cert_file, tls.key_file, password=lambda: b"")
    except ssl.SSLError as e:
        raise ConfigError(
            f"{origin}: server.tls.key_file: {tls.key_file!r} is not an unencrypted private key "
            f"of the certificate in server.tls.cert_file {tls.cert_file!r} ({e.reason or e})"
        ) from None
    ca = None
    if tls.client_ca_file:
        key_path = "server.tls.client_ca_file"
        ca = _read_pem(tls.client_ca_file, key_path, origin, "-----BEGIN CERTIFICATE")
        try:
            context.load_verify_locations(cafile=tls.client_ca_file)
        except ssl.SSLError as e:
            raise ConfigError(
                f"{origin}: {key_path}: {tls.client_ca_file!r} is not a PEM CA "
                f"bundle ({e.reason or e})"
            ) from None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )

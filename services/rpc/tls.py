"""TLS for the internal gRPC hops (coordinator -> roles), from certificate files named in the configuration.

| setting | on a role (gRPC server) | on the coordinator (gRPC client) |
|---|---|---|
| --grpc-tls-cert / --grpc-tls-key | serve TLS with this certificate | present it as a client certificate (mTLS) |
| --grpc-tls-ca | require client certificates signed by it (mTLS) | verify the roles' certificates against it |
| --grpc-tls-server-name | — | the name every role certificate carries (pods are dialled by IP) |

Without them the hops are plaintext: keep the gRPC ports on a private network
(--grpc-host, NetworkPolicy; docs/security.md).  Files are read at start-up;
a missing or unreadable file stops the process with a clear error.
Who calls what: services.runtime.server (roles) and coordinator.cluster (channels).
"""

from __future__ import annotations

from typing import Any

import grpc


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read the gRPC TLS {what} {path}: {exc.strerror}") from None


def check_files(cert: str, key: str, ca: str) -> None:
    """Raise ValueError naming what is wrong with the TLS settings."""
    if bool(cert) != bool(key):
        raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
    for path, what in ((cert, "certificate"), (key, "key"), (ca, "CA bundle")):
        if path:
            _read(path, what)


def server_credentials(config: Any) -> grpc.ServerCredentials | None:
    """TLS (mTLS with a CA) for a role's gRPC server, or None for plaintext."""
    if not config.security.grpc_tls_cert:
        return None
    pair = (_read(config.security.grpc_tls_key, "key"), _read(config.security.grpc_tls_cert, "certificate"))
    ca = _read(config.security.grpc_tls_ca, "CA bundle") if config.security.grpc_tls_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(config: Any) -> grpc.ChannelCredentials | None:
    """TLS for the coordinator's channels (verifying the roles with the CA), or None for plaintext."""
    if not config.security.grpc_tls_ca:
        return None
    cert = _read(config.security.grpc_tls_cert, "certificate") if config.security.grpc_tls_cert else None
    key = _read(config.security.grpc_tls_key, "key") if config.security.grpc_tls_key else None
    return grpc.ssl_channel_credentials(_read(config.security.grpc_tls_ca, "CA bundle"), key, cert)


def channel_options(config: Any) -> list[tuple[str, Any]]:
    name = config.security.grpc_tls_server_name
    return [("grpc.ssl_target_name_override", name)] if name and config.security.grpc_tls_ca else []

"""How the process's listeners are made: gRPC servers with the sidecar's transport limits, TLS
from the configured files (for gRPC and for HTTPS, the same files), and how callers identify
on the client port and on the admin listener. `app.py` binds them and swaps them on SIGHUP."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import grpc

from scheduler_svc.config import ServerConfig, ServerTls, SidecarConfig, is_loopback
from scheduler_svc.errors import ConfigError
from scheduler_svc.serving.auth import (
    ANONYMOUS_BESIDE_CREDENTIALS,
    ANONYMOUS_CLIENT,
    LOCAL_ADMIN,
    NOBODY,
    Credentials,
)
from scheduler_svc.serving.fronts.guard import Guard, Identity


def identities(cfg: SidecarConfig) -> tuple[Identity, Identity]:
    """How callers are identified on the client port and on the admin listener."""
    auth_cfg = cfg.auth
    credentials = None
    if auth_cfg.credentials_file is not None:
        credentials = Credentials.load(auth_cfg.credentials_file)
    anonymous = auth_cfg.anonymous
    if anonymous == "auto":
        anonymous = "client" if credentials is None else "none"
    if anonymous != "client":
        nobody = NOBODY
    elif credentials is None:
        nobody = ANONYMOUS_CLIENT
    else:  # beside credentials: a tenant of its own, never one of theirs
        nobody = ANONYMOUS_BESIDE_CREDENTIALS
    client = Identity(credentials, nobody)
    local = auth_cfg.local_admin and is_loopback(cfg.server.admin_host)
    admin = Identity(credentials, LOCAL_ADMIN if local else NOBODY)
    return client, admin


def tls_configuration(tls: ServerTls | None) -> Any:
    """The gRPC listeners' certificate configuration from the configured files."""
    assert tls is not None
    try:
        key = Path(tls.key_file).read_bytes()
        chain = Path(tls.cert_file).read_bytes()
        roots = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    except OSError as exc:
        raise ConfigError(f"server.tls: cannot read {exc.filename}: {exc.strerror}") from None
    return grpc.ssl_server_certificate_configuration([(key, chain)], roots)


def https_context(tls: ServerTls | None) -> ssl.SSLContext:
    """A TLS context for the HTTP listener from the configured files (the same as the gRPC
    listeners')."""
    assert tls is not None
    fresh = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        fresh.load_cert_chain(tls.cert_file, tls.key_file)
        if tls.client_ca_file:
            fresh.load_verify_locations(tls.client_ca_file)
            fresh.verify_mode = ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_OPTIONAL
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"server.tls: cannot load the certificate files: {exc}") from None
    return fresh


def grpc_server(server_cfg: ServerConfig, guard: Guard) -> grpc.aio.Server:
    """A gRPC server behind `guard`, with the configured message, keepalive and age limits."""
    return grpc.aio.server(
        interceptors=[guard],
        options=[
            ("grpc.max_receive_message_length", server_cfg.max_message_bytes),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ("grpc.keepalive_time_ms", int(server_cfg.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.max_connection_age_ms", int(server_cfg.max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", int(server_cfg.drain_grace_s * 1000) + 5000),
            ("grpc.max_concurrent_streams", 1000),
        ],
    )

"""The one way the tests, the bench and the chaos tool start the real sidecar as a subprocess:
`scheduler-svc serve` on free loopback ports, ready when its `sidecar ready` log line names
them. Each caller reads the process's JSON log its own way; the command and the ready line are
here."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def serve_command(triton_url: str, config: Path | None = None, http: bool = False) -> list[str]:
    """`scheduler-svc serve` in front of `triton_url` on free loopback ports (the gRPC and admin
    listeners; HTTP too when `http`), with `config` where given."""
    command = [sys.executable, "-m", "scheduler_svc.cli", "serve", "--triton-url", triton_url]
    command += ["--port", "0", "--admin-port", "0", "--host", "127.0.0.1"]
    if http:
        command += ["--http-port", "0"]
    if config is not None:
        command += ["--config", str(config)]
    return command


@dataclass(frozen=True)
class Ready:
    """The ports the started sidecar bound (None: that listener is off)."""

    port: int
    admin_port: int | None
    http_port: int | None
    metrics_port: int | None


def ready_ports(event: Mapping[str, Any]) -> Ready | None:
    """The ports a `sidecar ready` log event names; None for any other event."""
    if event.get("event") != "sidecar ready":
        return None
    return Ready(
        int(event["port"]),
        event.get("admin_port"),
        event.get("http_port"),
        event.get("metrics_port"),
    )

"""The sidecar subprocess's command and ready line (the integration tests start it for real)."""

from __future__ import annotations

from pathlib import Path

from scheduler_svc.testing.process import Ready, ready_ports, serve_command


def test_the_command_binds_free_loopback_ports_and_takes_a_config() -> None:
    command = serve_command("127.0.0.1:8001", Path("/tmp/s.yaml"), http=True)
    assert command[1:4] == ["-m", "scheduler_svc.cli", "serve"]
    pairs = dict(zip(command[4::2], command[5::2], strict=True))
    assert pairs == {
        "--triton-url": "127.0.0.1:8001",
        "--port": "0",
        "--admin-port": "0",
        "--host": "127.0.0.1",
        "--http-port": "0",
        "--config": "/tmp/s.yaml",
    }
    assert "--http-port" not in serve_command("t:1") and "--config" not in serve_command("t:1")


def test_only_the_ready_line_names_ports() -> None:
    ready = {"event": "sidecar ready", "port": "5001", "admin_port": 5002, "http_port": None}
    assert ready_ports(ready) == Ready(5001, 5002, None, None)
    assert ready_ports({"event": "request end", "port": 1}) is None

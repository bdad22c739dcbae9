"""The real sidecar as a subprocess (`scheduler-svc serve`) on a free port, for the tests."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import yaml

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.testing.process import ready_ports, serve_command


class SidecarProcess:
    def __init__(
        self,
        triton_url: str,
        workdir: Path,
        config: dict[str, Any] | None = None,
        config_file: bool = True,  # False: started without --config (flags only)
    ) -> None:
        assert config_file or not config
        self.config_file = config_file
        self.triton_url = triton_url
        self.config_path = workdir / "sidecar.yaml"
        self.config_path.write_text(yaml.safe_dump(config or {}))
        self.lines: list[str] = []
        self.port = 0
        self.admin_port: int | None = None
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self._ready = threading.Event()
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self, timeout_s: float = 60) -> SidecarProcess:
        config = self.config_path if self.config_file else None
        self._proc = subprocess.Popen(
            serve_command(self.triton_url, config, http=True),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout_s):
            self.stop()
            raise AssertionError("the sidecar did not start:\n" + "\n".join(self.lines[-30:]))
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self.lines.append(line.rstrip("\n"))
            event = self._event(line)
            if event and (ports := ready_ports(event)) is not None:
                self.port, self.admin_port = ports.port, ports.admin_port
                self.http_port, self.metrics_port = ports.http_port, ports.metrics_port
                self._ready.set()

    @staticmethod
    def _event(line: str) -> dict[str, Any] | None:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            return None
        return event if isinstance(event, dict) else None

    def events(self, name: str) -> list[dict[str, Any]]:
        return [
            e for line in list(self.lines) if (e := self._event(line)) and e.get("event") == name
        ]

    def wait_for_events(
        self, name: str, enough: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 30
    ) -> list[dict[str, Any]]:
        """The log is read by a thread: wait until its `name` events satisfy `enough`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            events = self.events(name)
            if enough(events):
                return events
            time.sleep(0.02)
        raise AssertionError(f"the sidecar's log never showed the expected {name!r} events")

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.url)

    @property
    def http_url(self) -> str:
        """The HTTP fronts' base address (OpenAI under /v1, Triton's generate under /v2)."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def admin_url(self) -> str:
        return f"127.0.0.1:{self.admin_port}"

    def admin(self) -> pb_grpc.AdminStub:
        """The Admin service on the admin listener (loopback: no credential needed)."""
        return pb_grpc.AdminStub(grpc.insecure_channel(self.admin_url))

    def scheduler(self) -> pb_grpc.SchedulerStub:
        return pb_grpc.SchedulerStub(self.channel())

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)

    def signal(self, signum: int) -> None:
        assert self._proc is not None
        self._proc.send_signal(signum)

    def wait(self, timeout_s: float = 60) -> int:
        """Wait for the process to exit and its whole log to be read."""
        assert self._proc is not None and self._reader is not None
        code = self._proc.wait(timeout=timeout_s)
        self._reader.join(timeout_s)
        return code

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def eventually(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll `check` until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting until {what}")

"""Start, watch and stop the bundled `tritonserver` on a model repository.

`TritonServer` picks ports (0 means a free one), starts the server with a private backend
directory, forwards its log line by line, waits until the server and every model are ready, and
stops it with SIGTERM followed by SIGKILL after a grace period. Failures become the launcher
errors of `scheduler_svc.errors`, with the model name and Triton's own reason where it gave one.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TextIO

from scheduler_svc.errors import (
    LauncherError,
    ModelLoadError,
    PortInUseError,
    TritonExitedError,
    TritonStartTimeoutError,
)
from scheduler_svc.tools.triton.distribution import TritonDistribution

_LOAD_FAILED = re.compile(r"failed to load '([^']+)' version \d+: (.*?)\"?$")
_PORT_TAKEN = re.compile(r"failed to start (\w+) service: .*Socket '[^']*:(\d+)' already in use")
_SERVICE_NAMES = {"HTTP": "http", "GRPC": "grpc", "Metrics": "metrics"}
_instance_counter = itertools.count()


@dataclass(frozen=True)
class TritonPorts:
    grpc: int
    http: int
    metrics: int


# Run before tritonserver, in its own process: ask the kernel for SIGTERM when the process that
# started it dies, whatever ends that (SIGKILL, a broken pipe, a crash), then become
# tritonserver. So no tritonserver outlives its launcher holding its ports. (A preexec_fn could
# do the same, but is unsafe in a process with threads.) Linux only: elsewhere it just execs.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)  # the launcher died before the request took hold
os.execv(sys.argv[2], sys.argv[2:])
"""


LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_is_free(port: int, host: str = "0.0.0.0") -> bool:
    """Whether a server could listen on `port` now (connections in TIME_WAIT do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _clean_reason(reason: str) -> str:
    """Triton quotes reasons with escaped newlines and a Python traceback; keep the gist."""
    text = reason.replace("\\n", "\n").replace('\\"', '"').strip()
    first = text.split("\n\nAt:")[0].strip()
    return first or text


class TritonServer:
    """One `tritonserver` process serving a model repository."""

    def __init__(
        self,
        model_repo: str | Path,
        *,
        grpc_port: int = 8001,
        http_port: int = 8000,
        metrics_port: int = 8002,
        startup_timeout_s: float = 180.0,
        log: Callable[[str], None] | None = None,
        extra_args: Sequence[str] = (),
        host: str = LOOPBACK,
    ) -> None:
        self.model_repo = Path(model_repo).resolve()
        # Triton's ports answer anyone past every guard of the sidecar: loopback unless asked.
        self.host = host
        self._requested = TritonPorts(grpc_port, http_port, metrics_port)
        self.startup_timeout_s = startup_timeout_s
        self._log = log
        self._extra_args = list(extra_args)
        self._lines: deque[str] = deque(maxlen=400)
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._workdir: Path | None = None
        self.ports = self._requested

    # -- addresses ---------------------------------------------------------------------------

    @property
    def _reach(self) -> str:
        """Where a local client reaches it: its address, or loopback for a wildcard one."""
        return LOOPBACK if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def grpc_url(self) -> str:
        return f"{self._reach}:{self.ports.grpc}"

    @property
    def http_url(self) -> str:
        return f"http://{self._reach}:{self.ports.http}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._reach}:{self.ports.metrics}/metrics"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def signal(self, signum: int) -> None:
        """Send `signum` to the server and its backend stubs (SIGSTOP / SIGCONT to freeze and
        thaw it, SIGKILL to kill it outright: the chaos runs do)."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signum)

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(list(self._lines)[-lines:])

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> TritonServer:
        """Start the server and block until it and all its models are ready."""
        if not self.model_repo.is_dir():
            raise LauncherError(f"model repository {self.model_repo} is not a directory")
        dist = TritonDistribution.locate()
        self.ports = self._choose_ports()
        self._workdir = Path(tempfile.mkdtemp(prefix="scheduler-svc-triton-"))
        try:
            backends = dist.prepare_backends(self._workdir)
            self._spawn(dist, backends)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _choose_ports(self) -> TritonPorts:
        chosen: dict[str, int] = {}
        for service, port in vars(self._requested).items():
            if port == 0:
                while (candidate := free_port()) in chosen.values():
                    pass
                chosen[service] = candidate
            elif not _port_is_free(port, self.host or "0.0.0.0"):
                raise PortInUseError(service, port)
            else:
                chosen[service] = port
        return TritonPorts(**chosen)

    def _spawn(self, dist: TritonDistribution, backends: Path) -> None:
        shm_prefix = f"ss{os.getpid()}x{next(_instance_counter)}_"
        args = [
            str(dist.binary),
            f"--model-repository={self.model_repo}",
            f"--backend-directory={backends}",
            f"--grpc-port={self.ports.grpc}",
            f"--http-port={self.ports.http}",
            f"--metrics-port={self.ports.metrics}",
            f"--grpc-address={self.host}",
            f"--http-address={self.host}",
            f"--metrics-address={self.host}",
            "--allow-gpu-metrics=false",
            "--strict-readiness=true",
            "--exit-on-error=true",
            f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
            *self._extra_args,
        ]
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dist.environment(),
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read_log, name="triton-log", daemon=True)
        self._reader.start()

    def _read_log(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for raw in self._proc.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self._lines.append(line)
            if self._log is not None:
                self._log(line)

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                if self._reader is not None:
                    self._reader.join(timeout=5)
                raise self._failure()
            if self._ready():
                return
            time.sleep(0.2)
        raise TritonStartTimeoutError(
            f"tritonserver was not ready within {self.startup_timeout_s:.0f} s; last log lines:\n"
            + self.log_tail(20)
        )

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=1) as resp:
                return int(resp.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def _failure(self) -> LauncherError:
        """Turn the log of a server that exited into the most specific error."""
        for line in self._lines:
            if match := _PORT_TAKEN.search(line):
                return PortInUseError(
                    _SERVICE_NAMES.get(match.group(1), match.group(1)), int(match.group(2))
                )
        for line in self._lines:
            if match := _LOAD_FAILED.search(line):
                return ModelLoadError(match.group(1), _clean_reason(match.group(2)))
        code = self._proc.returncode if self._proc is not None else None
        return TritonExitedError(
            f"tritonserver exited with code {code}; last log lines:\n" + self.log_tail(20)
        )

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; safe to call more than once."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=5)
            self._reader = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def wait(self) -> int:
        """Block until the server exits on its own; return its exit code."""
        assert self._proc is not None
        return self._proc.wait()

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_tritons(
    stack: contextlib.ExitStack,
    repo: str | Path,
    count: int,
    log_path: Path,
    *,
    ports: TritonPorts = TritonPorts(0, 0, 0),
    host: str = LOOPBACK,
    announce: Callable[[str], None] | None = None,
) -> list[TritonServer]:
    """Start `count` Tritons on one repository, the first on `ports` and the others on free
    ones, each logging to its own file (`log_path`, then `<stem>-2.log`, ...); `stack` stops
    them and closes the logs. Started one after another: each loads the engine alone."""
    servers: list[TritonServer] = []
    for index in range(count):
        path = log_path if index == 0 else log_path.with_name(f"{log_path.stem}-{index + 1}.log")
        log = stack.enter_context(path.open("w"))
        chosen = ports if index == 0 else TritonPorts(0, 0, 0)
        server = TritonServer(
            repo,
            grpc_port=chosen.grpc,
            http_port=chosen.http,
            metrics_port=chosen.metrics,
            log=functools.partial(_write_line, log),
            host=host,
        )
        if announce is not None:
            announce(f"starting tritonserver on {repo} (log: {path}) ...")
        server.start()
        stack.callback(server.stop)
        servers.append(server)
    return servers


def _write_line(file: TextIO, line: str) -> None:
    print(line, file=file, flush=True)

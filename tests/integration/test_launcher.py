"""The embedded Triton launcher: real tritonserver processes, real ports, real failures."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from scheduler_svc.errors import BackendStubMissingError, ModelLoadError, PortInUseError
from scheduler_svc.tools.triton.distribution import TritonDistribution
from scheduler_svc.tools.triton.launcher import TritonServer, _port_is_free

IDENTITY_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "y" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""
IDENTITY_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "x").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", x)]))
        return out
"""
BROKEN_MODEL = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("weights missing at /nowhere/model.bin")
"""


def make_repo(root: Path, models: dict[str, str]) -> Path:
    for name, source in models.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(IDENTITY_CONFIG)
        (root / name / "1" / "model.py").write_text(textwrap.dedent(source))
    return root


def test_starts_on_free_ports_and_stops_cleanly(tmp_path: Path) -> None:
    server = TritonServer(
        make_repo(tmp_path, {"identity": IDENTITY_MODEL}), grpc_port=0, http_port=0, metrics_port=0
    )
    with server:
        ports = server.ports
        assert len({ports.grpc, ports.http, ports.metrics}) == 3
        assert server.running
        assert not _port_is_free(ports.grpc)
    assert not server.running
    assert all(_port_is_free(p) for p in (ports.grpc, ports.http, ports.metrics))


def listening(port: int) -> set[str]:
    """Where something listens at `port`, from the kernel's socket tables: "loopback", "any"
    (a wildcard address) or the address itself; IPv4-mapped IPv6 read as IPv4."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            raw, _, hex_port = local.partition(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            # The kernel prints each 32-bit word of the address in host (little-endian) order.
            packed = b"".join(bytes.fromhex(raw[i : i + 8])[::-1] for i in range(0, len(raw), 8))
            address = ipaddress.ip_address(packed)
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
                address = address.ipv4_mapped
            if address.is_loopback:
                found.add("loopback")
            elif address.is_unspecified:
                found.add("any")
            else:
                found.add(str(address))
    return found


@pytest.mark.parametrize(("host", "expected"), [(None, {"loopback"}), ("0.0.0.0", {"any"})])
def test_tritons_ports_listen_on_loopback_unless_asked(
    tmp_path: Path, host: str | None, expected: set[str]
) -> None:
    """Triton's own ports answer anyone, past every guard of the sidecar: loopback only by
    default (issue 29: `make run` had them on every interface)."""
    kwargs = {} if host is None else {"host": host}
    server = TritonServer(
        make_repo(tmp_path, {"identity": IDENTITY_MODEL}),
        grpc_port=0,
        http_port=0,
        metrics_port=0,
        **kwargs,
    )
    with server:
        for port in (server.ports.grpc, server.ports.http, server.ports.metrics):
            assert listening(port) == expected, port
        assert server.grpc_url.startswith("127.0.0.1:")


def test_a_taken_port_is_named(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = TritonServer(
            make_repo(tmp_path, {"identity": IDENTITY_MODEL}),
            grpc_port=port,
            http_port=0,
            metrics_port=0,
        )
        with pytest.raises(PortInUseError, match=f"grpc port {port} is already in use"):
            server.start()
    assert not server.running


def test_a_model_that_fails_to_load_is_named_with_tritons_reason(tmp_path: Path) -> None:
    repo = make_repo(tmp_path, {"identity": IDENTITY_MODEL, "broken": BROKEN_MODEL})
    server = TritonServer(repo, grpc_port=0, http_port=0, metrics_port=0)
    with pytest.raises(ModelLoadError) as caught:
        server.start()
    assert caught.value.model == "broken"
    assert "weights missing at /nowhere/model.bin" in caught.value.reason
    assert "Traceback" not in str(caught.value)
    assert not server.running


def test_a_missing_backend_stub_is_explained(tmp_path: Path) -> None:
    empty = TritonDistribution(tmp_path / "tritonserver")
    with pytest.raises(BackendStubMissingError, match="no Python backend stub for Python"):
        empty.prepare_backends(tmp_path / "work")


def test_cli_runs_in_the_foreground_and_stops_on_sigint(tmp_path: Path) -> None:
    repo = make_repo(tmp_path, {"identity": IDENTITY_MODEL})
    cli = [
        sys.executable,
        "-m",
        "scheduler_svc.cli",
        "triton",
        "--model-repo",
        str(repo),
        "--quiet",
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--metrics-port",
        "0",
    ]
    proc = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("tritonserver ready"), first + proc.stderr.read()  # type: ignore[union-attr]
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cli_errors_are_one_line_not_a_traceback(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "scheduler_svc.cli",
            "triton",
            "--model-repo",
            str(tmp_path / "nope"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: model repository") and "Traceback" not in done.stderr


ORPHAN_PARENT = """
import sys, time
from scheduler_svc.tools.triton.launcher import TritonServer
server = TritonServer(sys.argv[1], grpc_port=0, http_port=0, metrics_port=0).start()
print(server._proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) holds no ports: count it as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_tritonserver_dies_with_its_launcher_even_on_sigkill(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", {"identity": IDENTITY_MODEL})
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_PARENT, str(repo)], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    triton_pid = int(parent.stdout.readline())
    assert _alive(triton_pid)
    parent.kill()  # SIGKILL: no cleanup code of the launcher runs
    parent.wait()
    deadline = time.monotonic() + 60
    while _alive(triton_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(triton_pid), "tritonserver outlived its launcher"

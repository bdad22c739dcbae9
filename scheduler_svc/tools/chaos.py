"""`scheduler-svc chaos`: reliability figures from a live sidecar in front of a real Triton.

Phases, each against the real stack (the bundled Triton on the CPU reference engine, the sidecar
as a subprocess):
- fuzz:    hypothesis-generated calls on both gRPC fronts (scheduler.v1, KServe v2 unary and
           streaming, metadata, Admin without the role, UpdatePolicy dry runs with arbitrary
           JSON), well-formed and mutated, `cases` of them, `concurrency` at once;
- http:    the same for the HTTP fronts (OpenAI and Triton's generate extension, metadata,
           health, unknown paths and methods), `http_cases` of them (chaos_wire.py);
- tls:     a sidecar serving TLS takes handshakes on its gRPC and HTTPS ports, well-formed and
           not (mutated ClientHellos, random bytes, plaintext, abandoned, unknown client CAs),
           `tls_cases` of them (chaos_wire.py);
- freeze:  streams running while Triton is frozen (SIGSTOP) past the stall timeout, then thawed;
- slow:    streams running while Triton is stopped and continued every 100 ms;
- kill:    streams running when Triton is killed (SIGKILL); Triton is started again;
- sigterm: a sidecar that runs one request at a time, requests queued, then SIGTERM.

For every phase it counts the calls sent, the statuses seen, calls that never ended (no status
within `BOUND_S`, longer than the sidecar's own maximum request duration), INTERNAL or UNKNOWN
answers (and, on the HTTP and TLS phases, `internal error` lines in the sidecar's log), and
accepted requests lost (admitted by the sidecar with no recorded end: its own
counters, read over Admin or from its last log line). Targets: 0, 0, 0.

Over 500 lines: one function a phase, and the subprocess they share; the wire-level fuzzing
already lives apart (chaos_wire.py), and the phases read best side by side.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as kserve_pb

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.testing.certs import Authority
from scheduler_svc.testing.process import ready_ports, serve_command
from scheduler_svc.tools.chaos_wire import (
    TlsCase,
    client_hello,
    http_case,
    send_http,
    send_tls,
    tls_case,
)
from scheduler_svc.tools.triton.launcher import TritonServer

MAX_REQUEST_S = 60.0  # the chaos sidecar's server.max_request_s
STALL_S = 3.0  # ... and its triton.stall_timeout_s
BOUND_S = MAX_REQUEST_S + 30  # a call without a status by then never ended
BAD = ("INTERNAL", "UNKNOWN", "UNTRUSTED_ACCEPTED")

SCHEDULER = "/scheduler.v1.Scheduler/"
KSERVE = "/inference.GRPCInferenceService/"


@dataclass
class ChaosPhase:
    name: str
    sent: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    never_ended: int = 0
    accepted: int = 0
    ended: int = 0
    seconds: float = 0.0
    bad_examples: list[str] = field(default_factory=list)
    examples: dict[str, str] = field(default_factory=dict)  # the first details of each status

    @property
    def internal_or_unknown(self) -> int:
        return sum(self.statuses[code] for code in BAD)

    @property
    def lost(self) -> int:
        return max(0, self.accepted - self.ended)

    def record(self, code: str, details: str, elapsed_s: float, case: Case | None = None) -> None:
        if code == "DEADLINE_EXCEEDED" and elapsed_s >= BOUND_S - 1:
            self.never_ended += 1
            code = "never_ended"
            if case is not None and len(self.bad_examples) < 5:
                self.bad_examples.append(f"never ended: {case.method} {case.messages!r}"[:400])
        self.statuses[code] += 1
        self.examples.setdefault(code, details[:160])
        if code in BAD and len(self.bad_examples) < 5:
            self.bad_examples.append(details[:200])

    def row(self) -> dict[str, Any]:
        return {
            "phase": self.name,
            "sent": self.sent,
            "statuses": dict(sorted(self.statuses.items())),
            "never_ended": self.never_ended,
            "internal_or_unknown": self.internal_or_unknown,
            "accepted": self.accepted,
            "lost": self.lost,
            "seconds": round(self.seconds, 1),
            "bad_examples": self.bad_examples,
            "examples": self.examples,
        }


# -- the sidecar under test ------------------------------------------------------------------


class SidecarUnderTest:
    """`scheduler-svc serve` as a subprocess; its JSON log lines are kept."""

    def __init__(
        self,
        triton_url: str,
        workdir: Path,
        config: dict[str, Any],
        channel_credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / f"sidecar-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(config))
        command = serve_command(triton_url, path)
        # gRPC core's own INFO lines (a refused handshake each) would drown the run's output.
        env = {**os.environ, "GRPC_VERBOSITY": "ERROR"}
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
        self.events: list[dict[str, Any]] = []
        ready = threading.Event()
        self.port = self.admin_port = self.http_port = 0

        log_file = (workdir / "sidecar.log").open("a")

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                log_file.write(line)
                log_file.flush()
                with contextlib.suppress(json.JSONDecodeError):
                    event = json.loads(line)
                    if isinstance(event, dict):
                        self.events.append(event)
                        if (ports := ready_ports(event)) is not None:
                            self.port, self.admin_port = ports.port, ports.admin_port or 0
                            self.http_port = ports.http_port or 0
                            ready.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not ready.wait(120):
            self.proc.kill()
            raise RuntimeError("the sidecar did not start")
        if channel_credentials is None:
            self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        else:
            self.channel = grpc.secure_channel(
                f"127.0.0.1:{self.port}",
                channel_credentials,
                (("grpc.ssl_target_name_override", "localhost"),),
            )
        admin = grpc.insecure_channel(f"127.0.0.1:{self.admin_port}")
        self.admin = pb_grpc.AdminStub(admin)  # type: ignore[no-untyped-call]

    def internal_errors(self) -> int:
        """`internal error` lines the sidecar has logged so far."""
        return sum(1 for e in list(self.events) if e.get("event") == "internal error")

    def stats(self) -> pb.Stats:
        stats: pb.Stats = self.admin.GetStats(pb.GetStatsRequest(), timeout=10)
        return stats

    def wait_idle(self, timeout_s: float = 120) -> pb.Stats:
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if (stats.queued == 0 and stats.in_flight == 0) or time.monotonic() > deadline:
                return stats
            time.sleep(0.2)

    def wait_serving(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                if self.stats().backend_ready:
                    return
            time.sleep(0.2)
        raise RuntimeError("the sidecar never saw Triton ready")

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(60)
        self._reader.join(10)
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def sidecar_config(**server: Any) -> dict[str, Any]:
    return {
        "server": {
            "max_request_s": MAX_REQUEST_S,
            "write_timeout_s": 10.0,
            "http_port": 0,
            **server,
        },
        "triton": {"stall_timeout_s": STALL_S, "health_interval_s": 0.2},
        "queue": {"max_queued": 128},
    }


def counted(phase: ChaosPhase, sidecar: SidecarUnderTest, before: pb.Stats) -> None:
    """Accepted and ended requests of the phase, from the sidecar's own counters."""
    after = sidecar.wait_idle()
    phase.accepted = after.accepted_total - before.accepted_total
    phase.ended = sum(after.finished_total.values()) - sum(before.finished_total.values())


# -- one call --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    method: str  # full method name
    kind: str  # unary, stream (server streaming), bidi
    messages: tuple[bytes, ...]
    admin: bool = False  # sent to the admin listener


def call(channel: grpc.Channel, admin: grpc.Channel, case: Case) -> tuple[str, str, float]:
    """Send one case; (status name, details, seconds)."""
    target: Any = admin if case.admin else channel  # raw bytes in: the stubs cannot type it
    started = time.monotonic()
    try:
        if case.kind == "unary":
            target.unary_unary(case.method)(case.messages[0], timeout=BOUND_S)
        elif case.kind == "stream":
            for _ in target.unary_stream(case.method)(case.messages[0], timeout=BOUND_S):
                pass
        else:
            answers = target.stream_stream(
                case.method, response_deserializer=kserve_pb.ModelStreamInferResponse.FromString
            )(iter(case.messages), timeout=BOUND_S)
            for answer in answers:
                if answer.error_message.startswith(("[INTERNAL]", "[UNKNOWN]")):
                    return "INTERNAL", answer.error_message, time.monotonic() - started
        return "OK", "", time.monotonic() - started
    except grpc.RpcError as exc:
        code = exc.code()
        details = exc.details() or ""
        return code.name, details, time.monotonic() - started


# -- what hypothesis draws -------------------------------------------------------------------

_TEXT = st.text(max_size=40) | st.sampled_from(["hello", "Tell me a story", "你好", " "])
_INT32 = st.integers(-(2**31), 2**31 - 1)
_SMALL = st.integers(-3, 6) | _INT32
_FLOAT = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def generate_request(draw: st.DrawFn) -> bytes:
    """Half the requests are well-formed throughout (they reach the engine), half take any
    value in any field (they probe every bound)."""
    sane = draw(st.booleans())

    def pick(good: st.SearchStrategy[Any], wild: st.SearchStrategy[Any]) -> Any:
        return draw(good if sane else good | wild)

    request = pb.GenerateRequest(
        request_id=draw(st.just("") | _TEXT),
        max_tokens=pick(st.integers(1, 4), st.integers(0, 2**32 - 1)),
        priority=pick(st.integers(0, 3), _INT32),
        tenant=pick(st.sampled_from(["", "a", "b"]), _TEXT),
        stop=pick(st.just([]), st.lists(_TEXT, max_size=3)),
    )
    if draw(st.booleans()):
        request.prompt = pick(_TEXT.filter(str.strip), st.text(min_size=200, max_size=3000))
    else:
        ids = st.integers(3, 1000) if sane else st.integers(-5, 200_000)
        request.token_ids.ids.extend(draw(st.lists(ids, min_size=1 if sane else 0, max_size=20)))
    sampling = request.sampling
    sampling.temperature = pick(st.just(0.0) | st.floats(0, 2), _FLOAT)
    sampling.top_p = pick(st.floats(0, 1, width=32), _FLOAT)
    sampling.top_k = pick(st.integers(0, 50), _SMALL)
    sampling.seed = draw(st.integers(0, 2**64 - 1))
    return request.SerializeToString()


_DATATYPES = ["BYTES", "INT32", "FP32", "UINT64", "BOOL", "INT64", "FP16", ""]
_INPUTS = ["text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "random_seed"]


def _bytes_tensor(texts: list[bytes]) -> bytes:
    return b"".join(len(t).to_bytes(4, "little") + t for t in texts)


@st.composite
def infer_request(draw: st.DrawFn) -> bytes:
    request = kserve_pb.ModelInferRequest(
        model_name=draw(st.just("ensemble") | _TEXT), id=draw(st.just("") | _TEXT)
    )
    well_formed = draw(st.booleans())
    names = ["text_input", "max_tokens"] if well_formed else []
    names += draw(st.lists(st.sampled_from([*_INPUTS, "colour"]), max_size=4, unique=True))
    for name in dict.fromkeys(names):
        tensor = request.inputs.add(name=name)
        if well_formed and name == "text_input":
            tensor.datatype = "BYTES"
            tensor.shape.extend([1, 1])
            text = draw(_TEXT).encode("utf-8", "surrogatepass")
            request.raw_input_contents.append(_bytes_tensor([text]))
        elif well_formed and name == "max_tokens":
            tensor.datatype = "INT32"
            tensor.shape.extend([1, 1])
            value = draw(st.integers(1, 4) | _SMALL)
            request.raw_input_contents.append(np.asarray([value], "<i4").tobytes())
        else:
            tensor.datatype = draw(st.sampled_from(_DATATYPES))
            tensor.shape.extend(draw(st.lists(st.integers(-2, 3), max_size=3)))
            request.raw_input_contents.append(draw(st.binary(max_size=24)))
    for key in draw(st.lists(st.sampled_from(["priority", "timeout", "x"]), max_size=2)):
        param = request.parameters[key]
        if draw(st.booleans()):
            param.int64_param = draw(st.integers(-(2**63), 2**63 - 1))
        else:
            param.string_param = draw(_TEXT)
    return bytes(request.SerializeToString())


def _mutated(raw: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """A message, or the same with a few bytes changed, cut short, or random bytes."""

    @st.composite
    def mutate(draw: st.DrawFn) -> bytes:
        data = bytearray(draw(raw))
        how = draw(st.sampled_from(["keep"] * 5 + ["flip", "cut", "random"]))
        if how == "flip" and data:
            for _ in range(draw(st.integers(1, 4))):
                data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        elif how == "cut" and data:
            del data[draw(st.integers(0, len(data) - 1)) :]
        elif how == "random":
            return bytes(draw(st.binary(max_size=64)))
        return bytes(data)

    return mutate()


def _json_containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.sampled_from(["lanes", "kv", "name", "share", "max_in_flight", "retry_after_s"])
    return st.lists(children, max_size=3) | st.dictionaries(
        keys | st.text(max_size=8), children, max_size=3
    )


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    _json_containers,
    max_leaves=12,
)


@st.composite
def update_policy(draw: st.DrawFn) -> bytes:
    value = draw(_JSON)
    text = json.dumps(value, allow_nan=True) if draw(st.booleans()) else draw(st.text(max_size=30))
    return pb.UpdatePolicyRequest(policy_json=text, dry_run=True).SerializeToString()


def cases() -> st.SearchStrategy[Case]:
    gen = _mutated(generate_request())
    infer = _mutated(infer_request())
    return st.one_of(
        gen.map(lambda m: Case(SCHEDULER + "Generate", "unary", (m,))),
        gen.map(lambda m: Case(SCHEDULER + "GenerateStream", "stream", (m,))),
        infer.map(lambda m: Case(KSERVE + "ModelInfer", "unary", (m,))),
        st.lists(infer, min_size=1, max_size=3).map(
            lambda ms: Case(KSERVE + "ModelStreamInfer", "bidi", tuple(ms))
        ),
        st.sampled_from(["ModelMetadata", "ModelConfig", "ModelReady"]).flatmap(
            lambda m: _mutated(
                st.builds(
                    lambda name: kserve_pb.ModelMetadataRequest(name=name).SerializeToString(),
                    st.just("ensemble") | _TEXT,
                )
            ).map(lambda raw: Case(KSERVE + m, "unary", (raw,)))
        ),
        st.just(Case("/scheduler.v1.Admin/Drain", "unary", (b"",))),  # no role: refused
        update_policy().map(
            lambda m: Case("/scheduler.v1.Admin/UpdatePolicy", "unary", (m,), True)
        ),
    )


# -- the phases ------------------------------------------------------------------------------


def _fuzz(
    phase: ChaosPhase,
    strategy: st.SearchStrategy[Any],
    send_one: Callable[[Any], tuple[str, str, float]],
    count: int,
    concurrency: int,
    run_seed: int,
) -> None:
    """Send `count` drawn cases, `concurrency` in flight at once; record each in `phase`."""
    pool = ThreadPoolExecutor(concurrency)
    room = threading.Semaphore(concurrency)  # calls in flight; no barrier between batches
    lock = threading.Lock()
    batch = 32

    def one(case: Any) -> None:
        try:
            code, details, elapsed = send_one(case)
            with lock:
                phase.sent += 1
                phase.record(code, details, elapsed, case)
        finally:
            room.release()

    @seed(run_seed)
    @settings(
        max_examples=max(1, count // batch),
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=False,
    )
    @given(st.lists(strategy, min_size=batch, max_size=batch))
    def send(drawn: list[Any]) -> None:
        for case in drawn:
            room.acquire()
            pool.submit(one, case)

    started = time.monotonic()
    send()
    pool.shutdown(wait=True)
    phase.seconds = time.monotonic() - started


def fuzz(sidecar: SidecarUnderTest, count: int, concurrency: int, run_seed: int) -> ChaosPhase:
    phase = ChaosPhase("fuzz")
    before = sidecar.stats()
    admin = grpc.insecure_channel(f"127.0.0.1:{sidecar.admin_port}")
    _fuzz(
        phase,
        cases(),
        lambda case: call(sidecar.channel, admin, case),
        count,
        concurrency,
        run_seed,
    )
    counted(phase, sidecar, before)
    return phase


def _logged_internal(phase: ChaosPhase, sidecar: SidecarUnderTest, before: int) -> None:
    """Internal errors the sidecar logged during the phase, whatever the client saw."""
    logged = sidecar.internal_errors() - before
    if logged:
        phase.statuses["INTERNAL"] += logged
        phase.bad_examples.append(f"{logged} 'internal error' lines in the sidecar's log")


def fuzz_http(sidecar: SidecarUnderTest, count: int, concurrency: int, run_seed: int) -> ChaosPhase:
    phase = ChaosPhase("http")
    before, errors = sidecar.stats(), sidecar.internal_errors()
    _fuzz(
        phase,
        http_case(),
        lambda case: send_http("127.0.0.1", sidecar.http_port, case, BOUND_S),
        count,
        concurrency,
        run_seed,
    )
    counted(phase, sidecar, before)
    _logged_internal(phase, sidecar, errors)
    return phase


def fuzz_tls(
    triton_url: str, workdir: Path, count: int, concurrency: int, run_seed: int
) -> ChaosPhase:
    """A sidecar serving TLS with optional client certificates takes handshakes of every kind
    on its gRPC and HTTPS ports; well-formed ones make a request."""
    phase = ChaosPhase("tls")
    folder = workdir / "tls"
    folder.mkdir(parents=True, exist_ok=True)
    ca = Authority(folder, "chaos-ca")
    server = ca.issue("sidecar", ["localhost"])
    client = ca.issue("client.chaos", ["client.chaos"])
    (folder / "stranger").mkdir(exist_ok=True)
    stranger = Authority(folder / "stranger", "stranger-ca").issue("stranger", ["stranger"])
    tls = {
        "cert_file": str(server.cert),
        "key_file": str(server.key),
        "client_ca_file": str(ca.pair.cert),
    }
    roots = ca.pair.cert.read_bytes()
    sidecar = SidecarUnderTest(
        triton_url,
        workdir,
        sidecar_config(tls=tls),
        grpc.ssl_channel_credentials(roots),
    )
    contexts: dict[str, ssl.SSLContext] = {}
    for name, pair in (("none", None), ("trusted", client), ("untrusted", stranger)):
        context = ssl.create_default_context(cafile=str(ca.pair.cert))
        context.check_hostname = False  # the unknown server name is sent in SNI only
        if pair is not None:
            context.load_cert_chain(str(pair.cert), str(pair.key))
        contexts[name] = context
    generate = pb.GenerateRequest(prompt="hello", max_tokens=2).SerializeToString()

    def grpc_call(client_cert: str) -> tuple[str, str, float]:
        pair = {"trusted": client, "untrusted": stranger}.get(client_cert)
        credentials = grpc.ssl_channel_credentials(
            roots,
            pair.key.read_bytes() if pair else None,
            pair.cert.read_bytes() if pair else None,
        )
        options = (("grpc.ssl_target_name_override", "localhost"),)
        with grpc.secure_channel(f"127.0.0.1:{sidecar.port}", credentials, options) as channel:
            case = Case(SCHEDULER + "Generate", "unary", (generate,))
            return call(channel, channel, case)

    try:
        sidecar.wait_serving()
        before, errors = sidecar.stats(), sidecar.internal_errors()
        ports = {"grpc": sidecar.port, "https": sidecar.http_port}
        _fuzz(
            phase,
            tls_case(client_hello()),
            lambda case: send_tls(case, "127.0.0.1", ports, contexts, grpc_call, BOUND_S),
            count,
            concurrency,
            run_seed,
        )
        # Still serving both ports after all of it.
        for case_port in ("grpc", "https"):
            code, details, elapsed = send_tls(
                TlsCase("handshake", case_port), "127.0.0.1", ports, contexts, grpc_call, BOUND_S
            )
            phase.sent += 1
            phase.record("OK" if code == "OK" else "UNKNOWN", details, elapsed)
        counted(phase, sidecar, before)
        _logged_internal(phase, sidecar, errors)
    finally:
        sidecar.stop()
    return phase


def _streams(
    sidecar: SidecarUnderTest, count: int, max_tokens: int, phase: ChaosPhase
) -> threading.Thread:
    """Start `count` streaming generations in the background; their statuses go to `phase`."""
    request = pb.GenerateRequest(prompt="Tell me a long story", max_tokens=max_tokens)
    raw = request.SerializeToString()
    case = Case(SCHEDULER + "GenerateStream", "stream", (raw,))

    def run() -> None:
        with ThreadPoolExecutor(count) as pool:
            for code, details, elapsed in pool.map(
                lambda _: call(sidecar.channel, sidecar.channel, case), range(count)
            ):
                phase.record(code, details, elapsed)

    phase.sent += count
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _until_running(sidecar: SidecarUnderTest, count: int) -> None:
    deadline = time.monotonic() + 60
    while sidecar.stats().in_flight < count and time.monotonic() < deadline:
        time.sleep(0.05)


def freeze(sidecar: SidecarUnderTest, triton: TritonServer, streams: int) -> ChaosPhase:
    phase = ChaosPhase("freeze")
    before = sidecar.stats()
    started = time.monotonic()
    thread = _streams(sidecar, streams, 800, phase)
    _until_running(sidecar, streams)
    triton.signal(signal.SIGSTOP)
    try:
        thread.join(BOUND_S + 10)
    finally:
        triton.signal(signal.SIGCONT)
    phase.seconds = time.monotonic() - started
    counted(phase, sidecar, before)
    return phase


def slow(sidecar: SidecarUnderTest, triton: TritonServer, streams: int) -> ChaosPhase:
    phase = ChaosPhase("slow")
    before = sidecar.stats()
    started = time.monotonic()
    thread = _streams(sidecar, streams, 64, phase)
    try:
        while thread.is_alive():
            triton.signal(signal.SIGSTOP)
            time.sleep(0.1)  # Triton frozen this long, then let run as long: half speed
            triton.signal(signal.SIGCONT)
            time.sleep(0.1)
    finally:
        triton.signal(signal.SIGCONT)
    phase.seconds = time.monotonic() - started
    counted(phase, sidecar, before)
    return phase


def kill(
    sidecar: SidecarUnderTest,
    triton: TritonServer,
    streams: int,
    restart: Callable[[], TritonServer],
) -> tuple[ChaosPhase, TritonServer]:
    phase = ChaosPhase("kill")
    before = sidecar.stats()
    started = time.monotonic()
    thread = _streams(sidecar, streams, 800, phase)
    _until_running(sidecar, streams)
    triton.signal(signal.SIGKILL)
    thread.join(BOUND_S + 10)
    triton.stop()
    fresh = restart()
    sidecar.wait_serving()
    phase.seconds = time.monotonic() - started
    counted(phase, sidecar, before)
    return phase, fresh


def sigterm(triton_url: str, workdir: Path, queued: int) -> ChaosPhase:
    """A sidecar that runs one request at a time, `queued` more waiting, then SIGTERM."""
    phase = ChaosPhase("sigterm")
    config = sidecar_config(drain_grace_s=3.0)
    config["queue"] = {"scheduler": "fifo", "max_in_flight": 1, "max_queued": queued + 1}
    sidecar = SidecarUnderTest(triton_url, workdir, config)
    started = time.monotonic()
    try:
        sidecar.wait_serving()
        thread = _streams(sidecar, queued + 1, 800, phase)
        deadline = time.monotonic() + 60
        while sidecar.stats().queued < queued and time.monotonic() < deadline:
            time.sleep(0.05)
        sidecar.terminate()
        thread.join(BOUND_S + 10)
    finally:
        sidecar.stop()
    stopped = [e for e in sidecar.events if e.get("event") == "stopped"]
    if stopped:
        phase.accepted = int(stopped[-1].get("accepted", 0))
        phase.ended = sum(stopped[-1].get("finished", {}).values())
    phase.seconds = time.monotonic() - started
    return phase


# -- the run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    cases: int = 100_000
    http_cases: int = 50_000
    tls_cases: int = 5_000
    concurrency: int = 32
    streams: int = 4
    seed: int = 0
    phases: tuple[str, ...] = ("fuzz", "http", "tls", "freeze", "slow", "kill", "sigterm")


def run(
    plan: Plan, model_repo: Path, workdir: Path, say: Callable[[str], None] = print
) -> list[ChaosPhase]:
    workdir.mkdir(parents=True, exist_ok=True)
    log_file = (workdir / "triton.log").open("w")

    def triton_at(grpc_port: int, http_port: int, metrics_port: int) -> TritonServer:
        return TritonServer(
            model_repo,
            grpc_port=grpc_port,
            http_port=http_port,
            metrics_port=metrics_port,
            log=lambda line: print(line, file=log_file, flush=True),
        ).start()

    triton = triton_at(0, 0, 0)
    ports = (triton.ports.grpc, triton.ports.http, triton.ports.metrics)
    results: list[ChaosPhase] = []
    sidecar = SidecarUnderTest(triton.grpc_url, workdir, sidecar_config())
    try:
        sidecar.wait_serving()
        for name in plan.phases:
            say(f"phase {name} ...")
            if name == "fuzz":
                results.append(fuzz(sidecar, plan.cases, plan.concurrency, plan.seed))
            elif name == "http":
                results.append(fuzz_http(sidecar, plan.http_cases, plan.concurrency, plan.seed))
            elif name == "tls":
                results.append(
                    fuzz_tls(triton.grpc_url, workdir, plan.tls_cases, plan.concurrency, plan.seed)
                )
            elif name == "freeze":
                results.append(freeze(sidecar, triton, plan.streams))
            elif name == "slow":
                results.append(slow(sidecar, triton, plan.streams))
            elif name == "kill":
                phase, triton = kill(sidecar, triton, plan.streams, lambda: triton_at(*ports))
                results.append(phase)
            elif name == "sigterm":
                results.append(sigterm(triton.grpc_url, workdir, plan.streams * 2))
            say(f"  {json.dumps(results[-1].row())}")
    finally:
        sidecar.stop()
        triton.signal(signal.SIGCONT)
        triton.stop()
    return results


def table(phases: list[ChaosPhase]) -> str:
    lines = [
        "| phase | calls sent | statuses seen | never ended | INTERNAL / UNKNOWN "
        "| accepted | lost | s |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(p.statuses.items()))
        lines.append(
            f"| {p.name} | {p.sent} | {statuses} | {p.never_ended} | {p.internal_or_unknown} "
            f"| {p.accepted} | {p.lost} | {p.seconds:.0f} |"
        )
    total = ChaosPhase("all")
    for p in phases:
        total.sent += p.sent
        total.never_ended += p.never_ended
        total.statuses.update(p.statuses)
        total.accepted += p.accepted
        total.ended += p.ended
    lines.append(
        f"| **all** | {total.sent} | | {total.never_ended} | {total.internal_or_unknown} "
        f"| {total.accepted} | {sum(p.lost for p in phases)} | |"
    )
    return "\n".join(lines)


def passed(phases: list[ChaosPhase]) -> bool:
    return all(p.never_ended == 0 and p.internal_or_unknown == 0 and p.lost == 0 for p in phases)

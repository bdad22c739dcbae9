"""The chaos run's HTTP and TLS cases (`scheduler-svc chaos`, phases `http` and `tls`).

- http: hypothesis draws calls on the HTTP fronts gateways point at: OpenAI `/v1/completions`,
  `/v1/chat/completions` and `/v1/models`, Triton's `generate` / `generate_stream` and its
  metadata and health paths, and paths nobody serves, with any method. Half the bodies are
  well-formed (they reach the engine, streamed or not), the others take any JSON value in any
  field or are not JSON at all; a quarter are then mutated (bytes flipped, cut short, or random).
  Content types and Authorization headers vary too.
- tls: a sidecar serving TLS (optional client certificates) takes TLS handshakes on its gRPC and
  HTTPS ports: well-formed ones that then make a request (with and without a client
  certificate, with a certificate from an unknown CA, with an unknown server name), a real
  ClientHello mutated or cut short, random bytes, plaintext HTTP/1.1 and HTTP/2 prefaces, and
  handshakes abandoned half way.

Every answer is named as a gRPC status where HTTP maps to one (400 INVALID_ARGUMENT, 429
RESOURCE_EXHAUSTED, ...); a 5xx other than 501/503/504, an `internal error` inside a stream,
or a connection that ends with no answer is INTERNAL or UNKNOWN, and a request answered over a
client certificate from an unknown CA is UNTRUSTED_ACCEPTED: the failures the run counts.
Handshakes the sidecar refuses end as TLS_REFUSED or CLOSED; one the client abandons after
`HELD_S` without an answer from a server that waits for the rest is HELD (by design: the
server's own handshake timeout ends it).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from scheduler_svc.errors import HTTP_STATUS

HELD_S = 2.0  # a TLS case's client waits this long for the server to answer or close
_STATUS_NAMES = {200: "OK"}
for _code, _status in HTTP_STATUS.items():  # the first code of a status names it (400: INVALID_..)
    _STATUS_NAMES.setdefault(_status, _code.name)
_TEXT = st.text(max_size=40) | st.sampled_from(["hello", "Tell me a story", "你好", " "])
_ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=10,
)


@dataclass(frozen=True)
class HttpCase:
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def __str__(self) -> str:
        return f"{self.method} {self.path} {self.body[:200]!r}"


def status_name(status: int) -> str:
    if status in _STATUS_NAMES:
        return _STATUS_NAMES[status]
    return "INTERNAL" if status >= 500 else f"HTTP_{status}"


def _sampling(draw: st.DrawFn, sane: bool) -> dict[str, Any]:
    """OpenAI-style sampling fields, sane or any value."""
    fields: dict[str, Any] = {}
    for name, good in (
        ("temperature", st.floats(0, 2)),
        ("top_p", st.floats(0, 1)),
        ("top_k", st.integers(0, 50)),
        ("seed", st.integers(0, 2**63)),
        ("presence_penalty", st.floats(-2, 2)),
        ("stop", st.lists(_TEXT.filter(bool), max_size=2)),
    ):
        if draw(st.booleans()):
            fields[name] = draw(good if sane else good | _ANY)
    return fields


@st.composite
def _openai_body(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    sane = draw(st.booleans())
    body: dict[str, Any] = {"model": draw(st.just("ensemble") if sane else _TEXT | _ANY)}
    if chat:
        message = st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": _TEXT}
        )
        body["messages"] = draw(st.lists(message, min_size=1, max_size=3) if sane else _ANY)
    else:
        body["prompt"] = draw(_TEXT.filter(str.strip) if sane else _TEXT | _ANY)
    body["max_tokens"] = draw(st.integers(1, 4) if sane else st.integers(1, 4) | _ANY)
    body["stream"] = draw(st.booleans())
    body.update(_sampling(draw, sane))
    if not sane and draw(st.booleans()):
        body[draw(st.text(max_size=8))] = draw(_ANY)
    return body


@st.composite
def _generate_body(draw: st.DrawFn) -> dict[str, Any]:
    sane = draw(st.booleans())
    body: dict[str, Any] = {
        "text_input": draw(_TEXT.filter(str.strip) if sane else _TEXT | _ANY),
        "max_tokens": draw(st.integers(1, 4) if sane else st.integers(1, 4) | _ANY),
    }
    for name, good in (
        ("temperature", st.floats(0, 2)),
        ("top_k", st.integers(0, 50)),
        ("random_seed", st.integers(0, 2**63)),
        ("stop_words", st.lists(_TEXT.filter(bool), max_size=2)),
        ("parameters", st.fixed_dictionaries({"priority": st.integers(0, 3)})),
    ):
        if draw(st.booleans()):
            body[name] = draw(good if sane else good | _ANY)
    return body


def _mutated(raw: bytes, draw: st.DrawFn) -> bytes:
    data = bytearray(raw)
    how = draw(st.sampled_from(["keep"] * 6 + ["flip", "cut", "random"]))
    if how == "flip" and data:
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    elif how == "cut" and data:
        del data[draw(st.integers(0, len(data) - 1)) :]
    elif how == "random":
        return bytes(draw(st.binary(max_size=64)))
    return bytes(data)


@st.composite
def http_case(draw: st.DrawFn) -> HttpCase:
    kind = draw(
        st.sampled_from(
            ["completions", "chat", "generate", "generate_stream", "get", "get", "nowhere"]
        )
    )
    method, body_value, path = "POST", None, ""
    if kind == "completions":
        path, body_value = "/v1/completions", draw(_openai_body(chat=False))
    elif kind == "chat":
        path, body_value = "/v1/chat/completions", draw(_openai_body(chat=True))
    elif kind in ("generate", "generate_stream"):
        model = draw(st.just("ensemble") | st.sampled_from(["tensorrt_llm", "nope"]))
        path, body_value = f"/v2/models/{model}/{kind}", draw(_generate_body())
    elif kind == "get":
        method = "GET"
        path = draw(
            st.sampled_from(
                [
                    "/v1/models",
                    "/v1/models/ensemble",
                    "/v1/models/nope",
                    "/v2",
                    "/v2/health/live",
                    "/v2/health/ready",
                    "/v2/models/ensemble",
                    "/v2/models/ensemble/ready",
                ]
            )
        )
    else:
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]))
        path = "/" + "/".join(draw(st.lists(st.sampled_from(["v1", "v2", "x", "..", "%00"]))))
    if method != "GET" and draw(st.integers(0, 9)) == 0:
        method = draw(st.sampled_from(["GET", "PUT", "DELETE"]))  # the wrong method
    body = b""
    if body_value is not None:
        if draw(st.integers(0, 9)) == 0:
            body = draw(st.binary(max_size=80))  # not JSON at all
        else:
            body = _mutated(json.dumps(body_value, allow_nan=True).encode(), draw)
    headers = [("Content-Type", draw(st.sampled_from(["application/json"] * 8 + ["text/plain"])))]
    auth = draw(st.sampled_from([None] * 6 + ["Bearer nobody-knows-this", "Basic eDp5", "x"]))
    if auth is not None:
        headers.append(("Authorization", auth))
    return HttpCase(method, path, tuple(headers), body)


def send_http(
    host: str, port: int, case: HttpCase, bound_s: float, context: ssl.SSLContext | None = None
) -> tuple[str, str, float]:
    """Send one case on its own connection; (status name, details, seconds)."""
    started = time.monotonic()
    connection: http.client.HTTPConnection
    if context is None:
        connection = http.client.HTTPConnection(host, port, timeout=bound_s)
    else:
        connection = http.client.HTTPSConnection(host, port, timeout=bound_s, context=context)
    try:
        connection.request(case.method, case.path, case.body, dict(case.headers))
        answer = connection.getresponse()
        data = answer.read()
    except TimeoutError:
        return "DEADLINE_EXCEEDED", f"no answer within {bound_s} s", time.monotonic() - started
    except (OSError, http.client.HTTPException) as exc:
        return "UNKNOWN", f"no answer: {exc!r}", time.monotonic() - started
    finally:
        connection.close()
    elapsed = time.monotonic() - started
    code = status_name(answer.status)
    streamed = answer.getheader("Content-Type", "").startswith("text/event-stream")
    if streamed and b"internal error" in data:
        return "INTERNAL", data[-300:].decode("utf-8", "replace"), elapsed
    return code, data[:160].decode("utf-8", "replace"), elapsed


# -- TLS ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsCase:
    kind: str  # handshake, mutated_hello, garbage, plaintext, abandoned
    port: str  # grpc or https
    payload: bytes = b""
    client_cert: str = "none"  # none, trusted, untrusted (handshake cases)
    server_name: str = "localhost"

    def __str__(self) -> str:
        return f"{self.kind} on {self.port} ({self.client_cert}, {self.server_name})"


def client_hello() -> bytes:
    """A real TLS ClientHello's bytes, as a client would send them first."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with contextlib.suppress(ssl.SSLWantReadError):  # it waits for the server's answer
        tls.do_handshake()
    return outgoing.read()


@st.composite
def tls_case(draw: st.DrawFn, hello: bytes) -> TlsCase:
    port = draw(st.sampled_from(["grpc", "https"]))
    kind = draw(
        st.sampled_from(["handshake"] * 4 + ["mutated_hello", "garbage", "plaintext", "abandoned"])
    )
    if kind == "handshake":
        return TlsCase(
            kind,
            port,
            client_cert=draw(st.sampled_from(["none", "trusted", "untrusted"])),
            server_name=draw(st.sampled_from(["localhost"] * 3 + ["unknown.invalid"])),
        )
    if kind == "mutated_hello":
        data = bytearray(hello)
        if draw(st.booleans()):
            del data[draw(st.integers(0, len(data) - 1)) :]
        for _ in range(draw(st.integers(0, 6))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return TlsCase(kind, port, bytes(data))
    if kind == "garbage":
        return TlsCase(kind, port, draw(st.binary(min_size=1, max_size=600)))
    if kind == "plaintext":
        preface = draw(
            st.sampled_from(
                [
                    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
                    b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
                ]
            )
        )
        return TlsCase(kind, port, preface)
    return TlsCase(kind, port, hello[: draw(st.integers(1, len(hello)))])


def send_raw(host: str, port: int, payload: bytes) -> tuple[str, str, float]:
    """Bytes that are not a TLS handshake (or only part of one): how the server ended it."""
    started = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=HELD_S) as conn:
            conn.sendall(payload)
            answered = b""
            while True:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                answered += chunk
    except TimeoutError:
        return "HELD", "", time.monotonic() - started
    except ConnectionError as exc:
        return "CLOSED", repr(exc), time.monotonic() - started
    elapsed = time.monotonic() - started
    alert = answered[:1] == b"\x15"  # a TLS alert record
    return ("TLS_REFUSED" if alert else "CLOSED"), answered[:40].hex(), elapsed


def send_tls(
    case: TlsCase,
    host: str,
    ports: dict[str, int],
    contexts: dict[str, ssl.SSLContext],
    grpc_call: Callable[[str], tuple[str, str, float]],
    bound_s: float,
) -> tuple[str, str, float]:
    port = ports[case.port]
    if case.kind in ("mutated_hello", "garbage", "plaintext"):
        return send_raw(host, port, case.payload)
    if case.kind == "abandoned":
        started = time.monotonic()
        with socket.create_connection((host, port), timeout=HELD_S) as conn:
            conn.sendall(case.payload)  # then gone, mid-handshake
        return "CLOSED", "abandoned by the client", time.monotonic() - started
    if case.port == "grpc":
        return grpc_call(case.client_cert)
    body = json.dumps({"model": "ensemble", "prompt": "hello", "max_tokens": 2}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    started = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=bound_s) as raw:
            context = contexts[case.client_cert]
            with context.wrap_socket(raw, server_hostname=case.server_name) as conn:
                conn.sendall(request)
                answer = b""
                while chunk := conn.recv(65536):
                    answer += chunk
    except ssl.SSLError as exc:
        return "TLS_REFUSED", repr(exc)[:160], time.monotonic() - started
    except (ConnectionError, TimeoutError) as exc:
        # A refused client certificate may end in a reset rather than an alert.
        refused = case.client_cert == "untrusted"
        return ("TLS_REFUSED" if refused else "UNKNOWN"), repr(exc), time.monotonic() - started
    elapsed = time.monotonic() - started
    head = answer.split(b"\r\n", 1)[0].split()
    if case.client_cert == "untrusted":
        # TLS 1.3 checks a client certificate after the client's side of the handshake is
        # done: the refusal is the connection ending with no answer. An answer is a hole.
        return ("UNTRUSTED_ACCEPTED" if head else "TLS_REFUSED"), repr(answer[:80]), elapsed
    if len(head) < 2 or not head[1].isdigit():
        return "UNKNOWN", f"no HTTP answer ({case}): {answer[:80]!r}", elapsed
    return status_name(int(head[1])), "", elapsed

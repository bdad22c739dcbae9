"""Safe to expose, against the real Triton: roles and credentials, TLS and mTLS, bad input that
is refused before work (never UNKNOWN), a frozen Triton, and SIGTERM with requests queued.

Over 500 lines: one flat live proof per hardening property, sharing this file's guarded
sidecar and TLS Triton fixtures and its status helpers."""

from __future__ import annotations

import json
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as kserve_pb

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.testing.certs import Authority
from scheduler_svc.tools.triton.launcher import TritonServer
from tests.integration.conftest import CPU_REPO, _start
from tests.integration.prompts import STORY
from tests.integration.sidecar import SidecarProcess, eventually
from tests.integration.tritonio import make_inputs, text_request

CLIENT_TOKEN = "team-a-client-token-0123456789"
ADMIN_TOKEN = "operator-admin-token-0123456789"


def code_of(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


# -- roles ----------------------------------------------------------------------------------


def test_admin_is_refused_on_the_client_port_and_served_on_the_loopback_listener(
    sidecar: SidecarProcess,
) -> None:
    public = pb_grpc.AdminStub(sidecar.channel())
    for call in (
        lambda: public.Drain(pb.DrainRequest()),
        lambda: public.Resume(pb.ResumeRequest()),
        lambda: public.UpdatePolicy(pb.UpdatePolicyRequest(policy_json="{}")),
        lambda: public.UnloadModel(pb.UnloadModelRequest(name="tensorrt_llm")),
    ):
        code, details = code_of(call)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "admin role" in details
    stats = sidecar.admin().GetStats(pb.GetStatsRequest())
    assert stats.backend_ready and not stats.draining


@pytest.fixture
def guarded(triton: TritonServer, tmp_path: Path) -> Iterator[SidecarProcess]:
    """A sidecar with a credentials file: a client token for team-a, an admin token."""
    creds = tmp_path / "credentials.yaml"
    creds.write_text(
        "tokens:\n"
        f"  - {{name: team-a, token: {CLIENT_TOKEN}, tenant: team-a, roles: [client]}}\n"
        f"  - {{name: ops, token: {ADMIN_TOKEN}, tenant: ops, roles: [client, admin]}}\n"
    )
    config = {"auth": {"credentials_file": str(creds)}}
    process = SidecarProcess(triton.grpc_url, tmp_path, config).start()
    yield process
    process.stop()


def test_credentials_decide_the_tenant_and_the_role_on_every_front(
    guarded: SidecarProcess,
) -> None:
    stub = guarded.scheduler()
    request = pb.GenerateRequest(prompt="hello", max_tokens=2)
    code, details = code_of(lambda: stub.Generate(request))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "needs a credential" in details
    code, _ = code_of(lambda: stub.Generate(request, metadata=bearer("wrong-token-xxxxxxxxxx")))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    answer = stub.Generate(request, metadata=bearer(CLIENT_TOKEN))
    assert answer.usage.completion_tokens == 2
    narrowed = pb.GenerateRequest(prompt="hello", max_tokens=2, tenant="team-a/nightly")
    stub.Generate(narrowed, metadata=bearer(CLIENT_TOKEN))
    code, details = code_of(
        lambda: stub.Generate(
            pb.GenerateRequest(prompt="hi", max_tokens=2, tenant="team-b"),
            metadata=bearer(CLIENT_TOKEN),
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED and "may only narrow" in details
    tenants = {e["tenant"] for e in guarded.events("request end")}
    assert {"team-a", "team-a/nightly"} <= tenants and "team-b" not in tenants

    client = grpcclient.InferenceServerClient(guarded.url)
    with pytest.raises(Exception, match="UNAUTHENTICATED"):
        client.infer("ensemble", make_inputs(text_request("hi", 2)))
    result = client.infer(
        "ensemble",
        make_inputs(text_request("hi", 2)),
        headers={"authorization": f"Bearer {CLIENT_TOKEN}"},
    )
    assert result.as_numpy("text_output") is not None

    admin = pb_grpc.AdminStub(guarded.channel())
    code, _ = code_of(lambda: admin.Drain(pb.DrainRequest(), metadata=bearer(CLIENT_TOKEN)))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    admin.Drain(pb.DrainRequest(), metadata=bearer(ADMIN_TOKEN))  # by credential, any port
    code, _ = code_of(lambda: stub.Generate(request, metadata=bearer(CLIENT_TOKEN)))
    assert code == grpc.StatusCode.UNAVAILABLE
    admin.Resume(pb.ResumeRequest(), metadata=bearer(ADMIN_TOKEN))
    assert not any(CLIENT_TOKEN in line or ADMIN_TOKEN in line for line in guarded.lines)


def test_a_revoked_credential_ends_an_open_stream_at_its_next_message(
    guarded: SidecarProcess, tmp_path: Path
) -> None:
    request = kserve_pb.ModelInferRequest(model_name="ensemble", id="before")
    for item in make_inputs(text_request("hello", 2)):
        request.inputs.append(item._get_tensor())
        request.raw_input_contents.append(item._get_content())
    later = kserve_pb.ModelInferRequest()
    later.CopyFrom(request)
    later.id = "after"
    sent: list[bytes] = [request.SerializeToString()]
    go_on = threading.Event()

    def messages() -> Iterator[bytes]:
        yield sent[0]
        go_on.wait(30)
        yield later.SerializeToString()

    call = guarded.channel().stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer",
        response_deserializer=kserve_pb.ModelStreamInferResponse.FromString,
    )(messages(), metadata=bearer(CLIENT_TOKEN), timeout=60)
    first = next(call)
    assert first.infer_response.id == "before" and not first.error_message
    # The client's token leaves the file; the reload takes it away from the open stream too.
    creds = tmp_path / "credentials.yaml"
    creds.write_text(f"tokens:\n  - {{name: ops, token: {ADMIN_TOKEN}, roles: [admin]}}\n")
    guarded.signal(signal.SIGHUP)
    guarded.wait_for_events("credentials and TLS reloaded", lambda e: len(e) >= 1)
    go_on.set()
    with pytest.raises(grpc.RpcError) as caught:
        rest = list(call)
        assert not rest
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_narrowed_tenants_share_their_parents_quota_and_anonymous_cannot_take_one(
    triton: TritonServer, tmp_path: Path
) -> None:
    creds = tmp_path / "credentials.yaml"
    creds.write_text(f"tokens:\n  - {{name: team-a, token: {CLIENT_TOKEN}, roles: [client]}}\n")
    config = {
        "auth": {"credentials_file": str(creds), "anonymous": "client"},
        "quotas": {"tenants": {"team-a": {"max_concurrent": 1}}},
    }
    sidecar = SidecarProcess(triton.grpc_url, tmp_path, config).start()
    stub = sidecar.scheduler()
    try:
        # team-a (the credential's name: it has no tenant key) holds its one place ...
        held = stub.GenerateStream(
            pb.GenerateRequest(prompt=STORY, max_tokens=400, tenant="team-a/one"),
            metadata=bearer(CLIENT_TOKEN),
        )
        next(iter(held))
        # ... so a fresh sub-tenant is refused: it used to get a quota of its own.
        code, details = code_of(
            lambda: stub.Generate(
                pb.GenerateRequest(prompt="hi", max_tokens=2, tenant="team-a/two"),
                metadata=bearer(CLIENT_TOKEN),
            )
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "counted against tenant team-a" in details
        # Anonymous callers beside credentials run as `anonymous`, never as team-a.
        code, details = code_of(
            lambda: stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2, tenant="team-a"))
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED and "anonymous" in details
        answer = stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2))
        assert answer.usage.completion_tokens == 2
        held.cancel()
        sidecar.wait_for_events(
            "request end", lambda ends: any(e["tenant"] == "anonymous" for e in ends)
        )
        assert "team-a" not in {e["tenant"] for e in sidecar.events("request end")}
    finally:
        sidecar.stop()


# -- TLS ------------------------------------------------------------------------------------


def test_mtls_identities_and_certificates_reloaded_on_sighup(
    triton: TritonServer, tmp_path: Path
) -> None:
    ca = Authority(tmp_path, "ca-one")
    server = ca.issue("sidecar", ["localhost"])
    ops = ca.issue("ops.internal", ["ops.internal"])
    creds = tmp_path / "credentials.yaml"
    creds.write_text("identities:\n  - {name: ops, identity: ops.internal, roles: [admin]}\n")
    tls = {
        "cert_file": str(server.cert),
        "key_file": str(server.key),
        "client_ca_file": str(ca.pair.cert),
        "require_client_cert": True,
    }
    config = {"server": {"tls": tls}, "auth": {"credentials_file": str(creds)}}
    sidecar = SidecarProcess(triton.grpc_url, tmp_path, config).start()

    def admin_over(roots: Path, client: Any) -> pb_grpc.AdminStub:
        credentials = grpc.ssl_channel_credentials(
            roots.read_bytes(),
            client.key.read_bytes() if client else None,
            client.cert.read_bytes() if client else None,
        )
        options = (("grpc.ssl_target_name_override", "localhost"),)
        return pb_grpc.AdminStub(grpc.secure_channel(sidecar.url, credentials, options))

    try:
        stats = admin_over(ca.pair.cert, ops).GetStats(pb.GetStatsRequest(), timeout=10)
        assert stats.scheduler == "policy"  # admin by its certificate, on the client port
        code, _ = code_of(
            lambda: admin_over(ca.pair.cert, None).GetStats(pb.GetStatsRequest(), timeout=5)
        )
        assert code == grpc.StatusCode.UNAVAILABLE  # no client certificate: no handshake
        code, _ = code_of(
            lambda: pb_grpc.AdminStub(sidecar.channel()).GetStats(pb.GetStatsRequest(), timeout=5)
        )
        assert code == grpc.StatusCode.UNAVAILABLE  # plaintext is not served at all

        def tool(*extra: str) -> subprocess.CompletedProcess[str]:
            command = [sys.executable, "-m", "scheduler_svc.cli", *extra]
            return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

        tls_flags = ["--ca-file", str(ca.pair.cert), "--server-name", "localhost"]
        cert_flags = ["--cert-file", str(ops.cert), "--key-file", str(ops.key)]
        checked = tool("health", "--address", sidecar.url, *tls_flags, *cert_flags)
        assert checked.returncode == 0 and "SERVING" in checked.stdout, checked.stderr
        assert tool("health", "--address", sidecar.url).returncode == 1  # plaintext: refused
        shown = tool("rollout", "--address", sidecar.url, *tls_flags, *cert_flags, "status")
        assert "UNAVAILABLE" not in shown.stderr  # spoke TLS (this sidecar has no rollout)
        # A new CA and server certificate, swapped in place and reloaded by SIGHUP.
        (tmp_path / "two").mkdir()
        ca_two = Authority(tmp_path / "two", "ca-two")
        fresh = ca_two.issue("sidecar-two", ["localhost"])
        ops_two = ca_two.issue("ops.internal", ["ops.internal"])
        server.cert.write_bytes(fresh.cert.read_bytes())
        server.key.write_bytes(fresh.key.read_bytes())
        ca.pair.cert.write_bytes(ca_two.pair.cert.read_bytes())
        sidecar.signal(signal.SIGHUP)
        sidecar.wait_for_events("credentials and TLS reloaded", lambda e: len(e) >= 1)
        stats = admin_over(ca_two.pair.cert, ops_two).GetStats(pb.GetStatsRequest(), timeout=10)
        assert stats.scheduler == "policy"
    finally:
        sidecar.stop()


def test_sighup_without_a_config_file_reloads_and_keeps_serving(
    triton: TritonServer, tmp_path: Path
) -> None:
    sidecar = SidecarProcess(triton.grpc_url, tmp_path, config_file=False).start()
    try:
        sidecar.signal(signal.SIGHUP)  # it used to kill a sidecar started with flags only
        sidecar.wait_for_events("credentials and TLS reloaded", lambda e: len(e) >= 1)
        answer = sidecar.scheduler().Generate(pb.GenerateRequest(prompt="hi", max_tokens=2))
        assert answer.usage.completion_tokens == 2
    finally:
        sidecar.stop()


def test_a_tls_reload_that_fails_keeps_the_old_certificate_and_credentials(
    triton: TritonServer, tmp_path: Path
) -> None:
    ca = Authority(tmp_path, "ca-one")
    server = ca.issue("sidecar", ["localhost"])
    creds = tmp_path / "credentials.yaml"
    entry = "  - {{name: {0}, token: {1}, tenant: {0}, roles: [client]}}\n"
    creds.write_text("tokens:\n" + entry.format("one", CLIENT_TOKEN))
    tls = {"cert_file": str(server.cert), "key_file": str(server.key)}
    config = {"server": {"tls": tls}, "auth": {"credentials_file": str(creds)}}
    sidecar = SidecarProcess(triton.grpc_url, tmp_path, config).start()
    second = "second-client-token-0123456789"

    def models(roots: Path, token: str) -> int:
        url = f"https://localhost:{sidecar.http_port}/v1/models"
        verify = ssl.create_default_context(cafile=str(roots))
        headers = {"authorization": f"Bearer {token}"}
        return httpx.get(url, headers=headers, verify=verify, timeout=10).status_code

    try:
        assert models(ca.pair.cert, CLIENT_TOKEN) == 200
        # A second credential and a key file that does not load, in one reload: refused whole.
        creds.write_text(creds.read_text() + entry.format("two", second))
        good_key = server.key.read_bytes()
        server.key.write_bytes(b"not a key")
        sidecar.signal(signal.SIGHUP)
        sidecar.wait_for_events(
            "credentials / TLS reload refused; the running ones stay", lambda e: len(e) >= 1
        )
        assert models(ca.pair.cert, CLIENT_TOKEN) == 200  # HTTPS still serves the old certificate
        assert models(ca.pair.cert, second) == 401  # and the old credentials
        # New files that load: both are taken, HTTPS presents the new certificate.
        (tmp_path / "two").mkdir()
        ca_two = Authority(tmp_path / "two", "ca-two")
        fresh = ca_two.issue("sidecar-two", ["localhost"])
        server.cert.write_bytes(fresh.cert.read_bytes())
        server.key.write_bytes(fresh.key.read_bytes())
        assert good_key != fresh.key.read_bytes()
        sidecar.signal(signal.SIGHUP)
        sidecar.wait_for_events("credentials and TLS reloaded", lambda e: len(e) >= 1)
        assert models(ca_two.pair.cert, second) == 200
        with pytest.raises(httpx.ConnectError):
            models(ca.pair.cert, second)  # the old certificate is gone from new handshakes
    finally:
        sidecar.stop()


# -- bad input: refused before work, never UNKNOWN -------------------------------------------


def test_bad_input_is_refused_before_work_with_a_clear_status(sidecar: SidecarProcess) -> None:
    stub = sidecar.scheduler()
    huge = "x" * (3 * 1024 * 1024)
    results: list[tuple[grpc.StatusCode, str]] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                code_of(lambda: stub.Generate(pb.GenerateRequest(prompt=huge, max_tokens=2)))
            )
        )
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    answer = stub.Generate(pb.GenerateRequest(prompt="small", max_tokens=2), timeout=30)
    for thread in threads:
        thread.join()
    assert answer.usage.completion_tokens == 2
    assert all(
        c == grpc.StatusCode.INVALID_ARGUMENT and "prompt: more than" in d for c, d in results
    )

    code, details = code_of(
        lambda: stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2, tenant="t" * 1_000_000))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and len(details) < 200
    assert not any("t" * 1000 in line for line in sidecar.lines)

    admin = sidecar.admin()
    for policy_json, needle in (
        ('{"kv": {"max_in_flight": 1.5}}', "must be an integer"),
        ('{"retry_after_s": Infinity}', "Infinity"),
        ('{"lanes": [{"name": ["x"]}]}', "must be a string"),
        ("[" * 5000 + "]" * 5000, "nested"),
    ):
        code, details = code_of(
            lambda p=policy_json: admin.UpdatePolicy(pb.UpdatePolicyRequest(policy_json=p))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details
    # Invalid UTF-8 in a string field, on the Admin and KServe fronts (raw bytes on the wire).
    admin_channel = grpc.insecure_channel(sidecar.admin_url)
    bad_name = b"\x0a\x02\xff\xfe"  # field 1 (name), 2 bytes, not UTF-8
    code, _ = code_of(lambda: admin_channel.unary_unary("/scheduler.v1.Admin/LoadModel")(bad_name))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    channel = sidecar.channel()
    for method in ("ModelInfer", "ModelMetadata", "ModelReady"):
        code, details = code_of(
            lambda m=method: channel.unary_unary(f"/inference.GRPCInferenceService/{m}")(bad_name)
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in details


def test_a_malformed_message_ends_model_stream_infer_after_answering_what_it_accepted(
    sidecar: SidecarProcess,
) -> None:
    request = kserve_pb.ModelInferRequest(model_name="ensemble", id="first")
    for item in make_inputs(text_request("hello", 3)):
        request.inputs.append(item._get_tensor())
        request.raw_input_contents.append(item._get_content())
    messages = [request.SerializeToString(), b"\x0a\x02\xff\xfe"]
    call = sidecar.channel().stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer",
        response_deserializer=kserve_pb.ModelStreamInferResponse.FromString,
    )(iter(messages))
    answers = []
    with pytest.raises(grpc.RpcError) as caught:
        answers.extend(call)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [a.infer_response.id for a in answers] == ["first"]
    assert not answers[0].error_message


# -- faults ---------------------------------------------------------------------------------


@pytest.fixture
def tls_triton(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[TritonServer, Authority]]:
    """A Triton of its own (it is frozen below), serving gRPC over TLS."""
    directory = tmp_path_factory.mktemp("triton-tls")
    ca = Authority(directory, "triton-ca")
    pair = ca.issue("triton", ["triton.local"])
    server = _start(
        CPU_REPO,
        directory / "triton.log",
        [
            "--grpc-use-ssl=true",
            f"--grpc-server-cert={pair.cert}",
            f"--grpc-server-key={pair.key}",
            f"--grpc-root-cert={ca.pair.cert}",
        ],
    )
    yield server, ca
    server.signal(signal.SIGCONT)  # never leave it frozen
    server.stop()


def test_a_frozen_triton_ends_every_request_unavailable_and_frees_its_place(
    tls_triton: tuple[TritonServer, Authority], tmp_path: Path
) -> None:
    triton, ca = tls_triton
    config = {
        "triton": {
            "stall_timeout_s": 2.0,
            "tls": {"ca_file": str(ca.pair.cert), "server_name": "triton.local"},
        }
    }
    sidecar = SidecarProcess(triton.grpc_url, tmp_path, config).start()
    try:
        stub = sidecar.scheduler()
        assert (
            stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2)).usage.completion_tokens
            == 2
        )
        streams = [
            stub.GenerateStream(pb.GenerateRequest(prompt=STORY, max_tokens=1000)) for _ in range(4)
        ]
        for stream in streams:
            next(stream)  # every one is running
        triton.signal(signal.SIGSTOP)
        started = time.monotonic()
        codes = []
        for stream in streams:  # no client deadline: only the sidecar can end them
            try:
                for _ in stream:
                    pass
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
                assert "sent nothing" in (exc.details() or "")
        waited = time.monotonic() - started
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 4
        assert waited < 30, f"the stalled requests took {waited:.0f} s to end"
        eventually(
            lambda: sidecar.admin().GetStats(pb.GetStatsRequest()).in_flight == 0,
            "their places are free",
        )
        triton.signal(signal.SIGCONT)
        eventually(
            lambda: (
                code_of(
                    lambda: stub.Generate(
                        pb.GenerateRequest(prompt="after", max_tokens=2), timeout=20
                    )
                )[0]
                == grpc.StatusCode.OK
            ),
            "Triton serves again",
        )
    finally:
        sidecar.stop()


def test_sigterm_with_requests_queued_answers_each_unavailable_with_a_retry_hint(
    triton: TritonServer, tmp_path: Path
) -> None:
    config = {
        "queue": {"scheduler": "fifo", "max_in_flight": 1, "max_queued": 8},
        "server": {"drain_grace_s": 3.0},
    }
    sidecar = SidecarProcess(triton.grpc_url, tmp_path, config).start()
    stub = sidecar.scheduler()
    outcomes: list[tuple[grpc.StatusCode, dict[str, str]]] = []

    def one() -> None:
        future = stub.Generate.future(pb.GenerateRequest(prompt=STORY, max_tokens=1000))
        try:
            future.result()
            outcomes.append((grpc.StatusCode.OK, {}))
        except grpc.RpcError as exc:
            trailers = dict(exc.trailing_metadata() or ())  # type: ignore[attr-defined]
            outcomes.append((exc.code(), trailers))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    eventually(lambda: sidecar.admin().GetStats(pb.GetStatsRequest()).queued == 3, "3 queued")
    sidecar.terminate()
    for thread in threads:
        thread.join(30)
    assert sidecar.wait() == 0
    assert len(outcomes) == 4
    for code, trailers in outcomes:
        assert code == grpc.StatusCode.UNAVAILABLE, outcomes
        assert int(trailers["retry-after-ms"]) > 0
    ended = sidecar.events("requests still open at the end of the drain")
    assert ended and ended[0]["answered"] == 4
    assert json.dumps(sidecar.events("stopped")[0]["finished"])


def test_drain_command_drains_over_the_admin_listener_and_waits(
    triton: TritonServer, tmp_path: Path
) -> None:
    """Triton's preStop in Kubernetes: the sidecar stops taking work before Triton stops."""
    sidecar = SidecarProcess(triton.grpc_url, tmp_path).start()
    try:
        stream = sidecar.scheduler().GenerateStream(pb.GenerateRequest(prompt=STORY, max_tokens=40))
        next(stream)
        drain = subprocess.run(
            [sys.executable, "-m", "scheduler_svc.cli", "drain", "--address", sidecar.admin_url],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert drain.returncode == 0 and "drained" in drain.stdout, drain.stderr
        nowhere = subprocess.run(
            [sys.executable, "-m", "scheduler_svc.cli", "drain", "--address", "127.0.0.1:9"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert nowhere.returncode == 1 and "nothing drained" in nowhere.stderr  # was exit 0
        rest = list(stream)  # the running request finished before the command returned
        assert rest[-1].usage.completion_tokens == 40
        stats = sidecar.admin().GetStats(pb.GetStatsRequest())
        assert stats.draining and stats.in_flight == 0
        code, _ = code_of(
            lambda: sidecar.scheduler().Generate(pb.GenerateRequest(prompt="late", max_tokens=2))
        )
        assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        sidecar.stop()

"""The HTTP fronts on the real stack: the `openai` client and Triton's generate extension
through the sidecar to the real Triton, streaming, cancellation on disconnect, and errors with
their HTTP status (400 / 401 / 404 / 413 / 429 with Retry-After / 503)."""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import openai
import pytest
import tritonclient.grpc as grpcclient

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.testing.certs import Authority
from scheduler_svc.tools.triton.launcher import TritonServer
from tests.integration.prompts import STORY
from tests.integration.sidecar import SidecarProcess, eventually
from tests.integration.test_sidecar import ENGINE, ended_early, useful_tokens
from tests.integration.tritonio import make_inputs, text_request, wait_engine_idle

TOKEN = "http-client-token-0123456789"


def client(sidecar: SidecarProcess, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sidecar.http_url}/v1", api_key=api_key, max_retries=0)


def events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of a server-sent-events body."""
    out: list[Any] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_openai_client_completions_and_chat_streamed_and_whole(sidecar: SidecarProcess) -> None:
    api = client(sidecar)
    assert [m.id for m in api.models.list()] == ["ensemble"]
    whole = api.completions.create(model="ensemble", prompt=STORY, max_tokens=6, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 6
    # The same greedy request through the KServe front: one service, one answer.
    kserve = grpcclient.InferenceServerClient(sidecar.url)
    result = kserve.infer("ensemble", make_inputs(text_request(STORY, 6)))
    assert result.as_numpy("text_output").reshape(-1)[0].decode() == choice.text

    chunks = list(
        api.completions.create(
            model="ensemble",
            prompt=STORY,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6

    chat = api.chat.completions.create(
        model="ensemble",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_completion_tokens=4,
        temperature=0,
    )
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    streamed = list(
        api.chat.completions.create(
            model="ensemble",
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
    )
    assert streamed[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in streamed)
    assert text == chat.choices[0].message.content


def test_stop_strings_end_the_answer_with_finish_reason_stop(sidecar: SidecarProcess) -> None:
    api = client(sidecar)
    free = api.completions.create(model="ensemble", prompt=STORY, max_tokens=12, temperature=0)
    text = free.choices[0].text
    stop = text[len(text) // 2 :][:2]
    stopped = api.completions.create(
        model="ensemble", prompt=STORY, max_tokens=12, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


def test_model_metadata_is_one_answer_on_both_fronts(sidecar: SidecarProcess) -> None:
    """HTTP and gRPC describe the ensemble from one source, as Triton does: each row's
    batch_index and sequence_index among the outputs (the HTTP copy used to leave them out)."""
    http = httpx.get(f"{sidecar.http_url}/v2/models/ensemble").json()
    over_grpc = grpcclient.InferenceServerClient(sidecar.url).get_model_metadata(
        "ensemble", as_json=True
    )

    def tensors(meta: dict[str, Any], key: str) -> list[tuple[str, str, list[int]]]:
        return [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in meta[key]]

    assert http["name"] == over_grpc["name"] == "ensemble"
    assert tensors(http, "inputs") == tensors(over_grpc, "inputs")
    assert tensors(http, "outputs") == tensors(over_grpc, "outputs")
    assert {"batch_index", "sequence_index"} <= {name for name, *_ in tensors(http, "outputs")}


def test_triton_generate_and_generate_stream(sidecar: SidecarProcess) -> None:
    base = f"{sidecar.http_url}/v2/models/ensemble"
    body = {"text_input": STORY, "max_tokens": 6, "parameters": {"priority": 1}}
    whole = httpx.post(f"{base}/generate", json=body).json()
    assert whole["model_name"] == "ensemble" and whole["text_output"]
    with httpx.stream("POST", f"{base}/generate_stream", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        parts = events(r)
    assert len(parts) > 1 and "".join(p["text_output"] for p in parts) == whole["text_output"]
    # tensorrt_llm_bls's accumulate_tokens: each event carries the text so far.
    with httpx.stream(
        "POST", f"{base}/generate_stream", json={**body, "stream": True, "accumulate_tokens": True}
    ) as r:
        assert events(r)[-1]["text_output"] == whole["text_output"]
    assert httpx.get(f"{sidecar.http_url}/v2/health/live").json() == {"live": True}
    assert httpx.get(f"{sidecar.http_url}/v2/health/ready").status_code == 200
    assert httpx.get(f"{base}/ready").status_code == 200
    assert httpx.get(f"{base}/versions/2/ready").status_code == 404
    # A gateway's objective header chooses the lane (sheddable: batch, pinned to cold), and
    # wins over the body's priority; an unknown objective is refused, naming the known ones.
    sheddable = {"x-llm-d-inference-objective": "sheddable", "x-request-id": "gateway-batch"}
    assert httpx.post(f"{base}/generate", json=body, headers=sheddable).status_code == 200
    ends = sidecar.wait_for_events(
        "request end", lambda ends: any(e["request_id"] == "gateway-batch" for e in ends)
    )
    assert [e["lane"] for e in ends if e["request_id"] == "gateway-batch"] == ["cold"]
    unknown = httpx.post(
        f"{base}/generate", json=body, headers={"x-llm-d-inference-objective": "vip"}
    )
    assert unknown.status_code == 400 and "critical" in unknown.json()["error"]
    meta = httpx.get(base).json()
    assert {i["name"] for i in meta["inputs"]} >= {"text_input", "max_tokens", "stream"}


def test_log_probs_on_openai_and_generate_match_tritons(
    sidecar: SidecarProcess, triton: TritonServer
) -> None:
    body = {"text_input": STORY, "max_tokens": 4, "return_log_probs": True}
    theirs = httpx.post(f"{triton.http_url}/v2/models/ensemble/generate", json=body, timeout=60)
    ours = httpx.post(f"{sidecar.http_url}/v2/models/ensemble/generate", json=body, timeout=60)
    assert theirs.status_code == ours.status_code == 200, ours.text
    mine, reference = ours.json(), theirs.json()
    assert mine["text_output"] == reference["text_output"]
    assert mine["output_log_probs"] == pytest.approx(reference["output_log_probs"], abs=1e-3)
    assert mine["cum_log_probs"] == pytest.approx(reference["cum_log_probs"], abs=1e-3)
    with httpx.stream(
        "POST",
        f"{sidecar.http_url}/v2/models/ensemble/generate_stream",
        json={**body, "stream": True},
        timeout=60,
    ) as r:
        streamed = [e for e in events(r) if e != "[DONE]"]
    pieces = [
        v
        for e in streamed
        for v in (
            e["output_log_probs"]
            if isinstance(e["output_log_probs"], list)
            else [e["output_log_probs"]]
        )
    ]
    assert pieces == pytest.approx(reference["output_log_probs"], abs=1e-3)
    api = client(sidecar)
    done = api.completions.create(
        model="ensemble", prompt=STORY, max_tokens=4, temperature=0, logprobs=0
    )
    assert done.choices[0].logprobs is not None
    assert done.choices[0].logprobs.token_logprobs == pytest.approx(
        reference["output_log_probs"], abs=1e-3
    )
    chat = api.chat.completions.create(
        model="ensemble",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        stream=True,
    )
    content = [
        c
        for chunk in chat
        for choice in chunk.choices
        if choice.logprobs
        for c in choice.logprobs.content or ()
    ]
    assert len(content) == 3 and all(c.logprob <= 0 for c in content)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        api.chat.completions.create(
            model="ensemble",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            logprobs=True,
            top_logprobs=2,
        )


def test_a_client_that_disconnects_cancels_its_request_inside_triton(
    sidecar: SidecarProcess, triton: TritonServer
) -> None:
    before = useful_tokens(triton)
    stopped_before = ended_early(triton, "stopped")
    body = {"model": "ensemble", "prompt": STORY, "max_tokens": 800, "stream": True}
    headers = {"x-request-id": "leaves-early"}
    with httpx.stream(
        "POST", f"{sidecar.http_url}/v1/completions", json=body, headers=headers
    ) as r:
        for received, _line in enumerate((x for x in r.iter_lines() if x), start=1):
            if received == 3:
                break  # leaving the block closes the connection
    wait_engine_idle(triton.metrics_url, ENGINE)
    assert useful_tokens(triton) - before < 100  # stopped long before its 800 tokens
    eventually(
        lambda: ended_early(triton, "stopped") == stopped_before + 1,
        "the engine counts one stopped request",
    )
    ends = sidecar.wait_for_events(
        "request end", lambda ends: any(e["request_id"] == "leaves-early" for e in ends)
    )
    assert [e["outcome"] for e in ends if e["request_id"] == "leaves-early"] == ["cancelled"]


def test_bad_requests_get_openai_and_triton_shaped_errors(sidecar: SidecarProcess) -> None:
    api = client(sidecar)
    for kwargs, status, needle in (
        ({"n": 2}, 400, "n = 1"),
        ({"extra_body": {"best_of_all": 1}}, 400, "unrecognized request argument"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"model": "gpt-4o"}, 404, "does not exist here"),
        ({"prompt": "x" * 5_000_000}, 413, "server.max_message_bytes"),
        # Past the engine's 32-bit tensors: refused by name (before, a 500 for the batch).
        ({"extra_body": {"top_k": 2**40}}, 400, "top_k: 1099511627776 is outside"),
    ):
        call = {"model": "ensemble", "prompt": "hello", "max_tokens": 2, **kwargs}
        with pytest.raises(openai.APIStatusError) as caught:
            api.completions.create(**call)
        assert caught.value.status_code == status, kwargs
        assert needle in caught.value.message, caught.value.message
        error = caught.value.body
        assert isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)
    for raw_body in (b"{not json", b"[" * 100_000):
        raw = httpx.post(f"{sidecar.http_url}/v1/completions", content=raw_body)
        assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    generate = f"{sidecar.http_url}/v2/models/ensemble/generate"
    for body, status, needle in (
        ({"max_tokens": 2}, 400, "missing required input 'text_input'"),
        ({"text_input": "hi", "max_tokens": 2, "bogus": 1}, 400, "unknown input"),
        ({"text_input": "hi", "max_tokens": "2"}, 400, "expected a INT32 value"),
        ({"text_input": "hi", "max_tokens": 2, "temperature": 1e39}, 400, "temperature: 1e+39"),
        ({"text_input": "hi", "max_tokens": 2, "presence_penalty": -1e39}, 400, "presence_pen"),
    ):
        answer = httpx.post(generate, json=body)
        assert answer.status_code == status and needle in answer.json()["error"], answer.text
    unknown = httpx.post(f"{sidecar.http_url}/v2/models/nope/generate", json={})
    assert unknown.status_code == 404 and "unknown model" in unknown.json()["error"]
    assert httpx.get(f"{sidecar.http_url}/v1/nothing").status_code == 404
    assert httpx.get(f"{sidecar.http_url}/v1/completions").status_code == 405


@pytest.fixture
def guarded_http(triton: TritonServer, tmp_path: Path) -> Iterator[SidecarProcess]:
    """Credentials, and a quota small enough that a second large request is over it."""
    creds = tmp_path / "credentials.yaml"
    creds.write_text(
        f"tokens:\n  - {{name: team-a, token: {TOKEN}, tenant: team-a, roles: [client]}}\n"
    )
    config = {
        "auth": {"credentials_file": str(creds)},
        "quotas": {"default": {"tokens_per_s": 1, "burst_tokens": 200}},
    }
    process = SidecarProcess(triton.grpc_url, tmp_path, config).start()
    yield process
    process.stop()


def test_credentials_and_quotas_on_http(guarded_http: SidecarProcess) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        client(guarded_http, "not-a-token-at-all").models.list()
    assert "the bearer token is not valid" in caught.value.message
    generate = f"{guarded_http.http_url}/v2/models/ensemble/generate"
    bare = httpx.post(generate, json={"text_input": "hi", "max_tokens": 2})
    assert bare.status_code == 401 and "needs a credential" in bare.json()["error"]
    # Probes need no credential.
    assert httpx.get(f"{guarded_http.http_url}/v2/health/ready").status_code == 200

    api = client(guarded_http, TOKEN)
    answer = api.completions.create(model="ensemble", prompt="hi", max_tokens=150)
    assert answer.usage is not None and answer.usage.completion_tokens == 150
    refused = httpx.post(
        f"{guarded_http.http_url}/v1/completions",
        json={"model": "ensemble", "prompt": "hi", "max_tokens": 150},
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"
    ends = guarded_http.events("request end")
    assert {e["tenant"] for e in ends} == {"team-a"}
    assert not any(TOKEN in line for line in guarded_http.lines)


def test_no_backend_means_503_and_not_ready(tmp_path: Path) -> None:
    process = SidecarProcess("127.0.0.1:9", tmp_path).start()  # nothing listens there
    try:
        ready = httpx.get(f"{process.http_url}/v2/health/ready")
        assert ready.status_code == 503 and ready.json() == {"ready": False}
        answer = httpx.post(
            f"{process.http_url}/v1/completions",
            json={"model": "ensemble", "prompt": "hi", "max_tokens": 2},
        )
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["type"] == "service_unavailable"
    finally:
        process.stop()


def test_https_with_a_client_certificate_as_the_credential(
    triton: TritonServer, tmp_path: Path
) -> None:
    ca = Authority(tmp_path, "ca-http")
    server = ca.issue("sidecar", ["localhost"])
    team = ca.issue("team-a.internal", ["team-a.internal"])
    creds = tmp_path / "credentials.yaml"
    creds.write_text(
        "identities:\n"
        "  - {name: team-a, identity: team-a.internal, tenant: team-a, roles: [client]}\n"
    )
    tls = {
        "cert_file": str(server.cert),
        "key_file": str(server.key),
        "client_ca_file": str(ca.pair.cert),
    }
    config = {"server": {"tls": tls, "metrics_port": 0}, "auth": {"credentials_file": str(creds)}}
    sidecar = SidecarProcess(triton.grpc_url, tmp_path, config).start()

    def context(client: Any) -> ssl.SSLContext:
        trusted = ssl.create_default_context(cafile=str(ca.pair.cert))
        trusted.check_hostname = False  # the certificate names localhost; we dial 127.0.0.1
        if client is not None:
            trusted.load_cert_chain(str(client.cert), str(client.key))
        return trusted

    body = {"model": "ensemble", "prompt": "hi", "max_tokens": 2}
    url = f"https://127.0.0.1:{sidecar.http_port}/v1/completions"
    try:
        answer = httpx.post(url, json=body, verify=context(team))
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 2
        bare = httpx.post(url, json=body, verify=context(None))
        assert bare.status_code == 401 and "needs a credential" in bare.text
        with pytest.raises(httpx.HTTPError):  # plaintext is not served
            httpx.post(url.replace("https", "http"), json=body)
        assert {e["tenant"] for e in sidecar.events("request end")} == {"team-a"}
        # gRPC cannot ask for an optional certificate (grpcio: required or never asked), so
        # there the same client is a caller without a credential, and the log says so.
        warned = sidecar.events("gRPC does not ask for an optional client certificate")
        assert len(warned) == 1
        grpc_tls = grpc.ssl_channel_credentials(
            ca.pair.cert.read_bytes(), team.key.read_bytes(), team.cert.read_bytes()
        )
        channel = grpc.secure_channel(
            sidecar.url, grpc_tls, (("grpc.ssl_target_name_override", "localhost"),)
        )
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.SchedulerStub(channel).Generate(
                pb.GenerateRequest(prompt="hi", max_tokens=2), timeout=10
            )
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The metrics listener serves the same TLS (it was plaintext whatever server.tls said).
        metrics_port = sidecar.events("sidecar ready")[0]["metrics_port"]
        page = httpx.get(f"https://127.0.0.1:{metrics_port}/metrics", verify=context(None))
        assert page.status_code == 200 and "scheduler_svc_" in page.text
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
    finally:
        sidecar.stop()

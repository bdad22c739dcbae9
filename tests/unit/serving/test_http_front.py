"""The HTTP front as a server, over a scripted engine (aiohttp's test server): OpenAI and
Triton's generate routes answer in their shapes, refusals carry their status and name the
field, and metadata is the ensemble's. tests/integration/test_http_live.py runs the same
routes against the real Triton."""

from __future__ import annotations

import json

from aiohttp.test_utils import TestClient, TestServer

from scheduler_svc.core.engine import Batching, EngineProfile
from scheduler_svc.serving.auth import ANONYMOUS_CLIENT
from scheduler_svc.serving.chat import ChatTemplate
from scheduler_svc.serving.fronts.ensemble import ensemble_metadata
from scheduler_svc.serving.fronts.guard import Identity
from scheduler_svc.serving.fronts.http import HttpFront
from scheduler_svc.serving.loop import CoreLoop
from scheduler_svc.serving.service import GenerationService
from scheduler_svc.testing.backend import ScriptedBackend
from scheduler_svc.testing.stack import TOKENIZER, serve

WORD = TOKENIZER.encode(" hello", add_special_tokens=False).ids[0]


def _front(service: GenerationService) -> HttpFront:
    chat = ChatTemplate.load(None, service.cfg.model.tokenizer_dir)
    return HttpFront(service, lambda: Identity(None, ANONYMOUS_CLIENT), chat)


def test_openai_and_generate_routes_answer_in_their_shapes() -> None:
    backend = ScriptedBackend(EngineProfile(Batching.INFLIGHT, 64), first_id=WORD)

    async def body(service: GenerationService, _: CoreLoop) -> None:
        async with TestClient(TestServer(_front(service).application())) as client:
            done = await client.post(
                "/v1/completions", json={"model": "ensemble", "prompt": "Hi", "max_tokens": 3}
            )
            assert done.status == 200
            answer = await done.json()
            assert answer["object"] == "text_completion" and answer["choices"][0]["text"]
            assert answer["usage"]["completion_tokens"] == 3
            streamed = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "ensemble",
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 2,
                    "stream": True,
                },
            )
            lines = [ln for ln in (await streamed.text()).splitlines() if ln.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            generated = await client.post(
                "/v2/models/ensemble/generate", json={"text_input": "Hi", "max_tokens": 2}
            )
            whole = await generated.json()
            assert whole["model_name"] == "ensemble" and whole["text_output"]
            meta = await client.get("/v2/models/ensemble")
            assert await meta.json() == ensemble_metadata("ensemble")

    serve(backend, body)


def test_refusals_carry_their_status_and_name_the_field() -> None:
    backend = ScriptedBackend(EngineProfile(Batching.INFLIGHT, 64), first_id=WORD)

    async def body(service: GenerationService, _: CoreLoop) -> None:
        async with TestClient(TestServer(_front(service).application())) as client:
            bad = await client.post(
                "/v1/completions", json={"model": "ensemble", "prompt": "Hi", "max_tokens": 0}
            )
            assert bad.status == 400 and "max_tokens" in (await bad.json())["error"]["message"]
            unknown = await client.post("/v2/models/nope/generate", json={})
            assert unknown.status == 404 and "nope" in await unknown.text()
            wrong = await client.post("/v2/models/ensemble/generate", data=b"not json")
            assert wrong.status == 400
            assert (await client.get("/no/such/path")).status == 404
            assert len(backend.calls) == 0  # nothing refused reached the engine

    serve(backend, body)

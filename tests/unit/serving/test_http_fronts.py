"""The HTTP fronts' pure parts: OpenAI bodies to generation parameters, answer shapes, the
generate extension's inputs, error shapes and status codes, and chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler_svc.contracts.generation import Delta, Final, Finish
from scheduler_svc.core.types import Urgency
from scheduler_svc.errors import (
    BadRequestError,
    ConfigError,
    OverloadedError,
    QuotaExceededError,
    ShuttingDownError,
    UnauthenticatedError,
    UnknownModelError,
    http_status,
)
from scheduler_svc.serving.chat import PLAIN, ChatTemplate, Message
from scheduler_svc.serving.fronts import openai
from scheduler_svc.serving.fronts.http import _generate_inputs, _retry_headers, openai_error
from scheduler_svc.serving.text import TextStream
from scheduler_svc.serving.tokenizer import load_tokenizer

PLAIN_CHAT = ChatTemplate(PLAIN, "plain")


def completion(**fields: object) -> openai.CompletionBody:
    body: openai.CompletionBody = openai.parse(
        openai.CompletionBody, {"model": "ensemble", "prompt": "hi", **fields}
    )
    return body


def params(body: openai.CompletionBody | openai.ChatBody, objective: Urgency | None = None):  # type: ignore[no-untyped-def]
    return openai.params_of(body, "ensemble", "id-1", objective, "", PLAIN_CHAT)


def test_openai_defaults_sample_and_temperature_zero_is_greedy() -> None:
    p = params(completion())
    assert (p.sampling.temperature, p.sampling.top_p, p.sampling.top_k, p.max_tokens) == (
        1.0,
        1.0,
        0,
        None,
    )
    p = params(completion(temperature=0, max_tokens=7, stop="\n", seed=3, ignore_eos=True))
    assert (p.sampling.temperature, p.max_tokens, p.stop, p.sampling.seed, p.end_id) == (
        0.0,
        7,
        ("\n",),
        3,
        -1,
    )
    assert params(completion(prompt=[1, 2, 3])).token_ids == (1, 2, 3)
    assert params(completion(prompt=["one"])).prompt == "one"


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"n": 3}, "n: 3 choices"),
        ({"logprobs": 2}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logprobs": True}, "logprobs: 'True'; expected 0..5"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"prompt": ["a", "b"]}, "2 prompts"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"tools": []}, "tools: unrecognized request argument"),
    ],
)
def test_what_the_engine_cannot_honour_is_refused_naming_the_field(
    fields: dict[str, object], needle: str
) -> None:
    with pytest.raises(BadRequestError, match=needle):
        params(completion(**fields))


def test_log_probs_and_penalties_go_to_the_engine() -> None:
    p = params(completion(logprobs=0, presence_penalty=0.5, frequency_penalty=-1))
    assert (p.return_log_probs, p.sampling.presence_penalty, p.sampling.frequency_penalty) == (
        True,
        0.5,
        -1.0,
    )
    assert not params(completion()).return_log_probs

    def chat(**fields: object) -> openai.ChatBody:
        body: openai.ChatBody = openai.parse(
            openai.ChatBody,
            {"model": "ensemble", "messages": [{"role": "user", "content": "hi"}], **fields},
        )
        return body

    assert params(chat(logprobs=True, top_logprobs=0)).return_log_probs
    assert not params(chat(logprobs=False)).return_log_probs
    for fields, needle in (
        ({"logprobs": True, "top_logprobs": 2}, "top_logprobs: 2; alternatives"),
        ({"top_logprobs": 0}, "top_logprobs: needs logprobs true"),
        ({"logprobs": 1}, "logprobs: expected true or false"),
    ):
        with pytest.raises(BadRequestError, match=needle):
            params(chat(**fields))


def test_log_prob_answers_have_openai_shapes() -> None:
    """The texts come from the service's one detokenizer (TextStream), not a second decode."""
    tokenizer = load_tokenizer()
    ids = tuple(tokenizer.encode(" hello world", add_special_tokens=False).ids)
    probs = tuple(-0.5 * (i + 1) for i in range(len(ids)))
    stream = TextStream(tokenizer)
    stream.push(ids)
    texts = tuple(stream.token_texts)
    done = Final("r", " hello world", ids, Finish.LENGTH, 3, len(ids), 0, 0, 0, "hot", probs, texts)
    whole = openai.Answer(False, "abc", "ensemble").whole(done)["choices"][0]
    assert "".join(whole["logprobs"]["tokens"]) == " hello world"
    assert whole["logprobs"]["token_logprobs"] == list(probs)
    offsets = whole["logprobs"]["text_offset"]
    assert offsets == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    chat = openai.Answer(True, "abc", "ensemble")
    content = chat.whole(done)["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == list(probs)
    assert bytes(b for c in content for b in c["bytes"]).decode() == " hello world"
    streamed = openai.Answer(True, "abc", "ensemble")
    chunk = streamed.chunk(Delta(" hello", ids[:1], probs[:1], texts[:1]), False)["choices"][0]
    assert chunk["logprobs"]["content"][0]["logprob"] == probs[0]
    assert "logprobs" not in chat.chunk(Delta("x", (1,)), False)["choices"][0]


def test_model_priority_and_objective() -> None:
    with pytest.raises(UnknownModelError, match="gpt"):
        params(completion(model="gpt-4o"))
    assert params(completion(priority=-1)).urgency == Urgency.INTERACTIVE
    assert params(completion(priority=0)).urgency == Urgency.STANDARD
    assert params(completion(priority=5)).urgency == Urgency.BATCH
    assert params(completion(priority=5), Urgency.INTERACTIVE).urgency == Urgency.INTERACTIVE


def test_chat_messages_render_through_the_template() -> None:
    body = openai.parse(
        openai.ChatBody,
        {
            "model": "ensemble",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            ],
            "max_completion_tokens": 9,
        },
    )
    p = params(body)
    assert p.prompt == "System: Be brief.\n\nUser: Hi\n\nAssistant:"
    assert p.max_tokens == 9
    named = ChatTemplate(
        "{% for m in messages %}{{ m.name or m.role }}/{{ m.tool_call_id }}: {{ m.content }}\n"
        "{% endfor %}",
        "test",
    )
    said = [
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "tool", "content": "42", "tool_call_id": "call-7"},
    ]
    body = openai.parse(openai.ChatBody, {"model": "ensemble", "messages": said})
    p = openai.params_of(body, "ensemble", "r", None, "", named)
    assert p.prompt == "ann/: Hi\ntool/call-7: 42\n"  # the template sees both fields
    with pytest.raises(BadRequestError, match="messages"):
        openai.parse(openai.ChatBody, {"model": "ensemble", "messages": []})
    with pytest.raises(BadRequestError, match="role"):
        openai.parse(
            openai.ChatBody, {"model": "ensemble", "messages": [{"role": "x", "content": "a"}]}
        )


def final(text: str = "ab", finish: Finish = Finish.LENGTH) -> Final:
    return Final("r", text, (1, 2), finish, 3, 2, 0.0, 0.0, 0.0, "hot")


def test_answer_shapes() -> None:
    chat = openai.Answer(True, "abc", "ensemble")
    first = chat.chunk(Delta("a", (1,)), include_usage=True)
    assert first["id"] == "chatcmpl-abc" and first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"content": "a", "role": "assistant"}
    assert first["usage"] is None
    assert chat.chunk(Delta("b", (2,)), False)["choices"][0]["delta"] == {"content": "b"}
    last = chat.chunk(final(), False)["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "length"
    assert chat.usage_chunk(final())["choices"] == []
    assert chat.usage_chunk(final())["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
    }
    whole = openai.Answer(False, "abc", "ensemble").whole(final("xy", Finish.STOP))
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == "xy"
    assert whole["choices"][0]["finish_reason"] == "stop"


def test_generate_inputs_are_checked_against_the_ensemble_contract() -> None:
    values, accumulate, priority, timeout = _generate_inputs(
        {
            "text_input": "hi",
            "max_tokens": [4],
            "stream": True,
            "temperature": 0,
            "accumulate_tokens": True,
            "parameters": {"priority": 1, "timeout": 5000},
        }
    )
    assert values == {"text_input": "hi", "max_tokens": 4, "stream": True, "temperature": 0}
    assert (accumulate, priority, timeout) == (True, 1, 5000)
    words, *_ = _generate_inputs({"stop_words": "\n", "bad_words": ["a", "b"]})
    assert words == {"stop_words": ["\n"], "bad_words": ["a", "b"]}
    with pytest.raises(BadRequestError, match="bad_words: expected a word"):
        _generate_inputs({"bad_words": [1]})
    for body, needle in (
        ({"text_input": "hi", "nope": 1}, "'nope': unknown input"),
        ({"text_input": 5}, "text_input: expected a BYTES"),
        ({"max_tokens": True}, "max_tokens: expected a INT32"),
        ({"max_tokens": 2**31}, "max_tokens: expected a INT32"),
        ({"random_seed": -1}, "random_seed: expected a UINT64"),
        ({"max_tokens": [1, 2]}, "one value per request"),
        ({"parameters": {"priority": "high"}}, "parameter priority"),
        ({"parameters": {"colour": 1}}, "colour"),
    ):
        with pytest.raises(BadRequestError, match=needle):
            _generate_inputs(body)


def test_error_statuses_shapes_and_retry_after() -> None:
    assert http_status(BadRequestError("x")) == 400
    assert http_status(UnauthenticatedError("x")) == 401
    assert http_status(UnknownModelError("x")) == 404
    assert http_status(OverloadedError("x", 0.2)) == 429
    assert http_status(ShuttingDownError("x")) == 503
    assert _retry_headers(QuotaExceededError("x", 2.2)) == {"Retry-After": "3"}
    assert _retry_headers(OverloadedError("x", 0.2)) == {"Retry-After": "1"}
    assert _retry_headers(BadRequestError("x")) == {}
    error = openai_error(400, "max_tokens: 0, allowed 1..2048", "bad_request")["error"]
    assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
    assert openai_error(503, "the backend is not ready; retry", "x")["error"]["param"] is None


def test_chat_template_from_the_tokenizer_a_file_or_plain(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    assert ChatTemplate.load(None, str(tokenizer)).origin == "plain"
    (tokenizer / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>"},
                "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]"
                "{{ m.content }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
            }
        )
    )
    own = ChatTemplate.load(None, str(tokenizer))
    assert own.render([Message("user", "hi")]) == "<s>[user]hi[assistant]"
    file = tmp_path / "t.jinja"
    file.write_text("{{ messages[0].content.__class__.__mro__ }}")
    with pytest.raises(BadRequestError, match="unsafe"):  # the sandbox
        ChatTemplate.load(str(file), str(tokenizer)).render([Message("user", "x")])
    file.write_text("{{ raise_exception('only user turns') }}")
    with pytest.raises(BadRequestError, match="only user turns"):
        ChatTemplate.load(str(file), str(tokenizer)).render([Message("user", "x")])
    with pytest.raises(ConfigError, match="chat_template"):
        ChatTemplate.load(str(tmp_path / "missing.jinja"), str(tokenizer))
    file.write_text("{% if %}")
    with pytest.raises(ConfigError, match="chat template"):
        ChatTemplate.load(str(file), str(tokenizer))
    assert ChatTemplate.load(None, "deepseek-v4").origin == "plain"  # the packaged one

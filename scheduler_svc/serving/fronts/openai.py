"""OpenAI-compatible request bodies and answers: /v1/completions and /v1/chat/completions.

Bodies are checked strictly: a field OpenAI defines that this engine cannot honour (n > 1,
top log probabilities, logit biases, ...) and a field nobody defines are both refused 400,
naming the field, rather than silently ignored. `logprobs` returns each chosen token's log
probability (chat: `logprobs: true`; completions: `logprobs: 0`); the presence and frequency
penalties go to the engine. Messages' `name` and `tool_call_id` go to the chat template as
message fields (a template that does not mention them renders as without them); `user`, the
end user's label OpenAI asks for abuse monitoring, is accepted and changes nothing. Sampling
follows OpenAI's defaults (temperature 1, top_p 1), so `temperature: 0` is greedy. The lane
comes from the vLLM-style `priority` field (negative: interactive, 0: standard, positive:
batch) or from a gateway's objective header.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from scheduler_svc.contracts.generation import Delta, Final, GenerationParams
from scheduler_svc.contracts.sampling import Sampling
from scheduler_svc.core.types import Urgency
from scheduler_svc.errors import BadRequestError, UnknownModelError, clip
from scheduler_svc.serving.chat import ChatTemplate, Message

MAX_MESSAGES = 1024
MAX_PROMPT_ITEMS = 1  # one prompt per request (n = 1, no prompt lists of several)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _StreamOptions(_Body):
    include_usage: bool = False


class _TextPart(_Body):
    type: Literal["text"]
    text: str


class _ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_call_id: str | None = Field(None, max_length=256)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


Number = Annotated[float, Field(strict=False)]  # JSON integers are numbers too


class _Common(_Body):
    """Fields both endpoints share."""

    model: str = Field(max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: _StreamOptions | None = None
    priority: int | None = None
    ignore_eos: bool = False
    user: str | None = Field(None, max_length=256)
    # Chat: true or false; completions: how many alternatives (0: the chosen token only).
    logprobs: bool | int | None = None
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Any] | None = None  # accepted empty only: no biases here


class CompletionBody(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatBody(_Common):
    messages: list[_ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None


def parse(kind: type[CompletionBody] | type[ChatBody], data: object) -> Any:
    """A body of this kind, or BadRequestError naming the first field that is wrong."""
    if not isinstance(data, dict):
        raise BadRequestError("the body must be a JSON object")
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            raise BadRequestError(f"{where[:64]}: unrecognized request argument") from None
        raise BadRequestError(f"{where[:64]}: {first['msg']}") from None


def _refuse_unsupported(body: _Common) -> None:
    def no(field: str, why: str) -> None:
        raise BadRequestError(f"{field}: {why}")

    if body.n not in (None, 1):
        no("n", f"{body.n} choices asked; this server returns one (n = 1)")
    if body.logit_bias:
        no("logit_bias", "logit biases are not applied by this engine")
    if isinstance(body, CompletionBody):
        if body.echo:
            no("echo", "the prompt is not echoed by this engine")
        if body.best_of not in (None, 1):
            no("best_of", "this server returns one choice (best_of = 1)")
        if body.suffix:
            no("suffix", "suffixes (insertion) are not supported")


def log_probs_asked(body: CompletionBody | ChatBody) -> bool:
    """Whether the body asks for each token's log probability; the alternatives OpenAI can
    also list (top_logprobs, completions' logprobs > 0) are not produced by this engine."""
    alternatives = "alternatives are not returned by this engine, only each chosen token's"
    if isinstance(body, ChatBody):
        if body.logprobs is not None and not isinstance(body.logprobs, bool):
            raise BadRequestError("logprobs: expected true or false")
        if body.top_logprobs is not None:
            if body.top_logprobs < 0 or body.top_logprobs > 20:
                raise BadRequestError(f"top_logprobs: {body.top_logprobs} is outside 0..20")
            if not body.logprobs:
                raise BadRequestError("top_logprobs: needs logprobs true")
            if body.top_logprobs:
                raise BadRequestError(f"top_logprobs: {body.top_logprobs}; {alternatives}")
        return bool(body.logprobs)
    if body.logprobs is None:
        return False
    if isinstance(body.logprobs, bool) or not 0 <= body.logprobs <= 5:
        raise BadRequestError(f"logprobs: {clip(repr(body.logprobs))}; expected 0..5")
    if body.logprobs:
        raise BadRequestError(f"logprobs: {body.logprobs}; {alternatives} (logprobs 0)")
    return True


def urgency_of(priority: int | None, objective: Urgency | None) -> Urgency:
    """The objective header (a gateway's) wins over the body's vLLM-style priority."""
    if objective is not None:
        return objective
    if priority is None or priority == 0:
        return Urgency.STANDARD
    return Urgency.INTERACTIVE if priority < 0 else Urgency.BATCH


def check_model(asked: str, served: str) -> None:
    if asked != served:
        raise UnknownModelError(
            f"model: {clip(asked)} does not exist here (this server serves '{served}')"
        )


def params_of(
    body: CompletionBody | ChatBody,
    served_model: str,
    request_id: str,
    objective: Urgency | None,
    tenant: str,
    chat: ChatTemplate | None,
) -> GenerationParams:
    check_model(body.model, served_model)
    _refuse_unsupported(body)
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    if isinstance(body, ChatBody):
        assert chat is not None
        messages = [Message(m.role, m.text(), m.name, m.tool_call_id) for m in body.messages]
        prompt = chat.render(messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
    else:
        if isinstance(body.prompt, str):
            prompt = body.prompt
        elif body.prompt and all(isinstance(p, int) for p in body.prompt):
            token_ids = tuple(int(p) for p in body.prompt)
        elif len(body.prompt) == MAX_PROMPT_ITEMS:
            prompt = str(body.prompt[0])
        else:
            raise BadRequestError(
                f"prompt: {len(body.prompt)} prompts in one request; send one per request"
            )
        max_tokens = body.max_tokens
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return GenerationParams(
        request_id=request_id,
        prompt=prompt,
        token_ids=token_ids,
        max_tokens=max_tokens,
        sampling=Sampling(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed or 0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
        ),
        end_id=-1 if body.ignore_eos else None,
        stop=stop,
        return_log_probs=log_probs_asked(body),
        urgency=urgency_of(body.priority, objective),
        tenant=tenant,
    )


# -- answers ---------------------------------------------------------------------------------


def usage(final: Final) -> dict[str, int]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }


class Answer:
    """One request's OpenAI answer objects: whole, or chunk by chunk."""

    def __init__(self, chat: bool, response_id: str, model: str) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + response_id
        self.model = model
        self.created = int(time.time())
        self._first = True
        self._offset = 0  # characters of the answer's tokens shown so far

    def _log_probs(
        self, texts: tuple[str, ...] | None, values: tuple[float, ...] | None
    ) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens, from the text each added (chat:
        `content`; completions: tokens, token_logprobs, text_offset), or None where none were
        asked."""
        if values is None or texts is None:
            return None
        offsets = []
        for text in texts:
            offsets.append(self._offset)
            self._offset += len(text)
        if self.chat:
            return {
                "content": [
                    {"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, v in zip(texts, values, strict=True)
                ]
            }
        return {
            "tokens": list(texts),
            "token_logprobs": list(values),
            "top_logprobs": None,
            "text_offset": offsets,
        }

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def whole(self, final: Final) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": final.finish.value}
        log_probs = self._log_probs(final.token_texts, final.log_probs)
        if self.chat:
            choice["message"] = {"role": "assistant", "content": final.text}
            choice["logprobs"] = log_probs
            kind = "chat.completion"
        else:
            choice.update(text=final.text, logprobs=log_probs)
            kind = "text_completion"
        answer = self._object(kind, [choice])
        answer["usage"] = usage(final)
        return answer

    def chunk(self, event: Delta | Final, include_usage: bool) -> dict[str, Any]:
        """The chunk for a delta, or the last chunk (finish_reason) for the final event."""
        finish = event.finish.value if isinstance(event, Final) else None
        text = event.text if isinstance(event, Delta) else ""
        log_probs = None
        if isinstance(event, Delta):
            log_probs = self._log_probs(event.token_texts, event.log_probs)
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text or not finish else {}
            if self._first:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            if log_probs is not None:
                choice["logprobs"] = log_probs
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": log_probs, "finish_reason": finish}
            kind = "text_completion"
        self._first = False
        answer = self._object(kind, [choice])
        if include_usage:
            answer["usage"] = None
        return answer

    def usage_chunk(self, final: Final) -> dict[str, Any]:
        """The extra last chunk `stream_options.include_usage` asks for: no choices."""
        answer = self._object("chat.completion.chunk" if self.chat else "text_completion", [])
        answer["usage"] = usage(final)
        return answer


def models_list(model: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 0, "owned_by": "scheduler_svc"}],
    }

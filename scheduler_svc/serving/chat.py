"""Chat messages to one prompt: the model's chat template.

The template is, in order: the file `model.chat_template` names; the `chat_template` the
tokenizer ships in its `tokenizer_config.json` (Hugging Face's convention, rendered with the
same variables: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`); else a plain
template of our own, one `Role: content` paragraph per message, ending `Assistant:`. The
packaged DeepSeek-V4 tokenizer ships no template, so the embedded default uses the plain one.

Templates are rendered in Jinja's immutable sandbox: a template file is configuration, but it
still gets no access to Python objects beyond the messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from scheduler_svc.errors import BadRequestError, ConfigError
from scheduler_svc.serving.tokenizer import tokenizer_path

PLAIN = (
    "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    # OpenAI's optional `name` (a participant's) and `tool_call_id` (a tool answer's): handed to
    # the template as message fields, where templates that know them look.
    name: str | None = None
    tool_call_id: str | None = None

    def fields(self) -> dict[str, str]:
        out = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # an AddedToken as tokenizer_config.json spells it
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


class ChatTemplate:
    def __init__(self, source: str, origin: str, bos: str = "", eos: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ConfigError(f"chat template ({origin}): {exc}") from None
        self.origin = origin
        self._bos, self._eos = bos, eos

    @classmethod
    def load(cls, template_file: str | None, tokenizer_dir: str) -> ChatTemplate:
        if template_file is not None:
            try:
                return cls(Path(template_file).read_text(), template_file)
            except OSError as exc:
                raise ConfigError(f"model.chat_template: {exc.strerror}: {template_file}") from None
        config = tokenizer_path(tokenizer_dir).parent / "tokenizer_config.json"
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError):
            data = {}
        source = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(source, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            return cls(PLAIN, "plain")
        return cls(
            source,
            str(config),
            _token_text(data.get("bos_token")),
            _token_text(data.get("eos_token")),
        )

    def render(self, messages: list[Message]) -> str:
        try:
            return self._template.render(
                messages=[m.fields() for m in messages],
                add_generation_prompt=True,
                bos_token=self._bos,
                eos_token=self._eos,
            )
        except TemplateError as exc:
            raise BadRequestError(f"messages: the chat template refused them: {exc}") from None


def _raise(message: str) -> None:
    raise TemplateError(message)

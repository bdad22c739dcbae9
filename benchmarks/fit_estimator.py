"""Fit the token-count estimate's weights (scheduler_svc/core/lengths.py) and measure it.

Training text, none of it in the test corpus: this repository's code and docs,
benchmarks/data/estimator_train_zh.txt (Chinese prose written for this), and Python standard
library docstrings (English). The fit minimises squared relative error, with each of the four
groups weighted equally and every weight kept >= 0 (projected gradient descent). Prints the
weights to paste into `WEIGHTS`, then the error of the current and the fitted weights on the
held-out corpus in tests/data/lengths/ (what tests/unit/core/test_policy_parts.py measures).
"""

from __future__ import annotations

import ast
import random
import re
import statistics
import sysconfig
from pathlib import Path

import numpy as np

from scheduler_svc.core import lengths
from scheduler_svc.serving.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = load_tokenizer()


def count(text: str) -> int:
    return len(TOKENIZER.encode(text, add_special_tokens=False).ids)


def chunks(text: str, size: int = 600) -> list[str]:
    out, current = [], ""
    for part in (p for p in re.split(r"\n\s*\n", text) if p.strip()):
        current = f"{current}\n\n{part}" if current else part
        if len(current) >= size:
            out.append(current)
            current = ""
    return [*out, current] if current else out


def training() -> list[list[str]]:
    code = [c for f in sorted(ROOT.glob("scheduler_svc/**/*.py")) for c in chunks(f.read_text())]
    docs = [
        c
        for f in [*sorted(ROOT.glob("docs/*.md")), ROOT / "README.md"]
        for c in chunks(f.read_text())
    ]
    chinese = chunks((ROOT / "benchmarks" / "data" / "estimator_train_zh.txt").read_text(), 150)
    prose = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(f.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 300 and ">>>" not in doc:
                    prose.append(doc)
    random.Random(0).shuffle(prose)
    return [code, docs, chinese, prose[:150]]


def fit(groups: list[list[str]]) -> dict[str, float]:
    kinds = list(lengths.WEIGHTS)
    rows, targets = [], []
    for group in groups:
        weight = (1 / len(group)) ** 0.5
        for text in group:
            exact = count(text)
            feats = lengths.features(text)
            rows.append([feats[k] / exact * weight for k in kinds])
            targets.append(weight)
    x, y = np.array(rows), np.array(targets)
    w = np.clip(np.linalg.lstsq(x, y, rcond=None)[0], 0, None)
    step = 1.0 / np.linalg.norm(x, 2) ** 2
    for _ in range(20_000):
        w = np.clip(w - step * (x.T @ (x @ w - y)), 0, None)
    return {k: round(float(v), 2) for k, v in zip(kinds, w, strict=True)}


def held_out(weights: dict[str, float]) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    every: list[float] = []
    for kind in ("en", "zh", "code", "mixed"):
        text = (ROOT / "tests" / "data" / "lengths" / f"{kind}.txt").read_text()
        samples = [s for s in text.split("\n-----\n" if kind == "code" else "\n\n") if s.strip()]
        errors = []
        for sample in samples:
            feats = lengths.features(sample)
            guess = max(1, round(sum(weights[k] * v for k, v in feats.items())))
            errors.append(abs(guess - count(sample)) / count(sample))
        every += errors
        out[kind] = (statistics.fmean(errors), _p95(errors))
    out["all"] = (statistics.fmean(every), _p95(every))
    return out


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, round(0.95 * len(ordered)) - 1)]


def main() -> None:
    fitted = fit(training())
    print("fitted WEIGHTS:", fitted)
    print("| text | current mean | current p95 | fitted mean | fitted p95 |\n|---|---|---|---|---|")
    now, new = held_out(lengths.WEIGHTS), held_out(fitted)
    for kind in now:
        (a, b), (c, d) = now[kind], new[kind]
        print(f"| {kind} | {a:.1%} | {b:.1%} | {c:.1%} | {d:.1%} |")


if __name__ == "__main__":
    main()

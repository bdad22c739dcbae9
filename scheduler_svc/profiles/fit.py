"""Fit the linear step model to measured engine steps.

step = floor + per_row * rows + per_context_token * (rows * context per row)
       + per_prompt_token * prompt tokens

fitted by least squares on the relative error (each point weighted by 1 / its time squared), so a
6 ms decode step counts as much as a 70 ms packed one, with no cost negative: a term whose fitted
cost comes out below zero (noise on a small shape) is held at zero and the rest fitted again.
The normal equations are solved on columns scaled to a largest entry of 1 (their raw scales
differ by five orders of magnitude), with partial pivoting. Standard library only;
benchmarks/gpu_profile.py fits the same way with torch, and a test checks that they agree.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

_TERMS = 4  # floor, rows, context tokens read, prompt tokens


@dataclass(frozen=True)
class StepPoint:
    """One measured step: `rows` decode rows at `context` tokens each, plus `prompt` prompt
    tokens (one chunk), took `seconds` (a median of repeats)."""

    rows: int
    context: int
    prompt: int
    seconds: float

    def features(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.rows), float(self.rows * self.context), float(self.prompt))


@dataclass(frozen=True)
class StepFit:
    floor_s: float
    per_row_s: float
    per_context_token_s: float
    per_prompt_token_s: float
    median_rel_err: float
    max_rel_err: float

    def predict(self, point: StepPoint) -> float:
        coefficients = (
            self.floor_s,
            self.per_row_s,
            self.per_context_token_s,
            self.per_prompt_token_s,
        )
        return sum(c * x for c, x in zip(coefficients, point.features(), strict=True))


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting on a small dense system."""
    n = len(rhs)
    rows = [[*matrix[i], rhs[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-300:
            raise ValueError("the measured points do not determine every term of the step model")
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            for c in range(col, n + 1):
                rows[r][c] -= factor * rows[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        known = sum(rows[r][c] * out[c] for c in range(r + 1, n))
        out[r] = (rows[r][n] - known) / rows[r][r]
    return out


def _least_squares(rows: list[list[float]], active: list[int]) -> list[float]:
    """Coefficients of the `active` terms (the others 0) minimising sum (row . c - 1)^2."""
    normal = [[sum(r[i] * r[j] for r in rows) for j in active] for i in active]
    rhs = [sum(r[i] for r in rows) for i in active]
    solved = _solve(normal, rhs)
    out = [0.0] * _TERMS
    for index, value in zip(active, solved, strict=True):
        out[index] = value
    return out


def fit_steps(points: Sequence[StepPoint]) -> StepFit:
    """The step model's four constants, and how far the points lie from it."""
    if len(points) < _TERMS:
        raise ValueError(f"need at least {_TERMS} measured steps to fit (got {len(points)})")
    if any(p.seconds <= 0 for p in points):
        raise ValueError("every measured step must take a positive time")
    features = [p.features() for p in points]
    scale = [max(abs(f[i]) for f in features) or 1.0 for i in range(_TERMS)]
    # Relative error: each row and its target (1) divided by the measured time.
    rows = [
        [f[i] / scale[i] / p.seconds for i in range(_TERMS)]
        for f, p in zip(features, points, strict=True)
    ]
    active = list(range(_TERMS))
    while True:
        solved = _least_squares(rows, active)
        negative = [i for i in active[1:] if solved[i] < 0]  # the floor is always fitted
        if not negative:
            break
        active.remove(min(negative, key=lambda i: solved[i]))
    floor_s, per_row, per_context, per_prompt = (solved[i] / scale[i] for i in range(_TERMS))
    fit = StepFit(floor_s, per_row, per_context, per_prompt, 0.0, 0.0)
    errors = [abs(fit.predict(p) - p.seconds) / p.seconds for p in points]
    return StepFit(
        floor_s,
        per_row,
        per_context,
        per_prompt,
        median_rel_err=statistics.median(errors),
        max_rel_err=max(errors),
    )

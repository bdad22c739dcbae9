"""The spec gate's result file: written by `scheduler-svc spec-gate` (tools/specgate.py), read
again by a running sidecar with `spec_gate` configured (serving/backends/groups.py), which sends
its gated lane to the speculative group only while the file says passed and is fresh enough.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

MAX_RESULT_BYTES = 64 * 1024


@dataclass(frozen=True)
class GateResult:
    passed: bool
    threshold: float
    overlap: dict[str, float]  # "1".."4" -> share of the target's n-grams the draft has
    prompts: int
    draft: str
    target: str
    at: str  # when it was measured (UTC, ISO 8601)

    @property
    def deciding(self) -> float:
        return min(self.overlap.values()) if self.overlap else 0.0


def write_result(result: GateResult, path: Path) -> None:
    """Write atomically: a sidecar reading it sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".spec-gate-")
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(result), f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def check_age(result: GateResult, max_age_s: float | None, now: datetime) -> None:
    """ValueError when the result was measured more than `max_age_s` before `now` (or says
    a time that cannot be read, or one in the future)."""
    if max_age_s is None:
        return
    try:
        measured = datetime.fromisoformat(result.at)
    except (TypeError, ValueError):
        raise ValueError(f"the result's time {result.at!r} is not an ISO 8601 time") from None
    if measured.tzinfo is None:
        measured = measured.replace(tzinfo=UTC)
    age = (now - measured).total_seconds()
    if not -300 <= age <= max_age_s:
        raise ValueError(
            f"the result was measured at {result.at}, {age / 3600:.1f} h ago; the gate trusts "
            f"one up to {max_age_s / 3600:.1f} h old (spec_gate.max_age_s): run it again"
        )


def read_result(path: str | Path) -> GateResult:
    """The gate result in `path`; ValueError says what is wrong with it."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RESULT_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    if len(raw) > MAX_RESULT_BYTES:
        raise ValueError(f"{path}: larger than {MAX_RESULT_BYTES} bytes")
    try:
        data = json.loads(raw)
        result = GateResult(**data)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: not a spec-gate result ({exc})") from None
    shares = result.overlap
    if not isinstance(result.passed, bool) or not isinstance(shares, dict):
        raise ValueError(f"{path}: not a spec-gate result (passed, overlap)")
    if not all(isinstance(v, int | float) and math.isfinite(v) for v in shares.values()):
        raise ValueError(f"{path}: an overlap is not a number")
    return result

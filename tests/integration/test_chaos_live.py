"""A small seeded chaos run (`scheduler-svc chaos` runs 155,000 cases; docs/reliability.md):
fuzzed calls on the gRPC and HTTP fronts, TLS handshakes of every kind, Triton frozen, slowed and
killed mid-stream, SIGTERM with requests queued. Every call ends with a status, none is INTERNAL
or UNKNOWN, no accepted request is lost.
"""

from __future__ import annotations

from pathlib import Path

from scheduler_svc.tools import chaos
from tests.integration.conftest import CPU_REPO


def test_a_seeded_chaos_run_meets_every_reliability_target(tmp_path: Path) -> None:
    plan = chaos.Plan(cases=384, http_cases=384, tls_cases=192, concurrency=16, streams=2, seed=7)
    phases = chaos.run(plan, CPU_REPO, tmp_path)
    by_name = {p.name: p for p in phases}
    assert list(by_name) == ["fuzz", "http", "tls", "freeze", "slow", "kill", "sigterm"]
    print(chaos.table(phases))
    for phase in phases:
        assert phase.never_ended == 0, phase.row()
        assert phase.internal_or_unknown == 0, phase.row()
        assert phase.lost == 0, phase.row()
    fuzz = by_name["fuzz"]
    assert fuzz.sent >= 384 and fuzz.accepted > 0
    assert {"OK", "INVALID_ARGUMENT", "PERMISSION_DENIED"} <= set(fuzz.statuses)
    http = by_name["http"]
    assert http.sent >= 384 and http.accepted > 0
    assert {"OK", "INVALID_ARGUMENT", "NOT_FOUND"} <= set(http.statuses)
    tls = by_name["tls"]
    # Well-formed handshakes are served; an unknown CA's client certificate, mutated hellos,
    # random bytes and plaintext are refused or closed, and the sidecar serves on.
    assert tls.statuses["OK"] > 0 and tls.statuses["TLS_REFUSED"] > 0
    assert tls.statuses["CLOSED"] > 0
    # A frozen or killed Triton: the sidecar ends every running stream itself, UNAVAILABLE.
    assert by_name["freeze"].statuses == {"UNAVAILABLE": 2}
    assert by_name["kill"].statuses == {"UNAVAILABLE": 2}
    assert by_name["slow"].statuses["OK"] == 2  # slowed, not stalled: they finish
    sigterm = by_name["sigterm"]
    assert sigterm.accepted == sigterm.sent and set(sigterm.statuses) <= {"OK", "UNAVAILABLE"}

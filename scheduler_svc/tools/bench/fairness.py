"""The tenant-fairness bench's scenarios, arrivals and figures (issue 31), shared by the live run
and the simulator's (`benchmarks/tenant_fairness.py`).

Each scenario is a set of tenants, each offering open-loop Poisson arrivals of one request kind
at a multiple of the engine's capacity (chat requests per second, measured closed loop). A
request's output length is drawn log-normal around OUTPUT_MEAN of its kind's max_tokens (at
most that), and sent as its max_tokens, as the main bench does: the engine stops there, and
answers of one length do not all end in the same step. Served
work is prompt + generated tokens of the requests that ended well; a backlogged tenant's share
is its served work over every tenant's, and its fair share its weight over the weights' sum.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from scheduler_svc.core.slo import percentile
from scheduler_svc.sim.workload import SimRequest

DURATION_S = 30.0
OUTPUT_MEAN, OUTPUT_SIGMA = 0.6, 0.5
# Issue 31's targets: a quiet tenant served >= 99 % within the hot SLO, backlogged tenants'
# served work within 10 % of their shares, the flood's total goodput within 5 % of the policy
# without fairness.
QUIET_SERVED = 0.99
SHARE_TOLERANCE = 0.10
GOODPUT_TOLERANCE = 0.05


@dataclass(frozen=True)
class TenantLoad:
    tenant: str
    load: float  # offered rate, x the engine's capacity (chat requests per second)
    prompt_tokens: int
    max_tokens: int
    weight: float = 1.0


@dataclass(frozen=True)
class FairScenario:
    name: str
    description: str
    tenants: tuple[TenantLoad, ...]
    backlogged: bool = True  # every tenant offers more than its share: shares are the target

    def weights(self) -> dict[str, float]:
        """`policy.fairness.weights` for the tenants not at the default weight."""
        return {t.tenant: t.weight for t in self.tenants if t.weight != 1.0}


SCENARIOS = (
    FairScenario(
        "flood",
        "a quiet tenant at 0.1x capacity while a noisy one floods at 3x, the same short chat "
        "requests (60 prompt tokens, max_tokens 24)",
        (TenantLoad("noisy", 3.0, 60, 24), TenantLoad("quiet", 0.1, 60, 24)),
        backlogged=False,
    ),
    FairScenario(
        "two_sizes",
        "two backlogged tenants, equal weights, 60- and 200-token prompts (max_tokens 16), "
        "the small one offering 2x capacity and the large one 1x (at 1x each the small "
        "tenant's work was only ~1.2x its share: it was not backlogged)",
        (TenantLoad("small", 2.0, 60, 16), TenantLoad("large", 1.0, 200, 16)),
    ),
    FairScenario(
        "four_sizes",
        "four backlogged tenants, equal weights, 60 or 200 prompt tokens x 16 or 64 output "
        "tokens, each offering 1x capacity",
        (
            TenantLoad("s16", 1.0, 60, 16),
            TenantLoad("l16", 1.0, 200, 16),
            TenantLoad("s64", 1.0, 60, 64),
            TenantLoad("l64", 1.0, 200, 64),
        ),
    ),
    FairScenario(
        "weighted",
        "two backlogged tenants of the same requests (60 prompt tokens, max_tokens 16) "
        "weighted 2:1, each offering 2x capacity (at 1x the heavier tenant's demand was met: "
        "it was not backlogged)",
        (TenantLoad("gold", 2.0, 60, 16, weight=2.0), TenantLoad("bronze", 2.0, 60, 16)),
    ),
)


def arrivals(
    scenario: FairScenario, capacity_rps: float, seed: int, duration_s: float = DURATION_S
) -> list[SimRequest]:
    """Every tenant's Poisson arrivals over `duration_s`, merged in arrival order."""
    out: list[SimRequest] = []
    for k, load in enumerate(scenario.tenants):
        rng = random.Random(seed * 1000 + k)
        rate = load.load * capacity_rps
        mean = OUTPUT_MEAN * load.max_tokens
        mu = math.log(mean) - OUTPUT_SIGMA**2 / 2  # so the draws' mean is `mean`
        t = rng.expovariate(rate)
        while t < duration_s:
            output = min(load.max_tokens, max(1, round(rng.lognormvariate(mu, OUTPUT_SIGMA))))
            request = SimRequest(
                f"{load.tenant}-{len(out)}", t, load.prompt_tokens, output, output, 0, load.tenant
            )
            out.append(request)
            t += rng.expovariate(rate)
    out.sort(key=lambda r: r.arrival_s)
    return out


@dataclass(frozen=True)
class Ended:
    """How one request ended, whoever ran it (live or simulated)."""

    tenant: str
    served: bool
    reason: str  # "ok", or why it was refused or failed
    ttft_s: float | None
    work: int  # prompt + generated tokens, where served


def refusal_reason(details: str) -> str:
    """The policy's reason from a refusal's message (the live run sees only the message)."""
    for needle, reason in (
        ("fair share", "pushed_out"),
        ("would start it in about", "predicted_late"),
        ("time-to-first-token target", "missed_target"),
        ("is full", "queue_full"),
    ):
        if needle in details:
            return reason
    return "other"


@dataclass(frozen=True)
class TenantRow:
    """One tenant's figures in one run."""

    offered: int
    served: int
    served_frac: float | None
    served_in_slo: int  # served with a first token within the hot SLO
    served_in_slo_frac: float | None
    refused: dict[str, int]  # by reason
    p99_ttft_ms: float | None
    work: int
    work_per_s: float
    share: float | None  # of all served work
    fair_share: float | None  # weight over the weights' sum, where every tenant is backlogged


def tenant_table(
    scenario: FairScenario, ended: Iterable[Ended], duration_s: float, slo_s: float
) -> dict[str, TenantRow]:
    """Per tenant: offered, served (and the fraction), refusals by reason, P99 TTFT, served
    work, its share of all served work and its fair share (backlogged scenarios)."""
    by: dict[str, list[Ended]] = {t.tenant: [] for t in scenario.tenants}
    for e in ended:
        by[e.tenant].append(e)
    total_work = sum(e.work for rows in by.values() for e in rows if e.served)
    total_weight = sum(t.weight for t in scenario.tenants)
    table: dict[str, TenantRow] = {}
    for load in scenario.tenants:
        rows = by[load.tenant]
        served = [e for e in rows if e.served]
        ttfts = [e.ttft_s for e in served if e.ttft_s is not None]
        p99 = percentile(ttfts, 99)
        work = sum(e.work for e in served)
        within = sum(1 for t in ttfts if t <= slo_s)
        table[load.tenant] = TenantRow(
            offered=len(rows),
            served=len(served),
            served_frac=len(served) / len(rows) if rows else None,
            served_in_slo=within,
            served_in_slo_frac=within / len(rows) if rows else None,
            refused=dict(Counter(e.reason for e in rows if not e.served)),
            p99_ttft_ms=None if p99 is None else p99 * 1000,
            work=work,
            work_per_s=work / duration_s,
            share=work / total_work if total_work else None,
            fair_share=load.weight / total_weight if scenario.backlogged else None,
        )
    return table


def share_error(table: dict[str, TenantRow]) -> float | None:
    """The largest |share / fair share - 1| over the tenants (backlogged scenarios)."""
    errors = [
        abs(row.share / row.fair_share - 1)
        for row in table.values()
        if row.fair_share is not None and row.share is not None
    ]
    return max(errors) if errors else None


def goodput(table: dict[str, TenantRow], duration_s: float) -> float:
    """Requests served within the hot SLO per second, every tenant's."""
    return sum(row.served_in_slo for row in table.values()) / duration_s

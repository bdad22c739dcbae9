"""Seeded workloads: the source document's scenarios, as arrival times and token counts.

Arrivals are fixed in advance from a Poisson process (exponential gaps) or a gamma process with
a coefficient of variation > 1 (bursty), so a slow target cannot slow the load down. Prompt and
output lengths are log-normal around each class's mean, clipped to its bounds; a request's real
output is drawn below its max_tokens. Everything comes from one `random.Random(seed)`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestClass:
    """One kind of request in a mix."""

    weight: float
    prompt_mean: int
    prompt_min: int
    prompt_max: int
    output_mean: int
    max_tokens: int
    urgency: int  # the client's priority hint: 0 interactive, 1 standard, 2 batch
    spread: float = 0.5  # sigma of the log-normal prompt length
    output_spread: float = 0.6  # sigma of the log-normal output length


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    qps: float
    duration_s: float
    classes: tuple[RequestClass, ...]
    burstiness: float = 1.0  # coefficient of variation of the gaps; 1.0 is Poisson
    tenants: int = 4


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    urgency: int
    tenant: str


CHAT = RequestClass(1.0, 128, 16, 255, 128, 512, 0)
DOC = RequestClass(1.0, 3856, 2048, 7000, 256, 512, 2, spread=0.25)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("chat", "short chat, 128 prompt tokens on average", 30.0, 30.0, (CHAT,)),
        Scenario(
            "mixed",
            "long:short = 1:3",
            15.0,
            30.0,
            (
                RequestClass(3.0, 128, 16, 255, 128, 512, 0),
                RequestClass(1.0, 1500, 1024, 4000, 256, 512, 2, 0.35),
            ),
        ),
        Scenario("long_docs", "long documents, 3,856 prompt tokens on average", 3.0, 40.0, (DOC,)),
        Scenario("burst", "a 500 QPS burst of chat", 500.0, 4.0, (CHAT,), burstiness=2.0),
        Scenario(
            "spread_8to1",
            "prompts spread 8:1 (64-512 tokens), for padding",
            30.0,
            30.0,
            (RequestClass(1.0, 180, 64, 512, 96, 256, 1, spread=0.7),),
        ),
        # KV pressure (issue 15): generous max_tokens, real outputs far shorter (log-normal,
        # sigma 0.8, as the reference engine's synthetic end of sequence).
        Scenario(
            "kv_chat",
            "chat, max_tokens 4,096, outputs ~250 tokens",
            40.0,
            30.0,
            (RequestClass(1.0, 128, 16, 255, 250, 4096, 0, output_spread=0.8),),
        ),
        Scenario(
            "kv_long",
            "long prompts (~2,000 tokens), max_tokens 4,096, outputs ~400 tokens",
            8.0,
            40.0,
            (RequestClass(1.0, 2000, 1024, 4000, 400, 4096, 2, 0.35, output_spread=0.8),),
        ),
        Scenario(
            "kv_gen",
            "long generations (~1,200 tokens, as reports or reasoning), max_tokens 4,096",
            2.0,
            400.0,
            (RequestClass(1.0, 1000, 250, 3000, 1200, 4096, 1, output_spread=0.8),),
        ),
    )
}
# The source document's scenarios (what `scheduler-svc simulate` runs by default).
DOCUMENT_SCENARIOS = ("chat", "mixed", "long_docs", "burst", "spread_8to1")
KV_SCENARIOS = ("kv_chat", "kv_long", "kv_gen")


def _lognormal(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so the mean of the draw is `mean`
    return min(hi, max(lo, round(rng.lognormvariate(mu, sigma))))


def _gaps(rng: random.Random, qps: float, burstiness: float) -> float:
    if burstiness <= 1.0:
        return rng.expovariate(qps)
    shape = 1.0 / (burstiness * burstiness)  # gamma with CV = burstiness, mean 1/qps
    return rng.gammavariate(shape, 1.0 / (qps * shape))


def generate(scenario: Scenario, seed: int, qps: float | None = None) -> list[SimRequest]:
    """The scenario's requests, in arrival order, at its rate (or `qps`)."""
    rng = random.Random(seed)
    rate = qps or scenario.qps
    weights = [c.weight for c in scenario.classes]
    out: list[SimRequest] = []
    t = 0.0
    while True:
        t += _gaps(rng, rate, scenario.burstiness)
        if t >= scenario.duration_s:
            return out
        cls = rng.choices(scenario.classes, weights)[0]
        prompt = _lognormal(rng, cls.prompt_mean, cls.spread, cls.prompt_min, cls.prompt_max)
        output = _lognormal(rng, cls.output_mean, cls.output_spread, 1, cls.max_tokens)
        out.append(
            SimRequest(
                f"r{len(out)}",
                t,
                prompt,
                cls.max_tokens,
                output,
                cls.urgency,
                f"t{rng.randrange(scenario.tenants)}",
            )
        )

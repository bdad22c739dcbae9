"""Read the engine's paged KV block counts from Triton's metrics page, for the policy's mirror.

TensorRT-LLM (and the CPU reference engine) publish
`nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free"|"max"|..., model=...}`. A poller
reads them every `kv_poll_interval_s` and hands (free, max) to a callback (the core loop's);
when the page cannot be read, nothing is handed over and the mirror turns stale by itself
(flagged in the metrics), falling back to its own accounting.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Awaitable, Callable

import structlog
from prometheus_client.parser import text_string_to_metric_families

log = structlog.get_logger("scheduler_svc.kvpoll")

FAMILY = "nv_trt_llm_kv_cache_block_metrics"


def parse_kv_blocks(text: str, model: str) -> tuple[int, int] | None:
    """(free, max) blocks of `model` on a Prometheus page, or None if it is not there."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != FAMILY:
            continue
        for sample in family.samples:
            if sample.labels.get("model", model) == model:
                found[sample.labels.get("kv_cache_block_type", "")] = sample.value
    if "free" not in found or "max" not in found or found["max"] < 1:
        return None
    return int(found["free"]), int(found["max"])


def _fetch(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return str(response.read().decode())


async def read_kv_blocks(url: str, model: str, timeout_s: float) -> tuple[int, int] | None:
    try:
        text = await asyncio.to_thread(_fetch, url, timeout_s)
    except OSError:
        return None
    return parse_kv_blocks(text, model)


async def poll_kv(
    observe: Callable[[int, int], None],
    read: Callable[[], Awaitable[tuple[int, int] | None]],
    interval_s: float,
) -> None:
    """Forever: read the counts (free, total) and hand them to `observe`."""
    failing = False
    while True:
        counts = await read()
        if counts is None:
            if not failing:
                log.warning("cannot read KV block counts; the mirror keeps its own")
            failing = True
        else:
            if failing:
                log.info("KV block counts readable again")
            failing = False
            observe(*counts)
        await asyncio.sleep(interval_s)

"""Read the engine's paged KV block counts from Triton's metrics page, for the policy's mirror.

TensorRT-LLM (and the CPU reference engine) publish
`nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free"|"max"|..., model=...}`. A poller
reads them every `kv_poll_interval_s` and hands (free, max) to a callback (the core loop's);
when the page cannot be read, nothing is handed over and the mirror turns stale by itself
(flagged in the metrics), falling back to its own accounting.
"""

from __future__ import annotations

import asyncio
import math
import urllib.request
from collections.abc import Awaitable, Callable

import structlog
from prometheus_client.parser import text_string_to_metric_families

log = structlog.get_logger("scheduler_svc.kvpoll")

FAMILY = "nv_trt_llm_kv_cache_block_metrics"


MAX_BLOCKS = 1 << 31


def parse_kv_blocks(text: str, model: str) -> tuple[int, int] | None:
    """(free, max) blocks of `model` on a Prometheus page, or None if the page does not hold
    a believable pair (not Prometheus text, NaN, infinite, negative, free above max)."""
    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name != FAMILY:
                continue
            for sample in family.samples:
                if sample.labels.get("model", model) == model:
                    found[sample.labels.get("kv_cache_block_type", "")] = float(sample.value)
    except (ValueError, TypeError, KeyError, IndexError):  # what the parser raises on junk
        return None
    free, total = found.get("free"), found.get("max")
    if free is None or total is None or not (math.isfinite(free) and math.isfinite(total)):
        return None
    if not 1 <= total <= MAX_BLOCKS or not 0 <= free <= total:
        return None
    return int(free), int(total)


MAX_PAGE_BYTES = 8 * 1024 * 1024


def _fetch(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return str(response.read(MAX_PAGE_BYTES).decode("utf-8", "replace"))


async def read_kv_blocks(url: str, model: str, timeout_s: float) -> tuple[int, int] | None:
    try:
        text = await asyncio.to_thread(_fetch, url, timeout_s)
    except (OSError, ValueError):  # unreachable, refused, a bad URL or HTTP answer
        return None
    return parse_kv_blocks(text, model)


async def poll_kv(
    observe: Callable[[int, int], None],
    read: Callable[[], Awaitable[tuple[int, int] | None]],
    interval_s: float,
) -> None:
    """Forever: read the counts (free, total) and hand them to `observe`. Nothing a page
    holds ends the poller: an unreadable one is logged once and the mirror turns stale."""
    failing = False
    while True:
        try:
            counts = await read()
        except Exception as exc:  # any surprise from a page or its transport: log, keep going
            log.warning("KV block counts unreadable", error=f"{type(exc).__name__}: {exc}"[:200])
            counts = None
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

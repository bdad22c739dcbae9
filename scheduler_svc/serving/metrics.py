"""The sidecar's Prometheus metrics, named by Prometheus conventions.

Two kinds:
- events, recorded as they happen on the core loop's task: queue wait per lane (every
  request that left the queue, immediately admitted ones included: the source document's
  `priority_queue_wait_time`), time to first token and end-to-end latency per lane, batch
  padding ratio (`batch_scheduler_padding_ratio`) and utilization per released batch, request
  outcomes, interrupted streams, reclaimed KV reservations;
- state, read at scrape time from the last snapshot the core loop took of the scheduler: queue
  depths, in-flight requests, the KV mirror (blocks, fragmentation: the document's
  `block_manager_fragmentation_rate`, staleness), the breaker, and the policy's event counters
  (rejected / degraded / demoted / requeued / promoted / mispredicted ...).

Served by prometheus-client's HTTP server thread on `server.metrics_port`. The Kubernetes
autoscaler scales on `scheduler_svc_queue_depth`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler_svc.core.policy import PolicyEvent
from scheduler_svc.core.types import BatchInfo, SchedulerStats

if TYPE_CHECKING:
    from scheduler_svc.config import ServerTls
    from scheduler_svc.serving.backends.groups import GroupView, RolloutView

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
RATIO_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# Outcomes that end a stream the client was still reading: the session interruption rate.
INTERRUPTED = frozenset(
    {"cancelled", "backend_failed", "backend_unavailable", "backend_stalled", "deadline"}
)


class SidecarMetrics:
    """Every metric of one sidecar, in its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_wait = Histogram(
            "scheduler_svc_queue_wait_seconds",
            "Time from arrival to leaving the queue (dispatched or expired), per lane.",
            ["lane"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "scheduler_svc_time_to_first_token_seconds",
            "Time from arrival to the first generated token, per lane.",
            ["lane"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "scheduler_svc_request_duration_seconds",
            "Time from arrival to the end of the answer, per lane (served requests).",
            ["lane"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.padding = Histogram(
            "scheduler_svc_batch_padding_ratio",
            "Share of a released batch's [rows x longest prompt] that is padding.",
            ["lane"],
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.utilization = Histogram(
            "scheduler_svc_batch_utilization_ratio",
            "Rows of a released batch over its lane's max batch.",
            ["lane"],
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "scheduler_svc_requests",
            "Accepted requests that ended, by lane and outcome.",
            ["lane", "outcome"],
            registry=r,
        )
        self.interrupted = Counter(
            "scheduler_svc_interrupted_streams",
            "Dispatched requests ended by cancellation or failure (session interruptions).",
            ["lane", "reason"],
            registry=r,
        )
        self.leaked = Counter(
            "scheduler_svc_leaked_reservations",
            "KV reservations found without a live request, logged and reclaimed.",
            registry=r,
        )
        self.internal_errors = Counter(
            "scheduler_svc_internal_errors",
            "Calls answered INTERNAL: an unexpected exception, logged with its error id (alert).",
            ["method"],
            registry=r,
        )
        self.refused_calls = Counter(
            "scheduler_svc_refused_calls",
            "Calls refused before any work: unauthenticated or without the role they need.",
            ["code"],
            registry=r,
        )
        self.tenant_refused = Counter(
            "scheduler_svc_tenant_quota_refusals",
            "Requests refused by their tenant's quota: configured tenants and the first seen "
            "ones by name (quotas.metric_tenants in all), the rest as other.",
            ["tenant", "quota"],
            registry=r,
        )
        # Fair shares (policy.fairness), by root tenant, labels bounded as the quota's are.
        self.tenant_tokens = Counter(
            "scheduler_svc_tenant_tokens",
            "Tokens served (prompt + generated) per root tenant and lane: a tenant's share of a "
            "lane is its rate over the lane's sum.",
            ["tenant", "lane"],
            registry=r,
        )
        self.tenant_queued = Gauge(
            "scheduler_svc_tenant_queued",
            "Requests of a root tenant waiting in the sidecar queue.",
            ["tenant"],
            registry=r,
        )
        self.tenant_refusals = Counter(
            "scheduler_svc_tenant_refusals",
            "Requests of a root tenant refused by the policy, by reason: at arrival (queue_full, "
            "predicted_late, ...), pushed out of a full lane (pushed_out), or answered from the "
            "queue (missed_target, queue_timeout, ...).",
            ["tenant", "reason"],
            registry=r,
        )
        self.stalled = Counter(
            "scheduler_svc_backend_stalls",
            "Requests ended because Triton sent nothing for triton.stall_timeout_s.",
            registry=r,
        )
        # Series at zero from the start, so alerts and dashboards see them before any event.
        for method in ("core.loop", "core.schedule"):
            self.internal_errors.labels(method)
        for code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            self.refused_calls.labels(code)
        for quota in ("concurrent", "tokens"):
            self.tenant_refused.labels("other", quota)
        self.snapshot: SchedulerStats | None = None
        self.admission: Callable[[], tuple[int, int]] = lambda: (0, 0)
        # Backend groups and the rollout, as the rollout watch last saw them (None: no groups).
        self.rollout: RolloutView | None = None
        self.registry.register(_StateCollector(self))

    def init_lanes(self, lanes: list[str]) -> None:
        """Export every per-lane series from the start (at zero), so dashboards and alerts
        see the series before the first request of a lane."""
        for lane in lanes:
            for histogram in (
                self.queue_wait,
                self.ttft,
                self.latency,
                self.padding,
                self.utilization,
            ):
                histogram.labels(lane)
            self.requests.labels(lane, "ok")
            for reason in sorted(INTERRUPTED):
                self.interrupted.labels(lane, reason)

    def observe_wait(self, lane: str, wait_s: float) -> None:
        self.queue_wait.labels(lane).observe(max(0.0, wait_s))

    def observe_batch(self, batch: BatchInfo) -> None:
        self.padding.labels(batch.lane).observe(batch.padding_ratio)
        self.utilization.labels(batch.lane).observe(batch.utilization)

    def observe_end(
        self,
        lane: str,
        outcome: str,
        dispatched: bool,
        ttft_s: float | None,
        total_s: float,
    ) -> None:
        lane = lane or "none"
        self.requests.labels(lane, outcome).inc()
        if outcome == "backend_stalled":
            self.stalled.inc()
        if ttft_s is not None:
            self.ttft.labels(lane).observe(ttft_s)
        if outcome == "ok":
            self.latency.labels(lane).observe(total_s)
        if dispatched and outcome in INTERRUPTED:
            self.interrupted.labels(lane, outcome).inc()


class _StateCollector(Collector):
    def __init__(self, metrics: SidecarMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        accepted, rejected = self.metrics.admission()
        admission = CounterMetricFamily(
            "scheduler_svc_admission",
            "Requests answered at submission, by verdict.",
            labels=["verdict"],
        )
        admission.add_metric(["accepted"], accepted)
        admission.add_metric(["rejected"], rejected)
        yield admission
        if self.metrics.rollout is not None:
            yield from _groups(self.metrics.rollout)
        stats = self.metrics.snapshot
        if stats is None:
            return
        yield from _queue(stats)
        yield from _kv(stats)
        yield GaugeMetricFamily(
            "scheduler_svc_breaker_open",
            "1 while the circuit breaker demotes traffic.",
            1.0 if stats.breaker_open else 0.0,
        )
        events = CounterMetricFamily(
            "scheduler_svc_policy_events",
            "Policy decisions by kind: rejected_*, expired_*, degraded_*, demoted, requeued, "
            "promoted, mispredicted, elastic, batches, cancelled, reconfigured.",
            labels=["event"],
        )
        counts = dict(stats.counters)
        for name in sorted({str(e) for e in PolicyEvent} | set(counts)):
            events.add_metric([name], counts.get(name, 0))
        yield events


PHASES = ("off", "canary", "hold", "done", "rolled_back")


def _groups(view: RolloutView) -> Iterator[Metric]:
    def gauge(name: str, doc: str, value: Callable[[GroupView], float]) -> Metric:
        family = GaugeMetricFamily(name, doc, labels=["group"])
        for g in view.groups:
            family.add_metric([g.group], value(g))
        return family

    yield gauge(
        "scheduler_svc_group_share_percent",
        "Percent of the rollout's current-group traffic each backend group takes now.",
        lambda g: g.share,
    )
    yield gauge(
        "scheduler_svc_group_ready", "1 while a group has a ready endpoint.", lambda g: g.ready
    )
    yield gauge(
        "scheduler_svc_group_serving",
        "1 while a group takes traffic or may at once (0: drained after a rollout).",
        lambda g: g.serving,
    )
    yield gauge(
        "scheduler_svc_group_in_flight", "Rows in flight on each group.", lambda g: g.in_flight
    )
    ended = CounterMetricFamily(
        "scheduler_svc_group_requests",
        "Rows each group ended, without error (ok) or with one (error).",
        labels=["group", "outcome"],
    )
    window = GaugeMetricFamily(
        "scheduler_svc_group_window",
        "Over the rollout window: rows ended, of which with an error, and that attained the "
        "SLO (first token within rollout.ttft_slo_s of reaching the group).",
        labels=["group", "kind"],
    )
    for g in view.groups:
        ended.add_metric([g.group, "ok"], g.ended_ok)
        ended.add_metric([g.group, "error"], g.ended_error)
        window.add_metric([g.group, "requests"], g.requests)
        window.add_metric([g.group, "errors"], g.errors)
        window.add_metric([g.group, "attained"], g.attained)
    yield ended
    yield window
    if view.candidate is not None:
        events = CounterMetricFamily(
            "scheduler_svc_rollout_events",
            "Rollout steps (operator or config), automatic rollbacks, and drains after the hold.",
            labels=["kind"],
        )
        for kind, count in sorted(view.events.items()):
            events.add_metric([kind], count)
        yield events
        phase = GaugeMetricFamily(
            "scheduler_svc_rollout_phase", "1 for the rollout's present phase.", labels=["phase"]
        )
        for name in PHASES:
            phase.add_metric([name], 1.0 if view.phase == name else 0.0)
        yield phase
        yield GaugeMetricFamily(
            "scheduler_svc_rollout_hold_seconds",
            "Seconds until the current group drains, while holding at 100 %.",
            view.hold_left_s,
        )
    if view.gate_passed is not None:
        yield GaugeMetricFamily(
            "scheduler_svc_spec_gate_passed",
            "1 while the latest speculative-decoding gate result passed (the gated lane goes "
            "to the speculative group).",
            1.0 if view.gate_passed else 0.0,
        )
        overlap = GaugeMetricFamily(
            "scheduler_svc_spec_gate_overlap_ratio",
            "The latest gate result's draft/target n-gram overlap, per n.",
            labels=["n"],
        )
        for n, share in sorted(view.gate_overlap.items()):
            overlap.add_metric([n], share)
        yield overlap


def _queue(stats: SchedulerStats) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "scheduler_svc_queue_depth", "Requests waiting in the sidecar's queue.", stats.queued
    )
    yield GaugeMetricFamily(
        "scheduler_svc_queue_capacity", "Requests the sidecar's queue may hold.", stats.max_queued
    )
    yield GaugeMetricFamily(
        "scheduler_svc_in_flight_requests",
        "Requests dispatched to a backend and not yet finished.",
        stats.in_flight,
    )
    yield GaugeMetricFamily(
        "scheduler_svc_batches_in_flight",
        "Released primary batches with a member still running (a static engine holds one per "
        "instance).",
        stats.batches_in_flight,
    )
    depth = GaugeMetricFamily(
        "scheduler_svc_lane_queue_depth", "Requests waiting, per lane.", labels=["lane"]
    )
    oldest = GaugeMetricFamily(
        "scheduler_svc_lane_oldest_wait_seconds",
        "The longest current wait, per lane.",
        labels=["lane"],
    )
    bound = GaugeMetricFamily(
        "scheduler_svc_lane_max_wait_seconds",
        "The lane's declared bound on waiting before promotion (aging).",
        labels=["lane"],
    )
    predicted = GaugeMetricFamily(
        "scheduler_svc_lane_predicted_wait_seconds",
        "What an arrival now would wait, from the lane's learned drain rate (absent until "
        "learned); predictive admission refuses past the time the lane allows.",
        labels=["lane"],
    )
    drain = GaugeMetricFamily(
        "scheduler_svc_lane_drain_tokens_per_second",
        "The lane's learned drain rate: prompt + output tokens completed per busy second.",
        labels=["lane"],
    )
    for lane in stats.lanes:
        depth.add_metric([lane.name], lane.queued)
        oldest.add_metric([lane.name], lane.oldest_wait_s)
        if lane.max_wait_s is not None:
            bound.add_metric([lane.name], lane.max_wait_s)
        if lane.predicted_wait_s is not None:
            predicted.add_metric([lane.name], lane.predicted_wait_s)
        if lane.drain_tokens_per_s is not None:
            drain.add_metric([lane.name], lane.drain_tokens_per_s)
    yield from (depth, oldest, bound, predicted, drain)


def _kv(stats: SchedulerStats) -> Iterator[Metric]:
    kv = stats.kv
    if kv is None:
        return
    blocks = GaugeMetricFamily(
        "scheduler_svc_kv_blocks",
        "The KV mirror: total, free, reserved by the sidecar's requests, used by others; the "
        "reserve new admissions leave free, and blocks owed to requests that outgrew their "
        "prediction (admissions wait while any are).",
        labels=["state"],
    )
    for state, value in (
        ("total", kv.total_blocks),
        ("free", kv.free_blocks),
        ("reserved", kv.reserved_blocks),
        ("external", kv.external_blocks),
        ("reserve", kv.reserve_blocks),
        ("owed", kv.owed_blocks),
    ):
        blocks.add_metric([state], value)
    yield blocks
    yield GaugeMetricFamily(
        "scheduler_svc_kv_cache_usage_ratio",
        "Share of the engine's KV blocks in use or reserved (0..1), as the KV mirror sees them "
        "(what a gateway's endpoint picker scores pods by).",
        1.0 - kv.free_blocks / kv.total_blocks if kv.total_blocks else 0.0,
    )
    yield GaugeMetricFamily(
        "scheduler_svc_kv_fragmentation_ratio",
        "Allocated-but-unused token slots over allocated slots, across reservations.",
        kv.fragmentation,
    )
    yield GaugeMetricFamily(
        "scheduler_svc_kv_mirror_stale",
        "1 while the backend's KV counts are missing or old (own accounting only).",
        1.0 if kv.stale else 0.0,
    )


class MetricsServer:
    """prometheus-client's HTTP server on our registry; `close` stops it."""

    def __init__(
        self, metrics: SidecarMetrics, host: str, port: int, tls: ServerTls | None = None
    ) -> None:
        """`tls`: the client port's files, read once here (a reload does not reach this
        listener; restart to rotate its certificate)."""
        self._server: WSGIServer
        self._thread: threading.Thread
        files: dict[str, Any] = {}
        if tls is not None:
            files = {
                "certfile": tls.cert_file,
                "keyfile": tls.key_file,
                "client_cafile": tls.client_ca_file,
                "client_auth_required": tls.require_client_cert,
            }
        self._server, self._thread = start_http_server(port, host, metrics.registry, **files)
        self.port = int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

"""The sidecar's Prometheus endpoint: its queue, read from the scheduler when scraped.

Served on `server.metrics_port` (off when unset) by prometheus-client's own HTTP server thread.
The collector reads the dispatcher's counters at scrape time, so the numbers are never older than
the scrape. The Kubernetes autoscaler (deploy/k8s) scales on `scheduler_svc_queue_depth`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler_svc.dispatcher import Dispatcher


class SidecarCollector(Collector):
    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def collect(self) -> Iterator[Metric]:
        stats = self.dispatcher.stats()
        yield GaugeMetricFamily(
            "scheduler_svc_queue_depth", "Requests waiting in the sidecar's queue.", stats.queued
        )
        yield GaugeMetricFamily(
            "scheduler_svc_queue_capacity",
            "Requests the sidecar's queue may hold.",
            stats.max_queued,
        )
        yield GaugeMetricFamily(
            "scheduler_svc_in_flight_requests",
            "Requests dispatched to the backend and not yet finished.",
            stats.in_flight,
        )
        admitted = CounterMetricFamily(
            "scheduler_svc_admission",
            "Requests answered at submission, by verdict.",
            labels=["verdict"],
        )
        admitted.add_metric(["accepted"], self.dispatcher.accepted)
        admitted.add_metric(["rejected"], self.dispatcher.rejected)
        yield admitted


class MetricsServer:
    """prometheus-client's HTTP server with our registry; `close` stops it."""

    def __init__(self, dispatcher: Dispatcher, host: str, port: int) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(SidecarCollector(dispatcher))
        self._server: WSGIServer
        self._thread: threading.Thread
        self._server, self._thread = start_http_server(port, host, self.registry)
        self.port = int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

"""The sidecar process: its listeners, each serving the fronts it should.

- the client port (gRPC): scheduler.v1, KServe v2, health, reflection;
- the admin listener (gRPC, loopback by default): the Admin service and KServe's repository
  and model-control calls;
- the HTTP port, where configured: the OpenAI-compatible `/v1` and Triton's generate extension;
- the metrics port: Prometheus's page (metrics.py).

Lifecycle: `start` (bind, serve, begin watching Triton's readiness) → `wait` → `drain` (health
says NOT_SERVING, new calls are refused, in-flight ones get `drain_grace_s` to finish) → done.

How listeners are made (gRPC options, TLS files, identities) is `listeners.py`; this module
binds them, swaps them on SIGHUP, and watches the backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tritonclient.grpc import service_pb2_grpc as kserve_grpc

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.config import (
    UNREAD_MAX_IN_FLIGHT,
    BackendGroup,
    SidecarConfig,
    TritonConfig,
    is_loopback,
)
from scheduler_svc.core.engine import EngineProfile
from scheduler_svc.core.fifo import FifoScheduler
from scheduler_svc.core.policy import PolicyScheduler
from scheduler_svc.core.routing import DEFAULT_GROUP
from scheduler_svc.core.types import Scheduler, Target
from scheduler_svc.errors import (
    BackendUnavailableError,
    ConfigError,
    RequestError,
    ShuttingDownError,
)
from scheduler_svc.serving.auth import ANONYMOUS_CLIENT, NOBODY
from scheduler_svc.serving.backends.base import Backend
from scheduler_svc.serving.backends.codec import is_text_contract
from scheduler_svc.serving.backends.groups import GroupedBackend, RolloutView, RolloutWatch
from scheduler_svc.serving.backends.kvpoll import poll_kv
from scheduler_svc.serving.backends.pool import TritonPool
from scheduler_svc.serving.backends.triton import TritonBackend
from scheduler_svc.serving.chat import ChatTemplate
from scheduler_svc.serving.fronts import kserve, scheduler_v1
from scheduler_svc.serving.fronts.controls import SidecarControls
from scheduler_svc.serving.fronts.guard import Guard, Identity
from scheduler_svc.serving.fronts.http import HttpFront
from scheduler_svc.serving.fronts.probes import BoundedHealth
from scheduler_svc.serving.listeners import (
    grpc_server,
    https_context,
    identities,
    tls_configuration,
)
from scheduler_svc.serving.loop import CoreLoop
from scheduler_svc.serving.metrics import MetricsServer, SidecarMetrics
from scheduler_svc.serving.rows import RowRunner, runner_for
from scheduler_svc.serving.service import DEFAULT_TEXT_MODEL, GenerationService
from scheduler_svc.serving.tokenizer import load_tokenizer

log = structlog.get_logger("scheduler_svc.server")

LIVENESS = "liveness"  # the health service name a liveness probe asks for
SERVICES = (
    scheduler_v1.SERVICE,
    pb.DESCRIPTOR.services_by_name["Admin"].full_name,
    kserve.SERVICE,
)


def make_scheduler(cfg: SidecarConfig) -> Scheduler:
    if cfg.queue.scheduler == "fifo":
        rows = cfg.queue.max_in_flight or UNREAD_MAX_IN_FLIGHT
        return FifoScheduler(cfg.queue.max_queued, rows, cfg.queue.retry_after_s)
    return PolicyScheduler(cfg.policy_config())


def other_backends(cfg: SidecarConfig) -> dict[Target, Backend]:
    """The degrade target and the elastic pool, where configured (same engine contract)."""
    out: dict[Target, Backend] = {}
    for target, endpoint in ((Target.DEGRADE, cfg.degrade), (Target.ELASTIC, cfg.elastic)):
        if endpoint is not None:
            triton = cfg.triton.model_copy(
                update={"url": endpoint.url, "engine_model": endpoint.engine_model}
            )
            out[target] = TritonBackend(triton)
    return out


def primary_backend(cfg: SidecarConfig) -> Backend:
    """The triton section's pool; with backend groups, every group behind one router."""
    main = TritonPool(cfg.triton)
    if not cfg.groups:
        return main
    pools: dict[str, Backend] = {DEFAULT_GROUP: main}
    for name, group in cfg.groups.items():
        triton = cfg.triton.model_copy(
            update={
                "url": group.url,
                "metrics_url": group.metrics_url,
                "replicas": group.replicas,
                "engine_model": group.engine_model or cfg.triton.engine_model,
            }
        )
        pools[name] = TritonPool(triton)
    return GroupedBackend(pools, cfg.router(time.monotonic()))


class Sidecar:
    def __init__(self, cfg: SidecarConfig, backend: Backend | None = None) -> None:
        self.cfg = cfg
        self.backend = backend or primary_backend(cfg)
        self.others = other_backends(cfg)
        scheduler = make_scheduler(cfg)
        metrics = SidecarMetrics()
        lanes = [lane.name for lane in scheduler.stats().lanes] or [scheduler.name]
        metrics.init_lanes(lanes)
        self.loop = CoreLoop(scheduler, metrics=metrics)
        self.service = GenerationService(cfg, load_tokenizer(cfg.model.tokenizer_dir), self.loop)
        self.health = BoundedHealth()
        self.profile: EngineProfile | None = None
        self._text_model_found = False
        self.controls = SidecarControls(
            cfg,
            self.loop,
            self.service,
            self.backend,
            self.others,
            self._on_draining,
            lambda: self.profile,
        )
        self.metrics: MetricsServer | None = None
        self.chat = ChatTemplate.load(cfg.model.chat_template, cfg.model.tokenizer_dir)
        self.http: HttpFront | None = None
        self.http_port: int | None = None
        # HTTPS: the context loaded last; the listener's own (the first) hands every handshake
        # on to it, so a SIGHUP swaps it whole.
        self._http_tls: ssl.SSLContext | None = None
        self._serving: bool | None = None
        self.port = 0
        self.admin_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._admin_server: grpc.aio.Server | None = None
        # TLS: the certificate configuration each listener should pick up at its next
        # handshake (set on SIGHUP; each listener has its own credentials object).
        self._tls_fresh: dict[str, Any] = {}
        self._client_identity = Identity(None, ANONYMOUS_CLIENT)
        self._admin_identity = Identity(None, NOBODY)
        self._watcher: asyncio.Task[None] | None = None
        self._poller: asyncio.Task[None] | None = None
        self._rollout: asyncio.Task[None] | None = None
        self.rollout_watch: RolloutWatch | None = None
        if isinstance(self.backend, GroupedBackend):
            self.rollout_watch = RolloutWatch(self.backend, cfg.spec_gate, self._publish_rollout)

    def _current_context(
        self, connection: ssl.SSLObject | ssl.SSLSocket, name: str | None, _: ssl.SSLContext
    ) -> None:
        """Every HTTPS handshake (with or without SNI) continues on the context loaded last."""
        if self._http_tls is not None:
            connection.context = self._http_tls

    def _listen(self, server: grpc.aio.Server, name: str, host: str, port: int) -> int:
        """Bind a listener: TLS where configured, except an admin listener on loopback (its
        callers are the pod's own operator and preStop, who hold no certificate)."""
        address = f"{host}:{port}"
        tls = self.cfg.server.tls
        if tls is None or (name == "admin" and is_loopback(host)):
            bound = server.add_insecure_port(address)
        else:
            credentials = grpc.dynamic_ssl_server_credentials(
                tls_configuration(self.cfg.server.tls),
                lambda: self._tls_fresh.pop(name, None),
                require_client_authentication=tls.require_client_cert,
            )
            bound = server.add_secure_port(address, credentials)
        if bound == 0:
            raise OSError(f"cannot listen on {address}")
        return bound

    def _warn_about_exposure(self) -> None:
        """Say at start what the configuration leaves open that an operator may not expect."""
        tls = self.cfg.server.tls
        if tls is not None and tls.client_ca_file and not tls.require_client_cert:
            # grpcio's server credentials either require a client certificate or never ask
            # for one: there is no "ask, but accept none" on gRPC (HTTPS has it).
            log.warning(
                "gRPC does not ask for an optional client certificate",
                detail="gRPC callers are identified by bearer token, HTTPS callers by token or "
                "certificate; server.tls.require_client_cert identifies gRPC callers by "
                "certificate too (docs/sidecar.md, TLS)",
            )
        if not is_loopback(self.cfg.server.host) and self._client_identity.anonymous.roles:
            log.warning(
                "the client port is open beyond this host to callers without a credential; "
                "set auth.credentials_file (docs/sidecar.md, Credentials and roles)",
                host=self.cfg.server.host,
            )

    async def start(self) -> int:
        """Bind and start serving; return the port (useful when the config says 0)."""
        server_cfg = self.cfg.server
        self._client_identity, self._admin_identity = identities(self.cfg)
        metrics = self.loop.metrics
        write_s = server_cfg.write_timeout_s
        self._server = grpc_server(
            self.cfg.server, Guard(lambda: self._client_identity, metrics, write_s)
        )
        admin_front = scheduler_v1.AdminFront(self.service, self.loop, self.controls)
        self._server.add_generic_rpc_handlers(
            (scheduler_v1.SchedulerFront(self.service).handler(),)
        )
        pb_grpc.add_AdminServicer_to_server(admin_front, self._server)  # type: ignore[no-untyped-call]
        kserve_grpc.add_GRPCInferenceServiceServicer_to_server(
            kserve.KServeFront(self.service, self.controls), self._server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        self.port = self._listen(self._server, "client", server_cfg.host, server_cfg.port)
        if server_cfg.admin_port is not None:
            guard = Guard(lambda: self._admin_identity, metrics, write_s)
            self._admin_server = grpc_server(self.cfg.server, guard)
            pb_grpc.add_AdminServicer_to_server(admin_front, self._admin_server)  # type: ignore[no-untyped-call]
            # Triton's repository management through tritonclient, for the local operator.
            kserve_grpc.add_GRPCInferenceServiceServicer_to_server(
                kserve.KServeFront(self.service, self.controls), self._admin_server
            )
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._admin_server)
            self.admin_port = self._listen(
                self._admin_server, "admin", server_cfg.admin_host, server_cfg.admin_port
            )
        self._warn_about_exposure()
        await self.backend.start()
        for other in self.others.values():
            await other.start()
        self.loop.start()
        # Know the backend's state (and its engine) before the first call arrives; serving
        # starts either way, and the watcher keeps looking.
        self.service.backend_ready = await self._backend_ready()
        await self._set_health(self.service.backend_ready)
        # Liveness: this process answers; it does not depend on Triton (whose engine may take
        # minutes to load), so a liveness probe on it never restarts a healthy sidecar.
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self._server.start()
        if self._admin_server is not None:
            await self._admin_server.start()
        if server_cfg.http_port is not None:
            self.http = HttpFront(self.service, lambda: self._client_identity, self.chat)
            if server_cfg.tls is not None:
                self._http_tls = https_context(self.cfg.server.tls)
                self._http_tls.sni_callback = self._current_context
            self.http_port = await self.http.start(
                server_cfg.host, server_cfg.http_port, self._http_tls
            )
        self._watcher = asyncio.create_task(self._watch_backend(), name="backend-health")
        if self.rollout_watch is not None:
            self.rollout_watch.step()  # the gate's result and the metrics before any request
            self._rollout = asyncio.create_task(self.rollout_watch.run(), name="rollout")
        triton = self.cfg.triton
        sections: list[TritonConfig | BackendGroup] = [triton, *self.cfg.groups.values()]
        if any(t.metrics_url or any(r.metrics_url for r in t.replicas) for t in sections):
            self._poller = asyncio.create_task(
                poll_kv(self.loop.observe_kv, self.backend.read_kv, triton.kv_poll_interval_s),
                name="kv-poll",
            )
        if server_cfg.metrics_port is not None:
            self.metrics = MetricsServer(
                self.loop.metrics, server_cfg.host, server_cfg.metrics_port, server_cfg.tls
            )
        log.info(
            "sidecar ready",
            port=self.port,
            admin_port=self.admin_port,
            http_port=self.http_port,
            metrics_port=self.metrics.port if self.metrics else None,
            triton=self.cfg.triton.url,
            scheduler=self.loop.scheduler.name,
            tls=server_cfg.tls is not None,
            credentials=self._client_identity.credentials is not None,
        )
        return self.port

    def reload_security(self) -> None:
        """SIGHUP: read the credentials file and the TLS files again; a file that fails to
        load leaves everything that runs as it is."""
        # Everything is loaded aside first and swapped only when all of it loaded: a bad key
        # file keeps the old credentials too, never half of the new ones.
        try:
            callers = identities(self.cfg)
            fresh = (
                tls_configuration(self.cfg.server.tls) if self.cfg.server.tls is not None else None
            )
            http_tls = https_context(self.cfg.server.tls) if self._http_tls is not None else None
        except ConfigError as exc:
            log.error("credentials / TLS reload refused; the running ones stay", error=str(exc))
            return
        self._client_identity, self._admin_identity = callers
        if fresh is not None:
            self._tls_fresh = {"client": fresh, "admin": fresh}
        if http_tls is not None:
            self._http_tls = http_tls
        log.info(
            "credentials and TLS reloaded",
            credentials=self._client_identity.credentials.size
            if self._client_identity.credentials
            else 0,
        )

    async def _backend_ready(self) -> bool:
        """Triton's readiness; the first time it is ready, its engine profile is read and the
        request path set up from it (until then the sidecar refuses with UNAVAILABLE)."""
        if not await self.backend.ready():
            return False
        self.service.engine_model = self.backend.engine_model
        if self.profile is None:
            try:
                profile = await self.backend.profile()
            except BackendUnavailableError as exc:
                log.warning("cannot read the engine's profile yet", error=str(exc))
                return False
            await self._adopt(profile)
        if self.cfg.model.kserve_model is None and not self._text_model_found:
            self._text_model_found = await self._discover_text_model()
        return True

    async def _discover_text_model(self) -> bool:
        """The model the text fronts answer for: the ready model of Triton's repository with
        the ensemble's text contract (text_input and max_tokens in, text_output out); with
        several, `ensemble` if it is one, else the first by name."""
        try:
            found = await self.controls.first_triton().models_with(is_text_contract)
        except RequestError as exc:
            log.warning("cannot discover the text model yet", error=str(exc))
            return False
        if not found:
            log.warning(
                "no model with the text contract in Triton's repository; the text fronts "
                "answer for the default name",
                model=self.service.text_model,
            )
            return True  # nothing to find; asked again only after a restart
        chosen = DEFAULT_TEXT_MODEL if DEFAULT_TEXT_MODEL in found else found[0]
        self.service.text_model = chosen
        log.info("text model discovered", model=chosen, candidates=found)
        return True

    async def _adopt(self, profile: EngineProfile) -> None:
        """Set the request path from the engine profile: the primary's batch runner, and the
        policy's batching rules (where the config does not pin them)."""
        stall = self.cfg.triton.stall_timeout_s
        runners = {Target.PRIMARY: runner_for(profile, self.backend, self.loop, stall)}
        for target, backend in self.others.items():
            runners[target] = RowRunner(backend, self.loop, stall)  # one request, one row
        self.loop.set_runners(runners)
        if isinstance(self.loop.scheduler, PolicyScheduler):
            cfg = self.cfg

            def change(scheduler: Scheduler, now: float) -> None:
                assert isinstance(scheduler, PolicyScheduler)
                new = cfg.policy_for_engine(scheduler.config, profile)
                if new != scheduler.config:
                    scheduler.reconfigure(new, now)
                if profile.kv_total_blocks is not None and profile.kv_free_blocks is not None:
                    scheduler.observe_kv(profile.kv_free_blocks, profile.kv_total_blocks, now)

            await self.loop.call(change)
        elif (
            isinstance(self.loop.scheduler, FifoScheduler) and self.cfg.queue.max_in_flight is None
        ):
            rows = profile.sequences()

            def resize(scheduler: Scheduler, now: float) -> None:
                assert isinstance(scheduler, FifoScheduler)
                scheduler.max_in_flight = rows  # as many as the engine runs

            await self.loop.call(resize)
        if isinstance(self.backend, TritonPool) and self.backend.reuses_kv:
            # Prompts share cached blocks on the engine: the KV mirror reserves the rest only.
            self.service.cached_tokens = self.backend.cached_tokens
        self.profile = profile
        log.info(
            "engine profile",
            batching=profile.batching.value,
            runner=type(runners[Target.PRIMARY]).__name__,
            max_batch_size=profile.max_batch_size,
            batches_at_once=profile.batches_at_once,
            max_num_sequences=profile.max_num_sequences,
            max_num_tokens=profile.max_num_tokens,
            kv_blocks=profile.kv_total_blocks,
            kv_cache_reuse=profile.kv_cache_reuse,
        )

    def _publish_rollout(self, view: RolloutView) -> None:
        self.loop.metrics.rollout = view

    async def _on_draining(self, draining: bool) -> None:
        await self._set_health(self.service.backend_ready and not draining)

    async def _set_health(self, serving: bool) -> None:
        if serving == self._serving:
            return  # watchers are told about changes only
        self._serving = serving
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *SERVICES):
            await self.health.set(name, status)

    async def _watch_backend(self) -> None:
        """Keep readiness current: Triton's answer, and NOT_SERVING once draining."""
        while True:
            ready = await self._backend_ready()
            if ready != self.service.backend_ready:
                log.info("backend readiness changed", ready=ready, triton=self.cfg.triton.url)
            self.service.backend_ready = ready
            await self._set_health(ready and not self.service.draining)
            await asyncio.sleep(self.cfg.triton.health_interval_s)

    async def wait(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()

    async def drain(self, grace_s: float | None = None) -> None:
        """Refuse new calls and let queued and running requests finish within `grace_s`;
        those still open a second before it ends are answered UNAVAILABLE with a retry hint
        (never a bare cancel). Then stop everything."""
        grace = self.cfg.server.drain_grace_s if grace_s is None else grace_s
        self.service.draining = True
        log.info("draining", grace_s=grace, in_flight=self.loop.stats().in_flight)
        await self._set_health(False)
        answer_s = min(1.0, grace / 2)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace - answer_s):
                await self.loop.idle()
        retry = self.cfg.queue.retry_after_s or 1.0
        expelled = await self.loop.expel(
            ShuttingDownError("the sidecar is shutting down; retry on another instance", retry)
        )
        if expelled:
            log.warning("requests still open at the end of the drain", answered=expelled)
        for server in (self._server, self._admin_server):
            if server is not None:
                await server.stop(answer_s)
        if self.http is not None:
            await self.http.close()
        for task in (self._watcher, self._poller, self._rollout):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task  # whatever ended it, the drain goes on
        await self.loop.close()
        self.service.close()
        await self.backend.close()
        for other in self.others.values():
            await other.close()
        if self.metrics is not None:
            self.metrics.close()
        log.info("stopped", accepted=self.loop.accepted, finished=dict(self.service.outcomes))

"""The sidecar's configuration: one frozen, validated model, loaded from YAML plus CLI overrides.

Every field has bounds and a description. `load_config` names the field at fault when a value is
wrong (`queue.max_queued: Input should be greater than or equal to 0`).

Over 500 lines: the schema of every section the sidecar reads (server, TLS, auth, queue, quotas,
triton, groups, routes, rollouts, the spec gate) and the `policy` section's overlay on the
core's config; the policy-for-engine rule is the core's (core/engine.py).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from scheduler_svc.core import config as core_config
from scheduler_svc.core.config import KvConfig, PolicyConfig
from scheduler_svc.core.engine import EngineProfile, Pinned, policy_for_engine
from scheduler_svc.core.routing import (
    DEFAULT_GROUP,
    RolloutConfig,
    Router,
    RouteRule,
    SpecGateConfig,
)
from scheduler_svc.errors import ConfigError

# Requests in flight until the engine's profile has been read (none is dispatched before then);
# queue.max_in_flight null follows the engine from then on.
UNREAD_MAX_IN_FLIGHT = 16


def is_loopback(host: str) -> bool:
    """Whether a listen address serves this host only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Frozen(BaseModel):
    # Strict: an integer field takes an integer (not "3", not 1.5, not true); floats are finite.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


class Replica(_Frozen):
    """One more Triton serving the same engine model as `triton.url`."""

    url: str = Field(min_length=3, description="Triton gRPC address HOST:PORT.")
    metrics_url: str | None = Field(None, description="Its metrics page, for its KV counts.")


class PrefixRouting(_Frozen):
    """Prefix affinity across `triton.replicas` (core/prefix.py): a request goes to the
    replica it sent the longest run of the prompt's leading blocks to lately, or its session's
    previous one, unless that replica has more than `slack` requests in flight above the least
    loaded one."""

    enabled: bool = Field(True, description="Route by prefix and session; false: by load only.")
    tokens_per_block: int = Field(
        16, ge=1, le=1024, description="Tokens per hashed block: the engine's KV block size."
    )
    max_blocks: int = Field(
        262_144, ge=1, le=16_777_216, description="Block keys the index keeps (oldest dropped)."
    )
    ttl_s: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description="Seconds a routed block (and a session's replica) counts as cached there.",
    )
    slack: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="Most requests in flight a replica may have above the least loaded one and "
        "still take a request for its cache (0: pure load balancing among equals); null: from "
        "the engine, one per 32 sequences a replica runs, at least 2 (256-sequence H200 "
        "profile: 8; the CPU engine's 16: 2).",
    )
    max_sessions: int = Field(
        65_536, ge=1, le=16_777_216, description="Sessions whose last replica is remembered."
    )


class TritonConfig(_Frozen):
    """Where the backend is and what it serves."""

    url: str = Field("127.0.0.1:8001", min_length=3, description="Triton gRPC address HOST:PORT.")
    engine_model: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="The model with TensorRT-LLM's tensor contract; null: discovered from "
        "Triton's repository (the ready model with input_ids, input_lengths and "
        "request_output_len in and output_ids out; `tensorrt_llm` among several).",
    )
    health_interval_s: float = Field(
        1.0, gt=0, le=60, description="Seconds between readiness checks of Triton."
    )
    connect_timeout_s: float = Field(
        5.0, gt=0, le=120, description="Seconds a readiness check or metadata call may take."
    )
    unready_after_misses: int = Field(
        3,
        ge=1,
        le=100,
        description="Readiness checks in a row that must fail (an error, or no answer within "
        "connect_timeout_s) before a Triton that was ready is marked not ready; a Triton that "
        "answers not ready is marked so at once. One missed check under load is not an outage.",
    )
    metrics_url: str | None = Field(
        None,
        description="Triton's metrics page (http://HOST:8002/metrics); its KV block counts keep "
        "the policy's KV mirror honest. Null: the mirror's own accounting only.",
    )
    kv_poll_interval_s: float = Field(
        1.0, gt=0, le=60, description="Seconds between reads of the KV block counts."
    )
    replicas: list[Replica] = Field(
        default_factory=list,
        description="More Tritons serving the same engine model: each request goes to a ready "
        "one, by prefix affinity within `prefix_routing.slack` of the least loaded (between "
        "replicas holding its prefix, one whose KV pool has room first), else the fewest "
        "requests in flight, then the most free KV blocks.",
    )
    prefix_routing: PrefixRouting = Field(
        default_factory=PrefixRouting,
        description="Prefix and session affinity across replicas (with replicas only).",
    )
    engine_batching: Literal["auto", "inflight", "static"] = Field(
        "auto",
        description="How the engine batches. auto: read from its model config at start "
        "(gpt_model_type V1 is static; anything else in-flight). Static engines get one "
        "multi-row request per released batch and as many batches at once as they run; "
        "in-flight engines get one stream per row (docs/sidecar.md).",
    )
    tls: TritonTls | None = Field(None, description="TLS to Triton; null: plaintext.")
    stall_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="A request Triton sends nothing for this long (no token, no end) ends "
        "UNAVAILABLE and frees its place, with or without a client deadline.",
    )


class TritonTls(_Frozen):
    """TLS to Triton (its `--grpc-use-ssl`); paths are read at start."""

    ca_file: str | None = Field(None, description="CA bundle that signed Triton's certificate.")
    cert_file: str | None = Field(None, description="Client certificate, where Triton wants mTLS.")
    key_file: str | None = Field(None, description="Its private key.")
    server_name: str | None = Field(
        None, description="The name Triton's certificate is checked against (default: url host)."
    )

    @model_validator(mode="after")
    def _pair(self) -> TritonTls:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("triton.tls: cert_file and key_file go together")
        return self


class BackendEndpoint(_Frozen):
    """Another Triton serving the same engine contract (the degrade target, the elastic pool)."""

    url: str = Field(min_length=3, description="Triton gRPC address HOST:PORT.")
    engine_model: str = Field("tensorrt_llm", min_length=1, description="Engine model name.")


class ModelConfig(_Frozen):
    """The model as clients see it: its tokenizer, limits and KServe names."""

    tokenizer_dir: str = Field(
        "deepseek-v4",
        description="Folder with the model's tokenizer.json; `deepseek-v4` is the packaged one.",
    )
    kserve_model: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Model name the KServe, generate and OpenAI fronts answer for (text); "
        "null: discovered from Triton's repository (the ready model with the ensemble's text "
        "contract: text_input, max_tokens in, text_output out), `ensemble` until then.",
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template file for /v1/chat/completions; null: the "
        "tokenizer's own (`chat_template` in tokenizer_config.json), else a plain one.",
    )
    max_input_tokens: int = Field(
        4096, ge=1, le=1_000_000, description="Longest prompt accepted, in tokens."
    )
    max_prompt_bytes: int | None = Field(
        None,
        ge=1,
        description="Longest prompt text accepted, in UTF-8 bytes, checked before tokenizing; "
        "null: 32 bytes per token of max_input_tokens.",
    )
    max_output_tokens: int = Field(
        1024, ge=1, le=1_000_000, description="Largest max_tokens accepted."
    )
    default_max_tokens: int = Field(128, ge=1, description="max_tokens when a request omits it.")
    add_special_tokens: bool = Field(
        True,
        description="Tokenize with the tokenizer's special tokens (BOS), as TensorRT-LLM's "
        "preprocessing does by default; must match the repository's preprocessing.",
    )
    end_id: int = Field(1, ge=-1, description="The model's end token id (-1: none).")
    stop_token_ids: list[int] = Field(
        default_factory=list,
        max_length=64,
        description="The model's other end tokens (e.g. Llama 3's <|end_of_text|> beside "
        "<|eot_id|>), sent to the engine as stop_words_list; generation ends on any of them.",
    )
    pad_id: int = Field(2, ge=0, description="The model's pad token id.")

    @model_validator(mode="after")
    def _default_within_limit(self) -> ModelConfig:
        if self.default_max_tokens > self.max_output_tokens:
            raise ValueError("default_max_tokens must not exceed max_output_tokens")
        return self

    @property
    def prompt_bytes_limit(self) -> int:
        return self.max_prompt_bytes or 32 * self.max_input_tokens


class QueueConfig(_Frozen):
    """The sidecar's own admission control."""

    scheduler: Literal["fifo", "policy"] = Field(
        "policy",
        description="policy: lanes, length buckets, KV admission (the `policy` section); fifo: "
        "the pass-through queue.",
    )
    priority_lanes: dict[str, str] = Field(
        default_factory=lambda: {"interactive": "hot", "batch": "cold"},
        description="Client priority hints that pin a lane (interactive / standard / batch -> "
        "lane name); a hint not listed lets the prompt length choose.",
    )
    max_queued: int = Field(256, ge=0, le=1_000_000, description="Requests allowed to wait.")
    max_in_flight: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="Requests dispatched to the backend at once; null: as many sequences as "
        "the engine runs (its max_num_sequences, else Triton's max_batch_size, times its "
        "instances), read from its profile.",
    )
    retry_after_s: float = Field(
        0.5, ge=0, le=3600, description="Retry hint sent with RESOURCE_EXHAUSTED."
    )
    default_queue_timeout_s: float | None = Field(
        None, gt=0, le=86400, description="Longest wait before dispatch when the client sets none."
    )


class ServerTls(_Frozen):
    """TLS on the sidecar's listeners; the files are read again on SIGHUP."""

    cert_file: str = Field(min_length=1, description="Server certificate chain (PEM).")
    key_file: str = Field(min_length=1, description="Its private key (PEM).")
    client_ca_file: str | None = Field(
        None, description="CA bundle for client certificates (mTLS); null: server TLS only."
    )
    require_client_cert: bool = Field(
        False, description="Refuse a connection without a client certificate (needs client_ca)."
    )

    @model_validator(mode="after")
    def _ca_for_required(self) -> ServerTls:
        if self.require_client_cert and self.client_ca_file is None:
            raise ValueError("server.tls.require_client_cert needs client_ca_file")
        return self


class AuthConfig(_Frozen):
    """Who may call what (docs/sidecar.md, "Credentials and roles")."""

    credentials_file: str | None = Field(
        None,
        description="YAML mapping bearer tokens and mTLS identities to a tenant and roles "
        "(client, admin); reloaded on SIGHUP. Null: no credentials.",
    )
    anonymous: Literal["auto", "client", "none"] = Field(
        "auto",
        description="What a caller without a credential may do on the client port: client "
        "(generate, tenant from the request) or none (UNAUTHENTICATED). auto: client without a "
        "credentials file, none with one. Anonymous callers are never admin there.",
    )
    local_admin: bool = Field(
        True,
        description="A caller without a credential on the admin listener is admin when that "
        "listener is bound to a loopback address (the pod's own operator).",
    )


class TenantQuota(_Frozen):
    """Limits for one tenant (or for every tenant, as `quotas.default`)."""

    max_concurrent: int | None = Field(
        None, ge=1, le=1_000_000, description="Requests queued or running at once; null: any."
    )
    tokens_per_s: float | None = Field(
        None,
        gt=0,
        le=1e9,
        description="Refill rate of the tenant's token bucket (prompt + max_tokens); null: any.",
    )
    burst_tokens: int | None = Field(
        None, ge=1, le=1_000_000_000, description="Bucket size; null: 10 s of tokens_per_s."
    )


class QuotaConfig(_Frozen):
    """Per-tenant admission limits, refused RESOURCE_EXHAUSTED with a retry hint."""

    default: TenantQuota = Field(default_factory=TenantQuota, description="Every tenant's.")
    tenants: dict[str, TenantQuota] = Field(
        default_factory=dict, description="Tenants with their own limits (by name)."
    )
    max_tenants: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="Tenants whose quota state is kept; the least recently seen go first.",
    )
    metric_tenants: int = Field(
        20, ge=0, le=1000, description="Tenants named in metric labels; the rest are 'other'."
    )


class ServerConfig(_Frozen):
    """Where the sidecar listens and how it stops."""

    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Listen address of the client port (0.0.0.0 to serve other hosts: then "
        "configure credentials).",
    )
    port: int = Field(50051, ge=0, le=65535, description="gRPC port for every service (0: free).")
    admin_host: str = Field("127.0.0.1", min_length=1, description="Admin listener address.")
    admin_port: int | None = Field(
        50052,
        ge=0,
        le=65535,
        description="A listener of its own for scheduler.v1.Admin (0: a free one); null: none. "
        "Admin on the client port always needs an admin credential.",
    )
    http_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="HTTP port for the OpenAI-compatible /v1 API and Triton's generate "
        "extension, on `host` (0: a free one); null: no HTTP listener.",
    )
    tls: ServerTls | None = Field(
        None, description="TLS on every listener (gRPC and HTTP); null: plaintext."
    )
    max_message_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, le=64 * 1024 * 1024, description="Largest request accepted."
    )
    max_request_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="Longest a request may take from arrival to its last token, whatever the "
        "client's deadline; past it, DEADLINE_EXCEEDED and its place is freed.",
    )
    write_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="How long a streamed answer may wait for a client that stopped reading.",
    )
    read_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="How long the HTTP fronts wait for a request's whole body (a client that "
        "sends it slowly holds a connection no longer); then 408.",
    )
    max_stream_requests: int = Field(
        64,
        ge=1,
        le=10_000,
        description="Requests one ModelStreamInfer stream may have unanswered at once.",
    )
    keepalive_s: float = Field(
        60.0, gt=0, le=3600, description="Keepalive ping interval on idle connections."
    )
    max_connection_age_s: float = Field(
        3600.0, gt=0, le=86400, description="Connections are closed (gracefully) after this."
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Prometheus metrics port (scheduler_svc_*); null: no endpoint, 0: a free one.",
    )
    drain_grace_s: float = Field(
        30.0, ge=0, le=3600, description="On SIGTERM, how long in-flight requests may finish."
    )
    log_level: str = Field("info", pattern="^(debug|info|warning|error)$", description="Log level.")


UrgencyName = Literal["interactive", "standard", "batch"]
# llm-d's InferenceObjective names (criticality) and plain urgency names.
_OBJECTIVES: dict[str, UrgencyName] = {
    "critical": "interactive",
    "interactive": "interactive",
    "standard": "standard",
    "sheddable": "batch",
    "batch": "batch",
}


class HttpConfig(_Frozen):
    """How the HTTP fronts read a request's lane and tenant from a gateway's headers."""

    objective_header: str = Field(
        "x-llm-d-inference-objective",
        min_length=1,
        max_length=64,
        description="Header naming the request's objective (llm-d's InferenceObjective); its "
        "value is looked up in `objectives`.",
    )
    objectives: dict[str, UrgencyName] = Field(
        default_factory=lambda: dict(_OBJECTIVES),
        description="Objective names and the urgency each maps to; an unknown name is refused "
        "400 with the known ones.",
    )
    tenant_header: str = Field(
        "x-tenant",
        min_length=1,
        max_length=64,
        description="Header naming the tenant; a credential's tenant may only be narrowed.",
    )
    session_header: str = Field(
        "x-session-id",
        min_length=1,
        max_length=64,
        description="Header naming the conversation: a rollout keeps a session on one version.",
    )
    precision_header: str = Field(
        "x-precision",
        min_length=1,
        max_length=64,
        description="Header naming the engine precision asked for (a value `routes` names).",
    )


_GROUP_NAME = r"^[a-z][a-z0-9_-]{0,31}$"


class BackendGroup(_Frozen):
    """A named group of Tritons serving one engine version (docs/operations.md)."""

    url: str = Field(min_length=3, description="Triton gRPC address HOST:PORT.")
    metrics_url: str | None = Field(None, description="Its metrics page, for its KV counts.")
    replicas: list[Replica] = Field(
        default_factory=list, max_length=64, description="More Tritons of this group."
    )
    engine_model: str | None = Field(
        None, min_length=1, description="Its engine model; null: the triton section's."
    )


class RouteRuleConfig(_Frozen):
    """Requests matching every field given go to `group` (first matching rule wins)."""

    group: str = Field(pattern=_GROUP_NAME, description="A backend group (main: `triton`).")
    lane: str | None = Field(None, min_length=1, max_length=32, description="Their lane.")
    tenant: str | None = Field(None, min_length=1, max_length=256, description="Their tenant.")
    precision: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]{1,32}$",
        description="The request's explicit `precision` field (e.g. fp16, awq).",
    )


class RolloutSection(_Frozen):
    """A canary rollout from the `current` group to the `candidate` group."""

    current: str = Field(DEFAULT_GROUP, pattern=_GROUP_NAME, description="The running version.")
    candidate: str = Field(pattern=_GROUP_NAME, description="The new version.")
    weight: int = Field(0, ge=0, le=100, description="The candidate's share at start, percent.")
    steps: list[int] = Field(
        default_factory=lambda: [10, 50, 100],
        min_length=1,
        max_length=16,
        description="The shares `rollout advance` steps through, percent.",
    )
    sticky: Literal["session", "tenant", "none"] = Field(
        "session", description="What keeps requests on one side: session (else tenant), tenant."
    )
    window_s: float = Field(300.0, gt=0, le=86_400, description="The comparison's window.")
    min_requests: int = Field(
        50, ge=1, le=1_000_000, description="Requests each side needs in the window."
    )
    ttft_slo_s: float = Field(
        1.0, gt=0, le=600, description="First token within this of reaching the group: attained."
    )
    attainment_margin: float = Field(
        0.05, ge=0, le=1, description="Roll back when the candidate's attainment is this lower."
    )
    error_margin: float = Field(
        0.02, ge=0, le=1, description="Roll back when the candidate's error rate is this higher."
    )
    hold_s: float = Field(
        3600.0, ge=0, le=7 * 86_400, description="How long the old group stays warm at 100 %."
    )
    auto_rollback: bool = Field(True, description="Roll back automatically.")

    @model_validator(mode="after")
    def _steps(self) -> RolloutSection:
        if any(not 0 < s <= 100 for s in self.steps) or self.steps != sorted(set(self.steps)):
            raise ValueError("rollout.steps: increasing percentages in 1..100")
        if self.current == self.candidate:
            raise ValueError("rollout: current and candidate are the same group")
        return self


class SpecGateSection(_Frozen):
    """Send the gated lane to a speculative-decoding group while its gate result passes."""

    group: str = Field(pattern=_GROUP_NAME, description="The speculative-decoding group.")
    lane: str = Field("cold", min_length=1, max_length=32, description="The lane it serves.")
    result_file: str = Field(
        min_length=1, description="The JSON `scheduler-svc spec-gate --out` writes."
    )
    check_interval_s: float = Field(
        30.0, gt=0, le=3600, description="How often the result file is read again."
    )
    max_age_s: float | None = Field(
        7 * 86400.0,
        gt=0,
        description="A result measured longer ago than this closes the gate (re-run the gate "
        "when either model changes); null: any age.",
    )


class SidecarConfig(_Frozen):
    """Everything `scheduler-svc serve` needs."""

    triton: TritonConfig = Field(default_factory=TritonConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    quotas: QuotaConfig = Field(default_factory=QuotaConfig)
    policy: dict[str, Any] = Field(
        default_factory=dict,
        description="Overrides of the policy's defaults (scheduler_svc/core/config.py, "
        "docs/policy.md): lanes, breaker, kv, predict, quantum_tokens, degrade_max_tokens.",
    )
    degrade: BackendEndpoint | None = Field(
        None, description="Where timed-out hot requests go (a faster model); null: none."
    )
    elastic: BackendEndpoint | None = Field(
        None, description="The overflow pool for cold requests; null: none."
    )
    groups: dict[str, BackendGroup] = Field(
        default_factory=dict,
        max_length=16,
        description="More named backend groups besides `main` (the triton section): a "
        "rollout's candidate, a precision pair, a speculative-decoding engine.",
    )
    rollout: RolloutSection | None = Field(None, description="A canary rollout; null: none.")
    routes: list[RouteRuleConfig] = Field(
        default_factory=list, max_length=64, description="Precision routes, first match wins."
    )
    spec_gate: SpecGateSection | None = Field(
        None, description="The speculative-decoding gate; null: none."
    )

    @model_validator(mode="after")
    def _anonymous_only_on_purpose(self) -> SidecarConfig:
        """Serving other hosts with no credentials is a decision, never a default."""
        auth_cfg = self.auth
        if (
            not is_loopback(self.server.host)
            and auth_cfg.credentials_file is None
            and auth_cfg.anonymous == "auto"
        ):
            raise ValueError(
                f"server.host {self.server.host} serves other hosts, and with no "
                "auth.credentials_file anyone who reaches it could generate: give credentials "
                "(auth.credentials_file, --credentials-file), or set auth.anonymous: client "
                "(--anonymous client) to serve them without credentials on purpose"
            )
        return self

    @model_validator(mode="after")
    def _groups_are_known(self) -> SidecarConfig:
        for name in self.groups:
            if name == DEFAULT_GROUP or not re.match(_GROUP_NAME, name):
                raise ValueError(
                    f"groups: {name!r} is not a group name (lowercase, not {DEFAULT_GROUP!r})"
                )
        try:
            self.router(0.0)
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        return self

    def router(self, now: float) -> Router:
        """The routing and rollout state these sections describe."""
        rollout = None
        if self.rollout is not None:
            r = self.rollout
            rollout = RolloutConfig(
                current=r.current,
                candidate=r.candidate,
                weight=r.weight,
                steps=tuple(r.steps),
                sticky=r.sticky,
                window_s=r.window_s,
                min_requests=r.min_requests,
                ttft_slo_s=r.ttft_slo_s,
                attainment_margin=r.attainment_margin,
                error_margin=r.error_margin,
                hold_s=r.hold_s,
                auto_rollback=r.auto_rollback,
            )
        gate = self.spec_gate
        return Router(
            (DEFAULT_GROUP, *self.groups),
            rollout,
            tuple(RouteRule(r.group, r.lane, r.tenant, r.precision) for r in self.routes),
            SpecGateConfig(gate.group, gate.lane) if gate is not None else None,
            now,
        )

    @model_validator(mode="after")
    def _policy_is_valid(self) -> SidecarConfig:
        names = [lane_cfg.name for lane_cfg in self.policy_config().lanes]
        for urgency, lane in self.queue.priority_lanes.items():
            if urgency not in ("interactive", "standard", "batch"):
                raise ValueError(f"queue.priority_lanes: unknown priority {urgency!r}")
            if lane not in names:
                raise ValueError(f"queue.priority_lanes.{urgency}: unknown lane {lane!r}")
        return self

    def policy_config(self) -> PolicyConfig:
        """The core's config: the `policy` section over the defaults, with the sidecar's own
        limits (queue.max_in_flight, queue.retry_after_s) where the section leaves them out."""
        defaults = PolicyConfig(
            kv=KvConfig(max_in_flight=self.queue.max_in_flight or UNREAD_MAX_IN_FLIGHT),
            retry_after_s=self.queue.retry_after_s,
            max_queued=self.queue.max_queued,
        )
        return self.policy_override(defaults, self.policy)

    def policy_for_engine(self, base: PolicyConfig, engine: EngineProfile) -> PolicyConfig:
        """`base` with what the engine's profile decides (the core's rule, `core/engine.py`),
        except what this config's `policy` section and `queue.max_in_flight` pin."""
        return policy_for_engine(base, engine, self.pinned())

    def pinned(self) -> Pinned:
        """What the `policy` section (and `queue.max_in_flight`) set, for the engine's rule."""
        kv = self.policy.get("kv")
        kv_pins = kv if isinstance(kv, Mapping) else {}
        lanes = self.policy.get("lanes")
        lane_pins = _named_lanes(lanes) if isinstance(lanes, list) else {}
        predict = self.policy.get("predict")
        return Pinned(
            max_in_flight=self.queue.max_in_flight is not None or "max_in_flight" in kv_pins,
            continuous_batching="continuous_batching" in self.policy,
            max_batches_in_flight="max_batches_in_flight" in self.policy,
            lane_targets=frozenset(
                name for name, keys in lane_pins.items() if "ttft_target_s" in keys
            ),
            prefill_budget="prefill_budget_tokens" in self.policy,
            reserve_max_tokens="reserve_max_tokens" in kv_pins,
            predict_quantile=isinstance(predict, Mapping) and "quantile" in predict,
        )

    def policy_override(self, base: PolicyConfig, changes: Mapping[str, Any]) -> PolicyConfig:
        """`base` with `changes` applied (the config file, UpdatePolicy, SIGHUP). A lane given
        by name changes only the keys it names. ValueError names the field."""
        data = _merge(
            core_config.to_mapping(base), {k: v for k, v in changes.items() if k != "lanes"}
        )
        if "lanes" in changes:
            lanes = changes["lanes"]
            if not isinstance(lanes, list):
                raise ValueError("policy.lanes: must be a list of lanes")
            current = {lane["name"]: lane for lane in data["lanes"]}
            named = _named_lanes(lanes)
            if len(named) == len(lanes) and set(named) <= set(current):
                # Only known lanes, by name: change the keys they give, keep the rest.
                data["lanes"] = [{**lane, **named.get(name, {})} for name, lane in current.items()]
            else:  # a new lane set: each lane is given whole
                data["lanes"] = lanes
        data["degrade_backend"] = self.degrade is not None
        data["elastic_backend"] = self.elastic is not None
        try:
            return core_config.from_mapping(data)
        except ValueError as exc:
            raise ValueError(f"policy.{exc}") from None


def _named_lanes(lanes: list[Any]) -> dict[str, Mapping[str, Any]]:
    """A policy section's lanes by name (entries without a name are left out): the keys each
    one gives."""
    return {
        lane["name"]: lane
        for lane in lanes
        if isinstance(lane, Mapping) and isinstance(lane.get("name"), str)
    }


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> SidecarConfig:
    """Read YAML (if given), apply nested overrides, validate; raise ConfigError naming fields."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config {path} must be a mapping at the top level")
        data = loaded or {}
    data = _merge(data, overrides or {})
    try:
        return SidecarConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            str(err["ctx"]["error"])
            if err["type"] == "value_error" and not err["loc"]
            else f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"invalid config: {problems}") from None

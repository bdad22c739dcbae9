"""The policy's configuration: frozen, validated data whose defaults are the source document's.

Every number the policy uses lives here, with its unit in its name. `__post_init__` checks bounds
and cross-field rules and raises `ValueError` naming the field at fault (`lanes[1].share: ...`).
`from_mapping` builds a config from plain nested dicts (what YAML gives the shell), refusing
unknown keys.

Defaults (the source document's "priority lanes by token length"; docs/policy.md, "Defaults"):
    lane  prompt tokens  share  max batch  queue timeout  on timeout
    hot   < 256          40 %   16         100 ms         degrade at once (fallback backend,
                                                            shorter answer, else the warm lane)
    warm  256-1023       45 %   32         500 ms         wait again, up to 2 times
    cold  >= 1024        15 %   8          none           elastic pool, else keep waiting
On an in-flight engine requests start earliest deadline first (arrival + the lane's TTFT
target) and the lane timers act at those targets: hot 250 ms, warm 350 ms, cold 1.5 s, the one
SLO rule's bounds (core/slo.py) on the CPU reference engine (unloaded 20 / 69 / 311 ms); where
the engine states its step cost (an emulated engine) the sidecar derives them from it.
SmartBatching (1.5, 50 ms); circuit breaker at a hot backlog of 50; paged KV, 16 tokens a block.
Predictive admission on: a lane refuses at arrival what its learned drain rate says cannot
start within the time the lane allows (its timeouts, requeues and degrade chain) or the
request's deadline. The lane timers are the document's A100 numbers: scale them to the engine
in use (docs/policy.md, "Timers and the engine").
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class OnTimeout(StrEnum):
    """What happens to a request still queued when its lane's queue timeout fires."""

    DEGRADE = "degrade"  # hot: the fallback backend, or a smaller max_tokens, or the next lane
    REQUEUE = "requeue"  # warm: wait again, up to max_requeues, then reject
    ELASTIC = "elastic"  # cold: hand to the elastic pool if configured, else keep waiting


class KvMode(StrEnum):
    """How the KV mirror reserves blocks for a dispatched request."""

    PAGED = "paged"  # prompt + predicted output, rounded up to blocks
    CONTIGUOUS = "contiguous"  # the model's maximum sequence length (the document's "before")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True)
class LaneConfig:
    """One priority lane: which prompts it holds and how they are batched and timed out."""

    name: str
    min_prompt_tokens: int  # lower bound (inclusive); the next lane's bound is this one's upper
    # Weight of the lane in the work-conserving split of the token budget (static engines); the
    # first lane's is also the share of rows the row guard keeps for it (in-flight engines).
    share: float
    max_batch: int  # rows per released batch
    max_queued: int  # requests allowed to wait in this lane
    queue_timeout_s: float | None  # time in queue before `on_timeout`; None: never
    on_timeout: OnTimeout
    max_requeues: int = 0  # REQUEUE lanes: times a request may wait again before rejection
    max_wait_s: float | None = None  # aging: waiting this long promotes a request; None: never
    max_ratio: float = 1.5  # SmartBatching: longest / shortest prompt in one batch
    batch_timeout_s: float = 0.05  # SmartBatching: release a batch when its oldest waited this
    # On an in-flight engine: the time to first token this lane works to. Requests are started
    # in order of arrival + this (earliest deadline first, across lanes), and the lane's
    # timeout action fires when a request has waited this long (docs/policy.md, "Deadlines").
    ttft_target_s: float = 0.25

    def validate(self, where: str) -> None:
        _check(bool(self.name), f"{where}.name", "must not be empty")
        _check(
            0 <= self.min_prompt_tokens <= 10_000_000,
            f"{where}.min_prompt_tokens",
            "must be in [0, 10000000]",
        )
        _check(0.001 <= self.share <= 1, f"{where}.share", "must be in [0.001, 1]")
        _check(1 <= self.max_batch <= 4096, f"{where}.max_batch", "must be in [1, 4096]")
        _check(0 <= self.max_queued <= 1_000_000, f"{where}.max_queued", "must be in [0, 1e6]")
        _check(
            self.queue_timeout_s is None or 0 < self.queue_timeout_s <= 86400,
            f"{where}.queue_timeout_s",
            "must be in (0, 86400] or null",
        )
        _check(0 <= self.max_requeues <= 100, f"{where}.max_requeues", "must be in [0, 100]")
        _check(
            self.max_wait_s is None or 0 < self.max_wait_s <= 86400,
            f"{where}.max_wait_s",
            "must be in (0, 86400] or null",
        )
        _check(1.0 <= self.max_ratio <= 1000, f"{where}.max_ratio", "must be in [1, 1000]")
        _check(0 <= self.batch_timeout_s <= 60, f"{where}.batch_timeout_s", "must be in [0, 60]")
        _check(0 < self.ttft_target_s <= 3600, f"{where}.ttft_target_s", "must be in (0, 3600]")


def default_lanes() -> tuple[LaneConfig, ...]:
    return (
        LaneConfig(
            "hot", 0, 0.40, 16, 512, 0.100, OnTimeout.DEGRADE, max_wait_s=0.100, ttft_target_s=0.25
        ),
        LaneConfig(
            "warm",
            256,
            0.45,
            32,
            512,
            0.500,
            OnTimeout.REQUEUE,
            2,
            max_wait_s=1.0,
            ttft_target_s=0.35,
        ),
        LaneConfig(
            "cold",
            1024,
            0.15,
            8,
            256,
            None,
            OnTimeout.ELASTIC,
            max_wait_s=5.0,
            ttft_target_s=1.5,
        ),
    )


@dataclass(frozen=True)
class BreakerConfig:
    """Demote part of one lane's arrivals while another lane's backlog is too deep."""

    watch_lane: str = "hot"
    open_above: int = 50  # opens when the watched lane holds more than this many requests
    close_below: int = 25  # closes when it holds fewer than this (hysteresis)
    min_open_s: float = 1.0  # and has stayed open at least this long
    demote_lane: str = "warm"
    to_lane: str = "cold"
    demote_fraction: float = 0.5  # share of the demoted lane's arrivals moved while open

    def validate(self) -> None:
        _check(1 <= self.open_above <= 1_000_000, "breaker.open_above", "must be in [1, 1e6]")
        _check(
            0 <= self.close_below <= self.open_above,
            "breaker.close_below",
            "must be in [0, open_above] (hysteresis)",
        )
        _check(0 <= self.min_open_s <= 3600, "breaker.min_open_s", "must be in [0, 3600]")
        _check(0 <= self.demote_fraction <= 1, "breaker.demote_fraction", "must be in [0, 1]")


@dataclass(frozen=True)
class KvConfig:
    """The mirror of the backend's paged KV pool (sizes are refreshed from its metrics)."""

    mode: KvMode = KvMode.PAGED
    tokens_per_block: int = 16
    total_blocks: int = 4096
    max_seq_len: int = 8192  # contiguous mode reserves this many tokens per request
    max_in_flight: int = 64  # sequences the backend runs at once (max_num_seqs)
    stale_after_s: float = 5.0  # an observation older than this no longer reconciles
    # Paged mode: the share of the pool new admissions leave free while other requests hold
    # blocks, for those that outgrow their predicted output before the mirror hears of it.
    reserve_fraction: float = 0.05
    # The engine reserves prompt + max_tokens at admission (TensorRT-LLM's
    # guaranteed_no_evict): the mirror reserves the same, whatever the prediction.
    reserve_max_tokens: bool = False
    # On an in-flight engine that allocates as tokens come, admit by the pool's forecast peak
    # (rows end at different times); false: by the sum of every reservation's final size.
    forecast_peak: bool = True

    def validate(self) -> None:
        _check(1 <= self.tokens_per_block <= 1024, "kv.tokens_per_block", "must be in [1, 1024]")
        _check(1 <= self.total_blocks <= 1 << 31, "kv.total_blocks", "must be in [1, 2**31]")
        _check(1 <= self.max_seq_len <= 1 << 24, "kv.max_seq_len", "must be in [1, 2**24]")
        _check(1 <= self.max_in_flight <= 1_000_000, "kv.max_in_flight", "must be in [1, 1000000]")
        _check(0 < self.stale_after_s <= 3600, "kv.stale_after_s", "must be in (0, 3600]")
        _check(0 <= self.reserve_fraction <= 0.5, "kv.reserve_fraction", "must be in [0, 0.5]")


# The output quantile reserved in front of an engine that allocates KV as tokens come
# (TensorRT-LLM's max_utilization), where the config does not choose one: many rows' outputs sum
# close to their medians, the reserve absorbs the spread and a row that outruns grows.
MEDIAN_FOR_ALLOCATING_ENGINES = 0.5


@dataclass(frozen=True)
class PredictConfig:
    """Online prediction of how much of max_tokens a request really uses."""

    quantile: float = 0.9  # reserve for this quantile of the observed used/max ratio
    min_samples: int = 16  # below this many observations, reserve all of max_tokens
    window: int = 256  # observations kept per (tenant, lane)
    max_windows: int = 4096  # (tenant, lane) windows kept; the least recently used go first

    def validate(self) -> None:
        _check(0 < self.quantile <= 1, "predict.quantile", "must be in (0, 1]")
        _check(1 <= self.min_samples <= 100_000, "predict.min_samples", "must be in [1, 1e5]")
        _check(
            self.min_samples <= self.window <= 100_000,
            "predict.window",
            "must be in [min_samples, 100000]",
        )
        _check(1 <= self.max_windows <= 1_000_000, "predict.max_windows", "must be in [1, 1e6]")


@dataclass(frozen=True)
class AdmissionConfig:
    """Predictive admission (core/admission.py): refuse at arrival what cannot start in time."""

    enabled: bool = True
    half_life_s: float = 10.0  # busy time over which a lane's drain rate is averaged
    min_busy_s: float = 0.5  # busy time seen before a lane's rate is trusted
    min_completions: int = 8  # completions seen before a lane's rate is trusted
    margin: float = 1.0  # refuse when the predicted wait exceeds margin x the time allowed
    # On an in-flight engine a first-lane arrival's wait is also the time until a row frees
    # for it, from the running rows' predicted outputs left (`PolicyScheduler.row_wait`).
    row_wait: bool = True

    def validate(self) -> None:
        _check(0.1 <= self.half_life_s <= 3600, "admission.half_life_s", "must be in [0.1, 3600]")
        _check(0 <= self.min_busy_s <= 3600, "admission.min_busy_s", "must be in [0, 3600]")
        _check(
            1 <= self.min_completions <= 100_000,
            "admission.min_completions",
            "must be in [1, 100000]",
        )
        _check(0.1 <= self.margin <= 100, "admission.margin", "must be in [0.1, 100]")


# Tenants given a weight of their own; any other weighs `default_weight`.
MAX_WEIGHTED_TENANTS = 10_000


@dataclass(frozen=True)
class FairnessConfig:
    """Work-weighted fair sharing between root tenants within a lane (core/bucketing.py's tags
    spaced by work over weight; core/policy.py's order, admission and push-out)."""

    enabled: bool = True
    default_weight: float = 1.0
    # (root tenant, weight) pairs, given in a config as a mapping {tenant: weight}.
    weights: tuple[tuple[str, float], ...] = ()

    def validate(self) -> None:
        _check(
            0.01 <= self.default_weight <= 1000,
            "fairness.default_weight",
            "must be in [0.01, 1000]",
        )
        _check(
            len(self.weights) <= MAX_WEIGHTED_TENANTS,
            "fairness.weights",
            f"at most {MAX_WEIGHTED_TENANTS} tenants",
        )
        for tenant, weight in self.weights:
            _check(0.01 <= weight <= 1000, f"fairness.weights.{tenant}", "must be in [0.01, 1000]")

    def weight_map(self) -> dict[str, float]:
        return dict(self.weights)


@dataclass(frozen=True)
class PolicyConfig:
    """Everything the policy scheduler decides by."""

    lanes: tuple[LaneConfig, ...] = field(default_factory=default_lanes)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    kv: KvConfig = field(default_factory=KvConfig)
    predict: PredictConfig = field(default_factory=PredictConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    fairness: FairnessConfig = field(default_factory=FairnessConfig)
    quantum_tokens: int = 8192  # token budget handed out per deficit-round-robin round
    max_queued: int | None = None  # requests waiting in all lanes together; None: lane caps only
    degrade_backend: bool = False  # a fallback backend exists for timed-out hot requests
    degrade_max_tokens: int | None = None  # else: retry timed-out hot requests this short
    elastic_backend: bool = False  # an overflow pool exists for cold requests
    retry_after_s: float = 0.5  # the hint sent with a rejection
    # The engine batches per iteration (TensorRT-LLM's in-flight batching): a request joins the
    # running batch at the next step, so holding a bucket back to fill it, or to keep it whole,
    # only adds waiting. Buckets are then ready at once and go in part as room frees.
    continuous_batching: bool = False
    # Engine batches allowed in flight at once; None: no limit. A static-batching engine packs
    # whatever rows wait when it frees, length-blind, so the policy keeps exactly as many
    # batches there as the engine runs at once (its instances): each engine batch is then one
    # ratio-bounded bucket, and while the engine is busy the buckets fill.
    max_batches_in_flight: int | None = None
    # In-flight engines: the later lanes' prompt tokens dispatched and not yet prefilled (no
    # first token) stay within this (a longer prompt goes alone); the first lane's are not
    # counted. The shell derives it from the engine (`prefill_budget_tokens()`); None: no bound.
    prefill_budget_tokens: int | None = None
    # In-flight engines, the prefill guard: for one drain half-life (`admission.half_life_s`)
    # after a first-lane request's first token came later than its target while more last-lane
    # prompts than this were in their context phase beside it, at most this many last-lane
    # prompts are (the engine shares a step's prompt tokens between the prompts it prefills, so
    # each long one beside a short prompt slows that prompt's prefill). None: no guard.
    prefill_guard_slots: int | None = 1

    def __post_init__(self) -> None:
        _check(len(self.lanes) >= 1, "lanes", "need at least one lane")
        for i, lane in enumerate(self.lanes):
            lane.validate(f"lanes[{i}]")
        names = [lane.name for lane in self.lanes]
        _check(len(set(names)) == len(names), "lanes", f"names must be unique: {names}")
        _check(self.lanes[0].min_prompt_tokens == 0, "lanes[0].min_prompt_tokens", "must be 0")
        bounds = [lane.min_prompt_tokens for lane in self.lanes]
        _check(bounds == sorted(set(bounds)), "lanes", "min_prompt_tokens must increase")
        self.breaker.validate()
        for key in ("watch_lane", "demote_lane", "to_lane"):
            value = getattr(self.breaker, key)
            _check(value in names, f"breaker.{key}", f"unknown lane {value!r}")
        self.kv.validate()
        self.predict.validate()
        self.admission.validate()
        self.fairness.validate()
        _check(1 <= self.quantum_tokens <= 1 << 30, "quantum_tokens", "must be in [1, 2**30]")
        _check(
            self.max_queued is None or 0 <= self.max_queued <= 1_000_000,
            "max_queued",
            "must be in [0, 1000000] or null",
        )
        _check(
            self.degrade_max_tokens is None or 1 <= self.degrade_max_tokens <= 1_000_000,
            "degrade_max_tokens",
            "must be in [1, 1000000] or null",
        )
        _check(0 <= self.retry_after_s <= 3600, "retry_after_s", "must be in [0, 3600]")
        _check(
            self.max_batches_in_flight is None or 1 <= self.max_batches_in_flight <= 4096,
            "max_batches_in_flight",
            "must be in [1, 4096] or null",
        )
        _check(
            self.prefill_budget_tokens is None or 1 <= self.prefill_budget_tokens <= 1 << 24,
            "prefill_budget_tokens",
            "must be in [1, 2**24] or null",
        )
        _check(
            self.prefill_guard_slots is None or 1 <= self.prefill_guard_slots <= 4096,
            "prefill_guard_slots",
            "must be in [1, 4096] or null",
        )

    def lane(self, name: str) -> LaneConfig:
        for lane in self.lanes:
            if lane.name == name:
                return lane
        raise KeyError(name)


_NESTED: dict[str, type] = {
    "breaker": BreakerConfig,
    "kv": KvConfig,
    "predict": PredictConfig,
    "admission": AdmissionConfig,
    "fairness": FairnessConfig,
}
_ENUMS: dict[str, type[StrEnum]] = {"on_timeout": OnTimeout, "mode": KvMode}


def _build(cls: type, data: Mapping[str, Any], where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where or '(top)'}: must be a mapping")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    _check(not unknown, where or "(top)", f"unknown keys {unknown}")
    values: dict[str, Any] = {}
    for key, raw in data.items():
        values[key] = _field(cls, key, raw, f"{where}.{key}" if where else key)
    try:
        return cls(**values)
    except TypeError as exc:  # a required field left out
        raise ValueError(f"{where or '(top)'}: {exc}") from None


def _field(cls: type, key: str, raw: Any, name: str) -> Any:
    if key in _ENUMS:
        try:
            return _ENUMS[key](raw)
        except ValueError:
            choices = [e.value for e in _ENUMS[key]]
            raise ValueError(f"{name}: {raw!r} is not one of {choices}") from None
    if key in _NESTED and cls is PolicyConfig:
        return _build(_NESTED[key], raw, name)
    if key == "weights" and cls is FairnessConfig:
        if not isinstance(raw, Mapping):
            raise ValueError(f"{name}: must be a mapping of tenant to weight")
        if len(raw) > MAX_WEIGHTED_TENANTS:
            raise ValueError(f"{name}: at most {MAX_WEIGHTED_TENANTS} tenants")
        pairs = []
        for key_raw, weight in raw.items():
            tenant = _typed(str, key_raw, f"{name} key")
            pairs.append((tenant, _typed(float, weight, f"{name}.{tenant}")))
        return tuple(sorted(pairs))
    if key == "lanes" and cls is PolicyConfig:
        if not isinstance(raw, list | tuple):
            raise ValueError(f"{name}: must be a list of lanes")
        if len(raw) > MAX_LANES:
            raise ValueError(f"{name}: at most {MAX_LANES} lanes")
        return tuple(_build(LaneConfig, v, f"{name}[{i}]") for i, v in enumerate(raw))
    return _typed(typing.get_type_hints(cls)[key], raw, name)


MAX_LANES = 16
MAX_NAME_CHARS = 64


def _typed(hint: Any, raw: Any, name: str) -> Any:
    """`raw` checked against a scalar field's type: an int is an int (not a bool, not 1.5), a
    float is a finite number, a bool is a bool, a str is a short str; None only where allowed."""
    kinds = typing.get_args(hint) or (hint,)
    if raw is None:
        if type(None) in kinds:
            return None
        raise ValueError(f"{name}: must not be null")
    if isinstance(raw, bool):
        if bool in kinds:
            return raw
        raise ValueError(f"{name}: must be {_kind(kinds)}, not a boolean")
    if int in kinds and isinstance(raw, int):
        return raw
    if float in kinds and isinstance(raw, int | float):
        if not math.isfinite(raw):
            raise ValueError(f"{name}: must be a finite number")
        return float(raw)
    if str in kinds and isinstance(raw, str):
        if len(raw) > MAX_NAME_CHARS:
            raise ValueError(f"{name}: at most {MAX_NAME_CHARS} characters")
        return raw
    raise ValueError(f"{name}: must be {_kind(kinds)}, got {type(raw).__name__}")


def _kind(kinds: tuple[Any, ...]) -> str:
    names = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}
    words = [names[k] for k in kinds if k in names]
    if type(None) in kinds:
        words.append("null")
    return " or ".join(words) or "a value"


def from_mapping(data: Mapping[str, Any]) -> PolicyConfig:
    """Build and validate a PolicyConfig from plain nested data; ValueError names the field."""
    config: PolicyConfig = _build(PolicyConfig, data, "")
    return config


def to_mapping(config: PolicyConfig) -> dict[str, Any]:
    """Plain nested data (enums as strings) that `from_mapping` turns back into `config`."""

    def plain(value: Any) -> Any:
        if isinstance(value, StrEnum):
            return value.value
        if isinstance(value, FairnessConfig):
            return {
                "enabled": value.enabled,
                "default_weight": value.default_weight,
                "weights": value.weight_map(),
            }
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return value

    result: dict[str, Any] = plain(config)
    return result

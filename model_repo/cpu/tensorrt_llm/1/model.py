"""Triton Python-backend adapter for the CPU reference engine (`reference_engine`).

Speaks TensorRT-LLM's `tensorrt_llm` contract: decoupled, one response per row (with
`batch_index`), new tokens per response when streaming, all tokens at the end otherwise; a
request with `stop=true` ends the in-flight request with the same id. Statistics are exported
on Triton's metrics port under TensorRT-LLM's metric names. The same file serves the emulated
engine (`timing: emulated`, model_repo/emulated): only the engine behind it differs.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
import threading
import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from reference_engine.config import EngineConfig
from reference_engine.contract import parse_request
from reference_engine.engine import EngineStats, build_engine
from reference_engine.errors import EngineError
from reference_engine.request import EngineRequest, RunningSequence

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _Handle:
    """What the sink needs to answer one Triton request."""

    def __init__(self, request: Any, sender: Any, triton_id: str) -> None:
        self.request = request
        self.sender = sender
        self.triton_id = triton_id


def _error(message: str, code: str) -> Any:
    return pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))


class _Metrics:
    """TensorRT-LLM's metric families, plus the reference engine's token counters."""

    def __init__(self, cfg: EngineConfig, model: str, version: str) -> None:
        labels = {"model": model, "version": version}
        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        # A MetricFamily must outlive its Metrics, so every family is kept here.
        self._families: list[Any] = []

        def new_family(name: str, doc: str, kind: Any) -> Any:
            fam = pb_utils.MetricFamily(name=name, description=doc, kind=kind)
            self._families.append(fam)
            return fam

        def family(name: str, doc: str, label: str, values: list[str]) -> dict[str, Any]:
            fam = new_family(name, doc, gauge)
            return {v: fam.Metric(labels={label: v, **labels}) for v in values}

        self.requests = family(
            "nv_trt_llm_request_metrics",
            "TRT LLM request metrics",
            "request_type",
            ["active", "max", "scheduled", "context", "waiting"],
        )
        self.kv = family(
            "nv_trt_llm_kv_cache_block_metrics",
            "TRT LLM KV cache block metrics",
            "kv_cache_block_type",
            # alloc_total, alloc_new and reused as TensorRT-LLM's backend names them: blocks
            # handed out since start (blank or shared), of them blank, and shared from cache.
            ["max", "free", "used", "tokens_per", "fraction", "alloc_total", "alloc_new", "reused"],
        )
        if cfg.batching_strategy == "inflight":
            self.batcher = family(
                "nv_trt_llm_inflight_batcher_metrics",
                "TRT LLM inflight_batcher-specific metrics",
                "inflight_batcher_specific_metric",
                [
                    "total_context_tokens",
                    "generation_requests",
                    "micro_batch_id",
                    "paused_requests",
                ],
            )
        else:
            self.batcher = family(
                "nv_trt_llm_v1_metrics",
                "TRT LLM v1-specific metrics",
                "v1_specific_metric",
                ["total_context_tokens", "total_generation_tokens", "empty_generation_slots"],
            )
        self.general = family(
            "nv_trt_llm_general_metrics",
            "General TRT LLM metrics",
            "general_type",
            ["iteration_counter", "timestamp"],
        )
        tokens = new_family(
            "scheduler_svc_engine_tokens_total",
            "Tokens the CPU reference engine pushed through the model "
            "(processed) and those that belonged to a real row (useful); padding is the gap",
            counter,
        )
        self.tokens = {
            (phase, kind): tokens.Metric(labels={"phase": phase, "kind": kind, **labels})
            for phase in ("context", "generation")
            for kind in ("processed", "useful")
        }
        self.paused_total = new_family(
            "scheduler_svc_engine_paused_requests_total",
            "Requests the CPU reference engine paused to free KV blocks",
            counter,
        ).Metric(labels=labels)
        ended = new_family(
            "scheduler_svc_engine_requests_ended_early_total",
            "Requests the CPU reference engine ended before they were done, by how: "
            "a stop request, a client cancellation, or a failure",
            counter,
        )
        self.ended = {
            how: ended.Metric(labels={"how": how, **labels})
            for how in ("stopped", "cancelled", "failed")
        }
        self.rows_total = new_family(
            "scheduler_svc_engine_step_rows_total",
            "Sequences the reference engine ran, summed over its iterations "
            "(rows per step: this over nv_trt_llm_general_metrics iteration_counter)",
            counter,
        ).Metric(labels=labels)
        self.overruns = self.paced = self.work = None
        if cfg.timing == "emulated":
            self.overruns = new_family(
                "scheduler_svc_engine_step_overruns_total",
                "Emulated steps whose real work outlasted their modelled time x time_scale "
                "(a benchmark with more than 1 % of them is invalid)",
                counter,
            ).Metric(labels=labels)
            self.paced = new_family(
                "scheduler_svc_engine_step_paced_seconds_total",
                "Wall seconds the emulated steps were held to (modelled time x time_scale)",
                counter,
            ).Metric(labels=labels)
            self.work = new_family(
                "scheduler_svc_engine_step_work_seconds_total",
                "Wall seconds of the engine's own work inside its emulated steps (its headroom: "
                "this over scheduler_svc_engine_step_paced_seconds_total)",
                counter,
            ).Metric(labels=labels)
        self.cached_tokens = new_family(
            "scheduler_svc_engine_kv_cached_tokens",
            "Token slots of the used KV blocks that hold a key; the rest are allocated but unused",
            gauge,
        ).Metric(labels=labels)
        self.reusable_blocks = new_family(
            "scheduler_svc_engine_kv_reusable_blocks",
            "KV blocks holding a cached prompt prefix (held or idle) that a later prompt starting "
            "with the same tokens can reuse (enable_kv_cache_reuse); our own name",
            gauge,
        ).Metric(labels=labels)
        prompt = new_family(
            "scheduler_svc_engine_prompt_tokens_total",
            "Prompt tokens the reference engine admitted (kind=admitted, recomputes included) "
            "and those of them served from cached KV blocks (kind=reused), with "
            "enable_kv_cache_reuse; the hit rate is reused over admitted; our own name",
            counter,
        )
        self.prompt_tokens = {
            kind: prompt.Metric(labels={"kind": kind, **labels}) for kind in ("admitted", "reused")
        }
        self._last: dict[str, int] = {}
        self._sent: dict[str, float] = {}
        self._shown: dict[int, float] = {}

    def publish(self, s: EngineStats) -> None:
        for name, value in (
            ("active", s.active_requests),
            ("max", s.max_requests),
            ("scheduled", s.scheduled_requests),
            ("context", s.context_requests),
            ("waiting", s.waiting_requests),
        ):
            self._set(self.requests[name], value)
        self._set(self.kv["max"], s.kv_max_blocks)
        self._set(self.kv["free"], s.kv_free_blocks)
        self._set(self.kv["used"], s.kv_used_blocks)
        self._set(self.kv["tokens_per"], s.tokens_per_block)
        self._set(self.cached_tokens, s.kv_cached_tokens)
        self._set(self.kv["fraction"], s.kv_used_blocks / s.kv_max_blocks)
        self._set(self.kv["alloc_total"], s.kv_alloc_total_blocks)
        self._set(self.kv["alloc_new"], s.kv_alloc_new_blocks)
        self._set(self.kv["reused"], s.kv_reused_blocks)
        self._set(self.reusable_blocks, s.kv_reusable_blocks)
        if "paused_requests" in self.batcher:
            self._set(self.batcher["total_context_tokens"], s.total_context_tokens)
            self._set(self.batcher["generation_requests"], s.generation_requests)
            self._set(self.batcher["micro_batch_id"], 0)
            self._set(self.batcher["paused_requests"], s.paused_requests)
        else:
            self._set(self.batcher["total_context_tokens"], s.total_context_tokens)
            self._set(self.batcher["total_generation_tokens"], s.generation_requests)
            self._set(self.batcher["empty_generation_slots"], s.empty_generation_slots)
        self._set(self.general["iteration_counter"], s.iteration)
        self._set(self.general["timestamp"], int(time.time()))
        c = s.counts
        for key, value in (
            (("context", "processed"), c.context_processed),
            (("context", "useful"), c.context_useful),
            (("generation", "processed"), c.generation_processed),
            (("generation", "useful"), c.generation_useful),
        ):
            self._bump(self.tokens[key], "/".join(key), value)
        self._bump(self.paused_total, "paused", c.paused_total)
        self._bump(self.ended["stopped"], "stopped", c.stopped_total)
        self._bump(self.ended["cancelled"], "cancelled", c.cancelled_total)
        self._bump(self.ended["failed"], "failed", c.failed_total)
        self._bump(self.rows_total, "rows", s.rows_total)
        self._bump(self.prompt_tokens["admitted"], "prompt/admitted", c.prompt_tokens_admitted)
        self._bump(self.prompt_tokens["reused"], "prompt/reused", c.prompt_tokens_reused)
        if self.overruns is not None:
            self._bump(self.overruns, "overruns", s.overrun_steps)
            self._add(self.paced, "paced", s.paced_s)
            self._add(self.work, "work", s.work_s)

    def _set(self, metric: Any, value: float) -> None:
        """Set a gauge only when it changed: each set is a round trip to the Triton process."""
        if self._shown.get(id(metric)) != value:
            metric.set(value)
            self._shown[id(metric)] = value

    def _bump(self, metric: Any, name: str, total: int) -> None:
        delta = total - self._last.get(name, 0)
        if delta > 0:
            metric.increment(delta)
        self._last[name] = total

    def _add(self, metric: Any, name: str, total: float) -> None:
        """A counter of seconds: increments of whole milliseconds, the rest carried over."""
        delta = round(total - self._sent.get(name, 0.0), 3)
        if delta >= 0.001:
            metric.increment(delta)
            self._sent[name] = self._sent.get(name, 0.0) + delta


def _log_to_stderr() -> None:
    """The engine's own warnings go to stderr, which is Triton's log: through a plain file,
    so a report about a stuck call into the server cannot itself wait on that server."""
    logger = logging.getLogger("reference_engine")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("reference engine %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        model_config = json.loads(args["model_config"])
        params = {
            key: value["string_value"] for key, value in model_config.get("parameters", {}).items()
        }
        self.cfg = EngineConfig.from_parameters(params)
        _log_to_stderr()
        self.metrics = _Metrics(self.cfg, args["model_name"], args["model_version"])
        self._ids = itertools.count()
        self._by_triton_id: dict[str, set[str]] = {}
        self._ids_lock = threading.Lock()
        self.engine = build_engine(self.cfg, self)
        self.engine.start()
        timing = "the model on this CPU"
        if self.cfg.timing == "emulated":
            timing = f"emulated {self.cfg.cost_profile} x {self.cfg.time_scale:g}"
        pb_utils.Logger.log_info(
            f"reference engine ready: {self.cfg.batching_strategy} batching, "
            f"{self.cfg.batch_scheduler_policy}, {self.cfg.num_blocks} KV blocks of "
            f"{self.cfg.tokens_per_block} tokens, {self.cfg.max_num_sequences} sequences, "
            f"timing: {timing}"
        )

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._accept(request, sender)
            except EngineError as exc:
                sender.send(
                    pb_utils.InferenceResponse(error=_error(str(exc), exc.code)), flags=_FINAL
                )
            except Exception as exc:  # never let one request take the instance down
                sender.send(
                    pb_utils.InferenceResponse(error=_error(f"unexpected: {exc!r}", "INTERNAL")),
                    flags=_FINAL,
                )

    def _accept(self, request: Any, sender: Any) -> None:
        tensors = {t.name(): t.as_numpy() for t in request.inputs()}
        parsed = parse_request(tensors, self.cfg)
        triton_id = request.request_id()
        if parsed.stop:
            with self._ids_lock:
                keys = sorted(self._by_triton_id.get(triton_id, ()))
            for key in keys:
                self.engine.stop(key)
            sender.send(flags=_FINAL)
            return
        key = f"{triton_id}#{next(self._ids)}"
        with self._ids_lock:
            self._by_triton_id.setdefault(triton_id, set()).add(key)
        try:
            self.engine.submit(
                key,
                parsed.rows,
                streaming=parsed.streaming,
                sampling=parsed.sampling,
                handle=_Handle(request, sender, triton_id),
            )
        except EngineError:
            self._forget(triton_id, key)
            raise

    def _forget(self, triton_id: str, key: str) -> None:
        with self._ids_lock:
            keys = self._by_triton_id.get(triton_id)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_triton_id[triton_id]

    # -- Sink --------------------------------------------------------------------------------

    def emit(
        self,
        request: EngineRequest,
        seq: RunningSequence,
        tokens: list[int],
        log_probs: list[float] | None,
        final: bool,
    ) -> None:
        if not request.streaming and not self.cfg.exclude_input_in_output:
            tokens = list(seq.prompt) + tokens
        outputs = [
            pb_utils.Tensor("output_ids", np.asarray(tokens, dtype=np.int32).reshape(1, 1, -1)),
            pb_utils.Tensor("sequence_length", np.asarray([[len(tokens)]], dtype=np.int32)),
            pb_utils.Tensor("batch_index", np.asarray([[seq.row]], dtype=np.int32)),
            pb_utils.Tensor("sequence_index", np.asarray([[0]], dtype=np.int32)),  # one beam
        ]
        if log_probs is not None:
            # TensorRT-LLM's layout, one beam: this response's tokens' log probabilities
            # [1, 1, n], and the row's running sum over every token generated so far [1, 1].
            outputs += [
                pb_utils.Tensor(
                    "output_log_probs", np.asarray(log_probs, dtype=np.float32).reshape(1, 1, -1)
                ),
                pb_utils.Tensor(
                    "cum_log_probs", np.asarray([[sum(seq.log_probs)]], dtype=np.float32)
                ),
            ]
        handle: _Handle = request.handle  # type: ignore[assignment]
        handle.sender.send(
            pb_utils.InferenceResponse(output_tensors=outputs), flags=_FINAL if final else 0
        )
        if final:
            self._forget(handle.triton_id, request.key)

    def close(self, request: EngineRequest) -> None:
        handle: _Handle = request.handle  # type: ignore[assignment]
        handle.sender.send(flags=_FINAL)
        self._forget(handle.triton_id, request.key)

    def fail(self, request: EngineRequest, error: EngineError) -> None:
        handle: _Handle = request.handle  # type: ignore[assignment]
        handle.sender.send(
            pb_utils.InferenceResponse(error=_error(str(error), error.code)), flags=_FINAL
        )
        self._forget(handle.triton_id, request.key)

    def is_cancelled(self, request: EngineRequest) -> bool:
        handle: _Handle = request.handle  # type: ignore[assignment]
        return bool(handle.sender.is_cancelled())

    def publish(self, stats: EngineStats) -> None:
        self.metrics.publish(stats)

    def finalize(self) -> None:
        self.engine.shutdown()

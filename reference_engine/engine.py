"""The engine loop: one thread that owns the batcher and the model runner.

Any thread may `submit` (answered at once: queued, or an `EngineError`) or `stop` a request.
The loop then repeats: apply stops and client cancellations, plan an iteration, run the model
(outside the lock, so intake never waits on a forward pass), commit the sampled tokens, and hand
each row's output to the `Sink`, which speaks the server's protocol (Triton, or a test list).
Under emulated timing (engine/emulated.py) the model is a token source and a `StepPacer` holds
each iteration, from the top of its turn, to the cost profile's time for it.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from reference_engine.batcher import Batcher, Plan, Sampled, TokenCounts, Update, Work
from reference_engine.config import EngineConfig
from reference_engine.emulated import StepPacer, TokenSource
from reference_engine.errors import EngineError
from reference_engine.request import (
    EngineRequest,
    FinishReason,
    RowSpec,
    RunningSequence,
    Sampling,
)

_IDLE_POLL_S = 0.05
# A turn of the loop takes one forward pass at most (well under a second here); one that has
# not come round for this long is stuck, and the watchdog writes every thread's stack out.
_STALL_S = 15.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics, named after TensorRT-LLM's statistics."""

    kv_max_blocks: int
    kv_free_blocks: int
    kv_used_blocks: int
    tokens_per_block: int
    kv_cached_tokens: int  # slots holding valid keys; the rest of the used blocks is unused
    active_requests: int
    max_requests: int
    scheduled_requests: int
    context_requests: int
    waiting_requests: int
    paused_requests: int
    total_context_tokens: int
    generation_requests: int
    empty_generation_slots: int
    iteration: int
    counts: TokenCounts
    rows_total: int = 0  # sequences run, summed over iterations (rows per step = / iteration)
    overrun_steps: int = 0  # emulated steps whose real work outlasted their modelled time
    # Emulated timing: the steps' modelled time x time_scale, and the engine's own work in it.
    paced_s: float = 0.0
    work_s: float = 0.0
    # KV cache reuse (blocks.py), cumulative: blocks handed out (blank or shared), blank ones,
    # shared cached ones; and the blocks cached now (held or idle: what a prompt can reuse).
    kv_alloc_total_blocks: int = 0
    kv_alloc_new_blocks: int = 0
    kv_reused_blocks: int = 0
    kv_reusable_blocks: int = 0


class Sink(Protocol):
    """Where the engine's answers go."""

    def emit(
        self,
        request: EngineRequest,
        seq: RunningSequence,
        tokens: list[int],
        log_probs: list[float] | None,
        final: bool,
    ) -> None:
        """Send one row's tokens (new ones when streaming, all of them otherwise), with their
        log probabilities where the row asked for them (None otherwise)."""

    def close(self, request: EngineRequest) -> None:
        """End a request that has nothing more to say (cancelled or stopped while streaming)."""

    def fail(self, request: EngineRequest, error: EngineError) -> None:
        """End a request with an error."""

    def is_cancelled(self, request: EngineRequest) -> bool:
        """Whether the client has gone away."""

    def publish(self, stats: EngineStats) -> None:
        """Receive fresh statistics."""


class Runner(Protocol):
    def step(self, works: tuple[Work, ...], tables: list[list[int]]) -> Sampled: ...


def _log_probs(seq: RunningSequence, values: Iterable[float]) -> list[float] | None:
    return list(values) if seq.return_log_probs else None


class Engine:
    """Drives a `Batcher` and a model runner on a background thread."""

    def __init__(
        self,
        cfg: EngineConfig,
        sink: Sink,
        runner: Callable[[], Runner],
        pacer: StepPacer | None = None,
    ) -> None:
        self.cfg = cfg
        self._pacer = pacer
        self._sink = sink
        self._runner_factory = runner
        self._batcher = Batcher(cfg)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stops: list[str] = []
        self._closing = False
        self._iteration = 0
        self._rows_total = 0
        self._last_publish = 0.0
        self._published: EngineStats | None = None
        self._last_plan = Plan(())
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._beat = time.monotonic()
        self._watchdog = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)

    def start(self) -> None:
        self._runner = self._runner_factory()
        self._thread.start()
        self._watchdog.start()

    def submit(
        self,
        key: str,
        rows: list[RowSpec],
        *,
        streaming: bool,
        sampling: Sampling,
        handle: object,
    ) -> EngineRequest:
        """Queue a request or raise the `EngineError` that rejects it."""
        with self._wake:
            request = self._batcher.add(
                key, rows, streaming=streaming, sampling=sampling, handle=handle
            )
            self._wake.notify()
        return request

    def stop(self, key: str) -> None:
        """Ask the loop to end request `key` at the next iteration (TensorRT-LLM's `stop`)."""
        with self._wake:
            self._stops.append(key)
            self._wake.notify()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats()

    # -- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closing:
            try:
                self._turn()
            except Exception as exc:  # the loop must outlive any one failure
                log.exception("engine loop failed; failing every request in flight")
                self._fail_everything(EngineError(f"engine loop failed: {exc!r}"))
                time.sleep(_IDLE_POLL_S)
        self._fail_everything(EngineError("the engine is shutting down"))

    def _watch(self) -> None:
        """Report a loop that stopped turning (blocked in a call into the server, or dead)."""
        reported = False
        while not self._closing:
            time.sleep(1.0)
            stalled_s = time.monotonic() - self._beat
            if stalled_s < _STALL_S:
                reported = False
            elif not reported:
                reported = True
                alive = self._thread.is_alive()
                log.error(
                    "engine loop has not turned for %.0f s (thread %s); stacks follow",
                    stalled_s,
                    "alive" if alive else "dead",
                )
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    def _turn(self) -> None:
        """One pass of the loop: intake, plan, run, deliver."""
        self._beat = time.monotonic()
        if self._pacer is not None:
            self._pacer.begin()  # the step's time runs from here
        with self._lock:
            in_flight = self._batcher.requests
        # Asking the server about clients is I/O: never done while holding the lock.
        gone = {r.key for r in in_flight if self._client_gone(r)}
        with self._wake:
            if self._closing:
                return
            ended = self._apply_stops_and_cancels(gone)
            plan = self._batcher.schedule()
            tables = [self._batcher.pool.table(w.seq.seq_id) for w in plan.works]
        self._report_ended(ended)
        if plan.works:
            self._iterate(plan, tables)
            return
        self._last_plan = plan
        if self._pacer is not None:
            self._pacer.idle()
        self._maybe_publish(force=True)
        with self._wake:
            # Sleep only if nothing arrived since `schedule` looked: a submit in between has
            # already notified, and waiting now would sit out the whole poll interval.
            if not self._closing and not self._stops and self._batcher.idle():
                self._wake.wait(_IDLE_POLL_S)

    def _iterate(self, plan: Plan, tables: list[list[int]]) -> None:
        try:
            sampled = self._runner.step(plan.works, tables)
        except Exception as exc:  # a model bug must not take the instance down
            self._fail_everything(EngineError(f"engine step failed: {exc!r}"))
            return
        if self._pacer is not None:
            self._pacer.finish(plan.works)  # the GPU's time for this step has passed
        with self._lock:
            updates = self._batcher.commit(plan, sampled.tokens, sampled.log_probs)
            self._iteration += 1
            self._rows_total += len(plan.works)
            self._last_plan = plan
        self._deliver(updates)
        self._maybe_publish(force=False)

    def _client_gone(self, request: EngineRequest) -> bool:
        try:
            return self._sink.is_cancelled(request)
        except Exception:  # a request the server cannot tell us about is one nobody awaits
            log.exception("could not ask whether request %s was cancelled; ending it", request.key)
            return True

    def _guard(self, request: EngineRequest, call: Callable[..., None], *args: object) -> bool:
        """Hand one answer to the sink. One request the sink cannot answer (its client or its
        server side is gone) must not stop the loop: that request is ended and its blocks freed,
        and everyone else carries on. Returns whether the answer went out."""
        try:
            call(request, *args)
            return True
        except Exception:
            log.exception("could not answer request %s; ending it", request.key)
            with self._lock:
                self._batcher.cancel(request.key, FinishReason.FAILED)
            return False

    def _apply_stops_and_cancels(self, gone: set[str]) -> list[tuple[EngineRequest, FinishReason]]:
        """End stopped requests and those whose client went away; caller holds the lock."""
        ended: list[tuple[EngineRequest, FinishReason]] = []
        stops, self._stops = self._stops, []
        for keys, reason in ((stops, FinishReason.STOPPED), (sorted(gone), FinishReason.CANCELLED)):
            for key in keys:
                request = self._batcher.cancel(key, reason)
                if request is not None:
                    ended.append((request, reason))
        return ended

    def _report_ended(self, ended: list[tuple[EngineRequest, FinishReason]]) -> None:
        for request, reason in ended:
            pending = [s for s in request.rows if s.finish == reason]
            if reason == FinishReason.STOPPED and not request.streaming and pending:
                # A stopped non-streaming request still gets what it produced so far.
                for i, seq in enumerate(pending):
                    final = i == len(pending) - 1
                    tokens, probs = list(seq.generated), _log_probs(seq, seq.log_probs)
                    if not self._guard(request, self._sink.emit, seq, tokens, probs, final):
                        break
            else:
                self._guard(request, self._sink.close)

    def _deliver(self, updates: list[Update]) -> None:
        by_request: dict[str, list[Update]] = {}
        for update in updates:
            by_request.setdefault(update.seq.request.key, []).append(update)
        for batch in by_request.values():
            request = batch[0].seq.request
            if request.streaming:
                messages = [
                    (u.seq, list(u.new_tokens), _log_probs(u.seq, u.new_log_probs))
                    for u in batch
                    if u.new_tokens
                ]
            else:
                messages = [
                    (u.seq, list(u.seq.generated), _log_probs(u.seq, u.seq.log_probs))
                    for u in batch
                    if u.row_finished
                ]
            if request.done and not messages:
                # A final answer must carry the FINAL flag.
                seq = batch[-1].seq
                messages = [(seq, [], _log_probs(seq, ()))]
            for i, (seq, tokens, probs) in enumerate(messages):
                final = request.done and i == len(messages) - 1
                if not self._guard(request, self._sink.emit, seq, tokens, probs, final):
                    break

    def _fail_everything(self, error: EngineError) -> None:
        with self._lock:
            requests = self._batcher.requests
            for request in requests:
                self._batcher.cancel(request.key, FinishReason.FAILED)
        for request in requests:
            try:
                self._sink.fail(request, error)
            except Exception:  # already ended above; nothing more can be said to it
                log.exception("could not fail request %s", request.key)

    def _maybe_publish(self, force: bool) -> None:
        now = time.monotonic()
        if not force and (now - self._last_publish) * 1000 < self.cfg.metrics_interval_ms:
            return
        stats = self.stats()
        if stats == self._published:
            return
        self._last_publish = now
        self._published = stats
        try:
            self._sink.publish(stats)
        except Exception:  # statistics are not worth a request
            log.exception("could not publish engine statistics")

    def _stats(self) -> EngineStats:
        batcher, plan = self._batcher, self._last_plan
        return EngineStats(
            kv_max_blocks=batcher.pool.num_blocks,
            kv_free_blocks=batcher.pool.num_free,
            kv_used_blocks=batcher.pool.num_used,
            tokens_per_block=batcher.pool.tokens_per_block,
            kv_cached_tokens=batcher.cached_tokens,
            active_requests=batcher.num_running,
            max_requests=self.cfg.max_num_sequences,
            scheduled_requests=len(plan.works),
            context_requests=plan.num_context,
            waiting_requests=batcher.num_waiting,
            paused_requests=plan.num_paused,
            total_context_tokens=plan.context_tokens,
            generation_requests=len(plan.works) - plan.num_context,
            empty_generation_slots=sum(1 for w in plan.works if not w.emits),
            iteration=self._iteration,
            counts=replace(batcher.counts),
            rows_total=self._rows_total,
            overrun_steps=self._pacer.overruns if self._pacer is not None else 0,
            paced_s=self._pacer.modelled_s * self._pacer.time_scale if self._pacer else 0.0,
            work_s=self._pacer.work_s if self._pacer is not None else 0.0,
            kv_alloc_total_blocks=batcher.pool.alloc_total,
            kv_alloc_new_blocks=batcher.pool.alloc_new,
            kv_reused_blocks=batcher.pool.reused,
            kv_reusable_blocks=batcher.pool.num_cached,
        )


def build_engine(cfg: EngineConfig, sink: Sink) -> Engine:
    """The engine `cfg` describes: the model on this CPU, or (timing: emulated) a token source
    held to the cost profile's step times."""
    if cfg.timing == "emulated":
        pacer = StepPacer(cfg.profile(), cfg.time_scale)
        return Engine(cfg, sink, lambda: TokenSource(cfg), pacer)

    def model() -> Runner:
        # torch loads only for an engine that runs the model.
        from reference_engine.llama import ModelRunner  # noqa: PLC0415

        return ModelRunner(cfg)

    return Engine(cfg, sink, model)

"""The primary backend as named groups of Tritons: a rollout's current and candidate versions,
precision pairs (FP16 / AWQ), a speculative-decoding engine.

Each row goes to the group `core.routing.Router` chooses from its class (lane, tenant, session,
precision); a released batch whose rows belong to different groups is sent as one request per
group (a static engine still runs each part as the policy formed it, minus the other group's
rows). Every row's end is told to the router (without error or not, and its time to first
token from reaching the group), which is what the rollout's automatic rollback compares.
The policy's KV mirror sees the blocks of every group summed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import structlog

from scheduler_svc.config import SpecGateSection
from scheduler_svc.contracts.gate_result import GateResult, check_age, read_result
from scheduler_svc.core.engine import EngineProfile
from scheduler_svc.core.routing import Event, Router
from scheduler_svc.errors import BackendUnavailableError
from scheduler_svc.serving.backends.base import Backend, GenerationInput, Tokens

log = structlog.get_logger("scheduler_svc.backends.groups")


@dataclass(frozen=True)
class GroupView:
    group: str
    share: int  # percent of the current group's traffic it takes now
    requests: int  # over the rollout window: ended, with an error, attained the SLO
    errors: int
    attained: int
    ready: bool  # any endpoint ready at the last check
    serving: bool  # takes traffic now or may at once (not drained)
    in_flight: int
    ended_ok: int  # since start
    ended_error: int


@dataclass(frozen=True)
class RolloutView:
    current: str
    candidate: str | None
    phase: str
    weight: int
    hold_left_s: float
    groups: tuple[GroupView, ...]
    events: dict[str, int]  # step, rollback, drained: how many since start
    gate_passed: bool | None  # None: no gate configured
    gate_overlap: dict[str, float]


class GroupedBackend:
    """A `Backend` over named backends (a `TritonPool` each), routed per row by a `Router`."""

    def __init__(
        self,
        pools: dict[str, Backend],
        router: Router,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pools = pools
        self.router = router
        self.clock = clock
        self.main = pools[router.groups[0]]
        self.in_flight = dict.fromkeys(pools, 0)
        self.group_ready = dict.fromkeys(pools, False)  # each group's last readiness check
        self.ended: dict[str, dict[str, int]] = {name: {"ok": 0, "error": 0} for name in pools}

    @property
    def engine_model(self) -> str:
        return self.main.engine_model

    async def start(self) -> None:
        for pool in self.pools.values():
            await pool.start()

    async def close(self) -> None:
        for pool in self.pools.values():
            await pool.close()

    def serving(self) -> list[str]:
        """The groups that take traffic now or may at once (a drained group does not)."""
        return [name for name in self.pools if self.router.taking_traffic(name)]

    async def ready(self) -> bool:
        """Every serving group is checked (a warm group stays health checked); ready while the
        main group or any other serving group is."""
        names = self.serving()
        answers = await asyncio.gather(*(self.pools[n].ready() for n in names))
        checked = dict(zip(names, answers, strict=True))
        for name in self.pools:
            self.group_ready[name] = checked.get(name, False)
        return any(answers)

    async def health(self) -> list[tuple[str, bool]]:
        return [(url, ready) for _, url, ready in await self.group_health()]

    async def group_health(self) -> list[tuple[str, str, bool]]:
        """(group, address, ready) of each endpoint, from the last readiness checks."""
        out = []
        for name, pool in self.pools.items():
            out += [(name, url, ready) for url, ready in await pool.health()]
        return out

    async def profile(self) -> EngineProfile:
        """The main group's engine, running as many batches at once as every group whose
        profile can be read does together; KV counts summed over the groups."""
        first = await self.main.profile()
        batches = first.batches_at_once
        for name, pool in self.pools.items():
            if pool is self.main:
                continue
            try:
                other = await pool.profile()
            except BackendUnavailableError as exc:
                log.warning("cannot read a group's engine profile", group=name, error=str(exc))
                continue
            if other.batching is not first.batching:
                log.warning(
                    "backend groups batch differently; the main group's runner is used",
                    group=name,
                    batching=other.batching.value,
                    main=first.batching.value,
                )
            batches += other.batches_at_once
        counts = await self.read_kv()
        return replace(
            first,
            batches_at_once=batches,
            kv_free_blocks=counts[0] if counts else first.kv_free_blocks,
            kv_total_blocks=counts[1] if counts else first.kv_total_blocks,
        )

    async def read_kv(self) -> tuple[int, int] | None:
        readings = await asyncio.gather(*(p.read_kv() for p in self.pools.values()))
        seen = [r for r in readings if r is not None]
        if not seen:
            return None
        return sum(r[0] for r in seen), sum(r[1] for r in seen)

    def view(self, now: float, gate: GateResult | None = None) -> RolloutView:
        """Where routing and the rollout stand (taken on the event loop; read anywhere)."""
        router = self.router
        shares = router.shares()
        groups = []
        for name in self.pools:
            window = router.window(name, now)
            groups.append(
                GroupView(
                    name,
                    shares.get(name, 0),
                    window.requests,
                    window.errors,
                    window.attained,
                    self.group_ready[name],
                    router.taking_traffic(name),
                    self.in_flight[name],
                    self.ended[name]["ok"],
                    self.ended[name]["error"],
                )
            )
        hold = router.hold_until
        return RolloutView(
            router.rollout.current,
            router.rollout.candidate,
            router.phase.value,
            router.weight,
            max(hold - now, 0.0) if hold is not None else 0.0,
            tuple(groups),
            dict(router.counts),
            router.gate_passed if router.spec_gate is not None else None,
            dict(gate.overlap) if gate is not None else {},
        )

    def choose(self, row: GenerationInput) -> str:
        return self.router.choose(row.route)

    async def stream(self, request: GenerationInput) -> AsyncGenerator[Tokens, None]:
        group = self.choose(request)
        answers = self.pools[group].stream(request)
        async with self._watched(group, 1) as first_token, contextlib.aclosing(answers) as s:
            async for tokens in s:
                first_token()
                yield tokens

    async def stream_batch(
        self, request_id: str, rows: list[GenerationInput], timeout_s: float | None
    ) -> AsyncGenerator[tuple[int, Tokens], None]:
        parts: dict[str, list[int]] = {}
        for index, row in enumerate(rows):
            parts.setdefault(self.choose(row), []).append(index)
        if len(parts) == 1:
            (group,) = parts
            async with contextlib.aclosing(self._part(group, request_id, rows, timeout_s)) as s:
                async for item in s:
                    yield item
            return
        streams = [
            self._mapped(group, f"{request_id}-{group}", rows, indices, timeout_s)
            for group, indices in parts.items()
        ]
        async with contextlib.aclosing(_merged(streams)) as merged:
            async for item in merged:
                yield item

    async def _mapped(
        self,
        group: str,
        request_id: str,
        rows: list[GenerationInput],
        indices: list[int],
        timeout_s: float | None,
    ) -> AsyncGenerator[tuple[int, Tokens], None]:
        part = [rows[i] for i in indices]
        async with contextlib.aclosing(self._part(group, request_id, part, timeout_s)) as s:
            async for row, tokens in s:
                yield indices[row], tokens

    async def _part(
        self, group: str, request_id: str, rows: list[GenerationInput], timeout_s: float | None
    ) -> AsyncGenerator[tuple[int, Tokens], None]:
        async with self._watched(group, len(rows)) as first_token:
            stream = self.pools[group].stream_batch(request_id, rows, timeout_s)
            async with contextlib.aclosing(stream) as answers:
                async for item in answers:
                    first_token()
                    yield item

    @contextlib.asynccontextmanager
    async def _watched(self, group: str, rows: int) -> AsyncIterator[Callable[[], None]]:
        """Count the rows in flight on `group` and tell the router how they ended: an error is
        an error; a reader who left (cancel, close) is neither."""
        started = self.clock()
        first: list[float] = []

        def first_token() -> None:
            if not first:
                first.append(self.clock() - started)

        self.in_flight[group] += rows
        ok: bool | None = None
        try:
            yield first_token
            ok = True
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except Exception:
            ok = False
            raise
        finally:
            self.in_flight[group] -= rows
            if ok is not None:
                now = self.clock()
                for _ in range(rows):
                    self.router.observe(group, ok, first[0] if first else None, now)
                self.ended[group]["ok" if ok else "error"] += rows


async def _merged(
    streams: list[AsyncGenerator[tuple[int, Tokens], None]],
) -> AsyncGenerator[tuple[int, Tokens], None]:
    """Items of several streams as each comes; the first error ends them all."""
    queue: asyncio.Queue[tuple[int, Tokens] | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[tuple[int, Tokens], None]) -> None:
        try:
            async with contextlib.aclosing(stream) as items:
                async for item in items:
                    queue.put_nowait(item)
        except Exception as exc:  # handed to the reader, who raises it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class RolloutWatch:
    """The rollout's clock and the gate's reader, on the sidecar's event loop: every second
    the router checks for a rollback or the end of the hold (each event logged and counted);
    every `check_interval_s` the gate result file is read again."""

    def __init__(
        self,
        backend: GroupedBackend,
        gate: SpecGateSection | None,
        publish: Callable[[RolloutView], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.gate = gate
        self.clock = clock
        self.publish = publish
        self.gate_result: GateResult | None = None
        self._gate_error: str | None = None
        self._gate_read_at = -math.inf

    def step(self) -> list[Event]:
        now = self.clock()
        if self.gate is not None and now >= self._gate_read_at + self.gate.check_interval_s:
            self._gate_read_at = now
            self.read_gate()
        events = self.backend.router.tick(now)
        for event in events:
            log_event(self.backend.router, event)
        self.publish(self.backend.view(now, self.gate_result))
        return events

    def read_gate(self) -> None:
        """Read the gate result; a missing or unreadable file closes the gate (logged once)."""
        assert self.gate is not None
        router = self.backend.router
        try:
            result = read_result(self.gate.result_file)
            check_age(result, self.gate.max_age_s, datetime.now(UTC))
        except ValueError as exc:
            if str(exc) != self._gate_error:
                log.warning("speculative-decoding gate closed", reason=str(exc))
            self._gate_error = str(exc)
            self.gate_result = None
            router.set_gate(False)
            return
        self._gate_error = None
        if self.gate_result is None or result != self.gate_result:
            log.info(
                "speculative-decoding gate result",
                passed=result.passed,
                overlap=result.overlap,
                threshold=result.threshold,
                measured_at=result.at,
                group=self.gate.group,
            )
        self.gate_result = result
        router.set_gate(result.passed)

    async def run(self) -> None:
        while True:
            try:
                self.step()
            except Exception:  # a surprise must not stop rollbacks for good: log, go on
                log.exception("rollout watch step failed")
            await asyncio.sleep(1.0)


def log_event(router: Router, event: Event) -> None:
    """Every rollout step, rollback and drain goes to the log, with the shares it leaves."""
    rollout = router.rollout
    fields = {
        "current": rollout.current,
        "candidate": rollout.candidate,
        "weight": event.weight,
        "phase": router.phase.value,
        "reason": event.reason,
    }
    if event.kind == "rollback":
        log.warning("rollout rolled back", **fields)
    elif event.kind == "drained":
        log.info("rollout done; the current group is drained", **fields)
    else:
        log.info("rollout step", **fields)

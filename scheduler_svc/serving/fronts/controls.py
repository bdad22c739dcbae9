"""What an operator may change while the sidecar runs: the policy, draining, Triton's models,
the rollout's share.

Policy changes are validated here (ValueError naming the field becomes INVALID_ARGUMENT) and
applied by the core loop's owner task, so no request is lost or decided under a half-applied
policy. A config file reloaded on SIGHUP goes the same way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

from scheduler_svc.config import SidecarConfig, load_config
from scheduler_svc.core.config import PolicyConfig, to_mapping
from scheduler_svc.core.engine import EngineProfile
from scheduler_svc.core.policy import PolicyScheduler
from scheduler_svc.core.types import Scheduler, Target
from scheduler_svc.errors import (
    BackendUnavailableError,
    BadRequestError,
    ConfigError,
    PreconditionError,
)
from scheduler_svc.serving.backends.base import Backend
from scheduler_svc.serving.backends.groups import GroupedBackend, RolloutView, log_event
from scheduler_svc.serving.backends.pool import TritonPool
from scheduler_svc.serving.backends.triton import TritonBackend
from scheduler_svc.serving.loop import CoreLoop
from scheduler_svc.serving.service import GenerationService

log = structlog.get_logger("scheduler_svc.admin")


MAX_POLICY_BYTES = 64 * 1024
MAX_POLICY_DEPTH = 8


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_policy_json(text: str) -> dict[str, Any]:
    """An UpdatePolicy body: a JSON object of bounded size and nesting, finite numbers only."""
    if len(text) > MAX_POLICY_BYTES:
        raise BadRequestError(f"policy_json: {len(text)} characters, at most {MAX_POLICY_BYTES}")
    depth = _depth(text)
    if depth > MAX_POLICY_DEPTH:
        raise BadRequestError(f"policy_json: nested {depth} deep, at most {MAX_POLICY_DEPTH}")
    try:
        changes = json.loads(text or "{}", parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise BadRequestError(f"policy_json: not JSON ({exc.msg} at {exc.pos})") from None
    except ValueError as exc:  # NaN, Infinity
        raise BadRequestError(f"policy_json: {exc}") from None
    if not isinstance(changes, dict):
        raise BadRequestError("policy_json: must be a JSON object")
    return changes


def _depth(text: str) -> int:
    """How deep brackets nest in a JSON text (outside strings), without parsing it."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


class SidecarControls:
    def __init__(
        self,
        cfg: SidecarConfig,
        loop: CoreLoop,
        service: GenerationService,
        primary: Backend,
        others: dict[Target, Backend],
        on_draining: Callable[[bool], Awaitable[None]],
        profile: Callable[[], EngineProfile | None],
    ) -> None:
        self.cfg = cfg
        self.loop = loop
        self.service = service
        self.backends = {Target.PRIMARY: primary, **others}
        # Triton's model repository, where the primary is Triton (Admin passes calls through):
        # with backend groups, the main group's.
        self.groups = primary if isinstance(primary, GroupedBackend) else None
        main = self.groups.main if self.groups is not None else primary
        self.repository = main if isinstance(main, TritonPool) else None
        self.on_draining = on_draining
        self.profile = profile  # the engine profile, once the sidecar has read it

    def _policy(self) -> PolicyScheduler:
        scheduler = self.loop.scheduler
        if not isinstance(scheduler, PolicyScheduler):
            raise BadRequestError("queue.scheduler is fifo: there is no policy to update")
        return scheduler

    async def update_policy(self, policy_json: str, dry_run: bool) -> str:
        changes = parse_policy_json(policy_json)
        current = self._policy().config
        try:
            new = self.cfg.policy_override(current, changes)
        except ValueError as exc:
            raise BadRequestError(str(exc)) from None
        if not dry_run:
            await self.apply(new)
        return json.dumps(to_mapping(new), sort_keys=True)

    async def apply(self, new: PolicyConfig) -> None:
        def change(scheduler: Scheduler, now: float) -> None:
            assert isinstance(scheduler, PolicyScheduler)
            scheduler.reconfigure(new, now)

        try:
            await self.loop.call(change)
        except ValueError as exc:
            raise BadRequestError(f"policy: {exc}") from None
        log.info("policy updated", policy=to_mapping(new))

    async def reload(self, path: str | Path, overrides: dict[str, Any]) -> None:
        """SIGHUP: read the config file again and apply its policy section (other sections
        need a restart, and are left as they are)."""
        try:
            fresh = load_config(path, overrides)
            self._policy()
            new = fresh.policy_config()
            engine = self.profile()
            if engine is not None:  # what the engine decides, unless the file pins it
                new = fresh.policy_for_engine(new, engine)
            await self.apply(new)
        except (ConfigError, BadRequestError) as exc:
            log.error("config reload refused; the running policy stays", error=str(exc))

    async def set_draining(self, draining: bool) -> None:
        self.service.draining = draining
        log.info("draining" if draining else "resumed", by="admin")
        await self.on_draining(draining)

    async def backend_health(self) -> list[tuple[str, str, bool]]:
        out = []
        for target, backend in self.backends.items():
            if isinstance(backend, GroupedBackend):
                out += [
                    (f"{target.value}:{group}", url, ready)
                    for group, url, ready in await backend.group_health()
                ]
                continue
            out += [(target.value, url, ready) for url, ready in await backend.health()]
        return out

    def _rollout(self) -> GroupedBackend:
        if self.groups is None or self.groups.router.rollout.candidate is None:
            raise PreconditionError("no rollout is configured (groups, rollout.candidate)")
        return self.groups

    async def rollout(self) -> RolloutView:
        return self._rollout().view(time.monotonic())

    async def set_rollout(self, weight: int | None, by: str) -> RolloutView:
        """The candidate's new share (None: the next configured step), logged and counted."""
        groups = self._rollout()
        now = time.monotonic()
        try:
            if weight is None:
                events = groups.router.advance(now)
            else:
                events = groups.router.set_weight(weight, now, f"set by {by}")
        except ValueError as exc:
            raise PreconditionError(f"rollout: {exc}") from None
        for event in events:
            log_event(groups.router, event)
        return groups.view(now)

    def _tritons(self) -> list[TritonBackend]:
        if self.repository is None:
            raise BackendUnavailableError("the primary backend is not a Triton server")
        return [e.backend for e in self.repository.endpoints]

    def first_triton(self) -> TritonBackend:
        """The primary's first Triton (BackendUnavailableError where it is not a Triton)."""
        return self._tritons()[0]

    async def triton_call(self, method: str, request: Any, every: bool = False) -> Any:
        """Pass a KServe call through to Triton as it is (the first endpoint; with `every`,
        each endpoint in turn, since they serve the same repository, answering the first's
        reply). Triton's refusal keeps its status code."""
        replies = []
        for triton in self._tritons() if every else self._tritons()[:1]:
            replies.append(await triton.call(method, request))
        if every:
            log.info("passed through to Triton", method=method, endpoints=len(replies))
        return replies[0]

    async def repository_index(self) -> list[tuple[str, str, str, str]]:
        return await self._tritons()[0].repository_index()

    async def load_model(self, name: str) -> None:
        for triton in self._tritons():  # every endpoint serves the same repository
            await triton.load_model(name)
        log.info("model loaded", model=name, by="admin")

    async def unload_model(self, name: str) -> None:
        for triton in self._tritons():
            await triton.unload_model(name)
        log.info("model unloaded", model=name, by="admin")

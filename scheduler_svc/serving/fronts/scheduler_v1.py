"""The `scheduler.v1` fronts: `Scheduler` (Generate, GenerateStream) and `Admin` (stats, policy,
drain and resume, Triton's models, the rollout), over the service and the controls.

Requests are parsed inside the handlers (the method handlers take raw bytes), so a malformed
message, invalid UTF-8 in a string field included, is answered INVALID_ARGUMENT. Errors are
raised, never answered here: the server's guard (guard.py) maps them to their status.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.contracts.generation import Delta, Final, Finish, GenerationParams
from scheduler_svc.contracts.sampling import Sampling
from scheduler_svc.core.types import Urgency
from scheduler_svc.errors import BadRequestError
from scheduler_svc.serving import auth
from scheduler_svc.serving.backends.groups import RolloutView
from scheduler_svc.serving.fronts.status import Context
from scheduler_svc.serving.loop import CoreLoop
from scheduler_svc.serving.service import GenerationService

SERVICE = "scheduler.v1.Scheduler"

_URGENCY = {
    pb.PRIORITY_UNSPECIFIED: Urgency.STANDARD,
    pb.PRIORITY_INTERACTIVE: Urgency.INTERACTIVE,
    pb.PRIORITY_STANDARD: Urgency.STANDARD,
    pb.PRIORITY_BATCH: Urgency.BATCH,
}
_FINISH = {
    Finish.LENGTH: pb.FINISH_REASON_LENGTH,
    Finish.STOP: pb.FINISH_REASON_STOP,
}


def parse_request(raw: bytes) -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    try:
        request.ParseFromString(raw)
    except DecodeError:
        raise BadRequestError(
            "request is not a valid scheduler.v1.GenerateRequest (a string field that is not "
            "UTF-8?)"
        ) from None
    return request


def to_params(request: pb.GenerateRequest, time_remaining_s: float | None) -> GenerationParams:
    if request.priority not in _URGENCY:
        raise BadRequestError(f"priority: unknown value {request.priority}")
    which = request.WhichOneof("input")
    return GenerationParams(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt=request.prompt if which == "prompt" else None,
        token_ids=tuple(request.token_ids.ids) if which == "token_ids" else None,
        max_tokens=request.max_tokens if request.HasField("max_tokens") else None,
        sampling=Sampling(
            temperature=request.sampling.temperature,
            top_p=request.sampling.top_p,
            top_k=request.sampling.top_k,
            seed=request.sampling.seed,
        ),
        stop=tuple(request.stop),
        urgency=_URGENCY[request.priority],
        tenant=request.tenant,
        session=request.session_id,
        precision=request.precision,
        return_log_probs=request.return_log_probs,
        time_remaining_s=time_remaining_s,
    )


def final_response(
    final: Final, text: str, token_ids: tuple[int, ...], log_probs: tuple[float, ...] = ()
) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=final.request_id,
        text=text,
        token_ids=token_ids,
        log_probs=log_probs,
        finish_reason=_FINISH[final.finish],
        usage=pb.Usage(
            prompt_tokens=final.prompt_tokens, completion_tokens=final.completion_tokens
        ),
        timing=pb.Timing(
            queue_ms=final.queue_ms, time_to_first_token_ms=final.ttft_ms, total_ms=final.total_ms
        ),
        lane=final.lane,
    )


class SchedulerFront:
    def __init__(self, service: GenerationService) -> None:
        self.service = service

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Generate": grpc.unary_unary_rpc_method_handler(
                    self.generate, response_serializer=pb.GenerateResponse.SerializeToString
                ),
                "GenerateStream": grpc.unary_stream_rpc_method_handler(
                    self.generate_stream,
                    response_serializer=pb.GenerateResponse.SerializeToString,
                ),
            },
        )

    async def generate(self, raw: bytes, context: Context) -> pb.GenerateResponse:
        params = to_params(parse_request(raw), context.time_remaining())
        final = await self.service.answer(params)
        return final_response(final, final.text, final.token_ids, final.log_probs or ())

    async def generate_stream(
        self, raw: bytes, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        params = to_params(parse_request(raw), context.time_remaining())
        held = Delta()  # the last tokens, sent with the Final as one message
        async with contextlib.aclosing(self.service.generate(params)) as events:
            async for event in events:
                if isinstance(event, Final):
                    yield final_response(event, held.text, held.token_ids, held.log_probs or ())
                elif event.last or held.last:
                    held += event
                elif event.text or event.token_ids:
                    yield pb.GenerateResponse(
                        request_id=params.request_id,
                        text=event.text,
                        token_ids=event.token_ids,
                        log_probs=event.log_probs or (),
                    )


class AdminFront(pb_grpc.AdminServicer):
    """Operator view and controls. Changes go through the core loop's owner task."""

    def __init__(self, service: GenerationService, loop: CoreLoop, controls: Controls) -> None:
        self.service = service
        self.loop = loop
        self.controls = controls

    async def GetStats(self, request: pb.GetStatsRequest, context: Context) -> pb.Stats:
        stats = self.loop.stats()
        kv = stats.kv
        return pb.Stats(
            queued=stats.queued,
            in_flight=stats.in_flight,
            max_queued=stats.max_queued,
            max_in_flight=stats.max_in_flight,
            accepted_total=self.loop.accepted,
            rejected_total=self.loop.rejected,
            finished_total=dict(self.service.outcomes),
            backend_ready=self.service.backend_ready,
            scheduler=self.loop.scheduler.name,
            lanes=[
                pb.LaneStats(
                    name=lane.name,
                    queued=lane.queued,
                    max_queued=lane.max_queued,
                    oldest_wait_ms=lane.oldest_wait_s * 1000,
                    max_wait_ms=(lane.max_wait_s or 0) * 1000,
                )
                for lane in stats.lanes
            ],
            kv=None
            if kv is None
            else pb.KvMirror(
                total_blocks=kv.total_blocks,
                free_blocks=kv.free_blocks,
                reserved_blocks=kv.reserved_blocks,
                external_blocks=kv.external_blocks,
                tokens_per_block=kv.tokens_per_block,
                fragmentation=kv.fragmentation,
                stale=kv.stale,
            ),
            breaker_open=stats.breaker_open,
            backends=[
                pb.BackendHealth(role=role, url=url, ready=ready)
                for role, url, ready in await self.controls.backend_health()
            ],
            policy_events=dict(stats.counters),
            draining=self.service.draining,
            leaked_reservations_total=self.loop.leaked,
        )

    async def UpdatePolicy(
        self, request: pb.UpdatePolicyRequest, context: Context
    ) -> pb.UpdatePolicyResponse:
        policy = await self.controls.update_policy(request.policy_json, request.dry_run)
        return pb.UpdatePolicyResponse(policy_json=policy)

    async def Drain(self, request: pb.DrainRequest, context: Context) -> pb.DrainResponse:
        await self.controls.set_draining(True)
        stats = self.loop.stats()
        return pb.DrainResponse(queued=stats.queued, in_flight=stats.in_flight)

    async def Resume(self, request: pb.ResumeRequest, context: Context) -> pb.ResumeResponse:
        await self.controls.set_draining(False)
        return pb.ResumeResponse()

    async def ListModels(
        self, request: pb.ListModelsRequest, context: Context
    ) -> pb.ListModelsResponse:
        models = await self.controls.repository_index()
        return pb.ListModelsResponse(
            models=[pb.ModelEntry(name=n, version=v, state=st, reason=r) for n, v, st, r in models]
        )

    async def LoadModel(
        self, request: pb.LoadModelRequest, context: Context
    ) -> pb.LoadModelResponse:
        await self.controls.load_model(_model_name(request.name))
        return pb.LoadModelResponse()

    async def UnloadModel(
        self, request: pb.UnloadModelRequest, context: Context
    ) -> pb.UnloadModelResponse:
        await self.controls.unload_model(_model_name(request.name))
        return pb.UnloadModelResponse()

    async def GetRollout(self, request: pb.GetRolloutRequest, context: Context) -> pb.Rollout:
        return rollout_message(await self.controls.rollout())

    async def SetRollout(self, request: pb.SetRolloutRequest, context: Context) -> pb.Rollout:
        which = request.WhichOneof("change")
        if which is None:
            raise BadRequestError("SetRollout: give weight (0..100) or advance")
        weight = request.weight if which == "weight" else None
        if which == "advance" and not request.advance:
            raise BadRequestError("SetRollout: advance must be true")
        by = auth.CURRENT.get().name
        return rollout_message(await self.controls.set_rollout(weight, by))


def rollout_message(view: RolloutView) -> pb.Rollout:
    return pb.Rollout(
        current=view.current,
        candidate=view.candidate or "",
        phase=view.phase,
        weight=view.weight,
        hold_left_s=view.hold_left_s,
        groups=[
            pb.GroupWindow(
                group=g.group,
                share=g.share,
                requests=g.requests,
                errors=g.errors,
                attained=g.attained,
                ready=g.ready,
            )
            for g in view.groups
        ],
        spec_gate_passed=bool(view.gate_passed),
    )


def _model_name(name: str) -> str:
    if not name:
        raise BadRequestError("name: empty (the Triton model to load or unload)")
    if len(name) > 256:
        raise BadRequestError(f"name: {len(name)} characters, at most 256")
    return name


class Controls(Protocol):
    """What the admin front may change; the sidecar process implements it."""

    async def backend_health(self) -> list[tuple[str, str, bool]]: ...

    async def update_policy(self, policy_json: str, dry_run: bool) -> str: ...

    async def set_draining(self, draining: bool) -> None: ...

    async def repository_index(self) -> list[tuple[str, str, str, str]]: ...

    async def load_model(self, name: str) -> None: ...

    async def unload_model(self, name: str) -> None: ...

    async def rollout(self) -> RolloutView: ...

    async def set_rollout(self, weight: int | None, by: str) -> RolloutView: ...

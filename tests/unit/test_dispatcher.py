"""The dispatcher's owner task with the real policy core (no backend needed)."""

from __future__ import annotations

import asyncio

from scheduler_svc.core.config import KvConfig, PolicyConfig
from scheduler_svc.core.policy import PolicyScheduler
from scheduler_svc.core.types import Dispatch, Request
from scheduler_svc.dispatcher import Dispatcher


def test_a_reservation_without_a_live_request_is_found_and_reclaimed() -> None:
    async def scenario() -> None:
        policy = PolicyScheduler(PolicyConfig(kv=KvConfig(total_blocks=100, max_in_flight=4)))
        dispatcher = Dispatcher(policy)
        dispatcher.start()
        try:
            tickets = [
                await dispatcher.submit(Request(f"r{i}", 100, 20, lane="hot")) for i in range(2)
            ]
            decisions = [await asyncio.wait_for(t.decision, 5) for t in tickets]
            assert all(isinstance(d, Dispatch) for d in decisions)
            assert set(policy.mirror.held()) == {"r0", "r1"}
            dispatcher.release(tickets[0], 20)  # r0 ends properly
            # r1's handler vanishes without releasing (the bug the leak check is for):
            dispatcher._tickets.pop("r1")
            reclaimed = await dispatcher.call(lambda _s, now: dispatcher.reclaim_leaks(now))
            assert reclaimed == 1
            assert policy.mirror.held() == {} and policy.mirror.reserved_blocks == 0
            assert dispatcher.leaked == 1
            assert dispatcher.metrics.leaked._value.get() == 1
        finally:
            await dispatcher.close()

    asyncio.run(scenario())


def test_progress_and_output_tokens_reach_the_core() -> None:
    async def scenario() -> None:
        policy = PolicyScheduler(PolicyConfig(kv=KvConfig(total_blocks=1000, max_in_flight=4)))
        dispatcher = Dispatcher(policy)
        dispatcher.start()
        try:
            ticket = await dispatcher.submit(Request("r", 100, 400, lane="hot"))
            await asyncio.wait_for(ticket.decision, 5)
            assert policy.mirror.held()["r"] == 32  # (100 + 400) / 16: no history yet
            dispatcher.progress(ticket, 16)
            dispatcher.release(ticket, 40)
            await dispatcher.call(lambda _s, _now: None)  # after the messages above
            assert policy.predictor.samples("", "hot") == 1
            assert policy.mirror.held() == {}
        finally:
            await dispatcher.close()

    asyncio.run(scenario())

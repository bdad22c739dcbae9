"""The policy in the live request path: real Triton, real engine, real sidecar.

Over 500 lines: one flat live proof per policy feature, each starting its own sidecar with a
given policy over the session's Triton through this file's helpers (start, ask, stats)."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.serving.tokenizer import load_tokenizer
from scheduler_svc.tools.triton.launcher import TritonServer, free_port
from tests.integration.conftest import CPU_REPO
from tests.integration.prompts import STORY, tokens_of_length
from tests.integration.sidecar import SidecarProcess, eventually
from tests.integration.tritonio import engine_metric, scrape, wait_engine_idle

WAIT_S = 60.0
TEPID = {
    "name": "tepid",
    "min_prompt_tokens": 0,
    "share": 1,
    "max_batch": 1,
    "max_queued": 1,
    "queue_timeout_s": None,
    "on_timeout": "requeue",
}
ALL_TEPID = {"watch_lane": "tepid", "demote_lane": "tepid", "to_lane": "tepid"}
PATIENT_HOT = {
    "lanes": [{"name": "hot", "queue_timeout_s": 30, "max_wait_s": 30, "ttft_target_s": 30}]
}


def text_of(n: int) -> str:
    return load_tokenizer().decode(tokens_of_length(n))


def start(server: TritonServer, tmp_path: Path, config: dict[str, Any]) -> SidecarProcess:
    triton = {"metrics_url": server.metrics_url, "kv_poll_interval_s": 0.2}
    config = {**config, "triton": {**triton, **config.get("triton", {})}}
    return SidecarProcess(server.grpc_url, tmp_path, config).start()


@pytest.fixture
def sidecar_factory(tmp_path: Path) -> Iterator[Callable[..., SidecarProcess]]:
    """Start sidecars with the policy; at the end, none may keep a KV reservation."""
    started: list[SidecarProcess] = []

    def make(server: TritonServer, config: dict[str, Any], name: str = "s") -> SidecarProcess:
        folder = tmp_path / name
        folder.mkdir()
        process = start(server, folder, config)
        started.append(process)
        return process

    yield make
    try:
        for process in started:
            eventually(
                lambda p=process: stats(p).kv.reserved_blocks == 0 and stats(p).in_flight == 0,
                "every reservation is released",
                timeout_s=20,
            )
    finally:
        for process in started:
            process.stop()


def admin(sidecar: SidecarProcess) -> pb_grpc.AdminStub:
    return sidecar.admin()


def stats(sidecar: SidecarProcess) -> pb.Stats:
    return admin(sidecar).GetStats(pb.GetStatsRequest())


def ask(sidecar: SidecarProcess, prompt: str, max_tokens: int, **kw: Any) -> pb.GenerateResponse:
    return sidecar.scheduler().Generate(
        pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, **kw), timeout=WAIT_S
    )


def in_threads(jobs: list[Callable[[], Any]]) -> list[Any]:
    results: list[Any] = [None] * len(jobs)

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except grpc.RpcError as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    return results


def test_hot_requests_overtake_queued_cold_ones(
    triton: TritonServer, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    # Deadline order: hot is due 30 s after it arrives, cold 300 s after (both patient enough
    # on this engine that nobody is refused), so hot is due before the queued cold ones.
    lanes = [*PATIENT_HOT["lanes"], {"name": "cold", "ttft_target_s": 300}]
    sidecar = sidecar_factory(triton, {"queue": {"max_in_flight": 1}, "policy": {"lanes": lanes}})
    cold_prompt = text_of(1100)
    done: list[str] = []

    def job(name: str, prompt: str, max_tokens: int) -> Callable[[], None]:
        def run() -> None:
            ask(sidecar, prompt, max_tokens)
            done.append(name)

        return run

    threads = [threading.Thread(target=job(f"cold{i}", cold_prompt, 30)) for i in range(3)]
    for t in threads:
        t.start()
    eventually(
        lambda: (stats(sidecar).in_flight, stats(sidecar).queued) == (1, 2),
        "one cold request runs and two wait behind it",
    )
    assert [lane.queued for lane in stats(sidecar).lanes if lane.name == "cold"] == [2]
    hot = threading.Thread(target=job("hot", "What time is it?", 4))
    hot.start()
    for t in [*threads, hot]:
        t.join(WAIT_S)
    assert done[0].startswith("cold")
    assert done.index("hot") == 1, f"finishing order {done}"  # right after the running one


def test_update_policy_applies_from_the_next_batch(
    triton: TritonServer, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    # A bucket waits 0.5 s for company, so four threads' requests surely share one: buckets
    # held back as for a static engine (on its own the sidecar lets an in-flight engine's
    # buckets go at once).
    patient = {
        "lanes": [{**PATIENT_HOT["lanes"][0], "batch_timeout_s": 0.5}],
        "continuous_batching": False,
    }
    sidecar = sidecar_factory(triton, {"policy": patient})

    def batches() -> int:
        return int(stats(sidecar).policy_events["batches"])

    def four_at_once() -> None:
        results = in_threads([lambda: ask(sidecar, "Same short question?", 2)] * 4)
        assert all(isinstance(r, pb.GenerateResponse) for r in results), results

    before = batches()
    four_at_once()
    assert batches() - before == 1  # one bucket of four (released after its 0.5 s)
    stub = admin(sidecar)
    dry = stub.UpdatePolicy(
        pb.UpdatePolicyRequest(
            policy_json='{"lanes": [{"name": "hot", "max_batch": 1}]}', dry_run=True
        )
    )
    assert json.loads(dry.policy_json)["lanes"][0]["max_batch"] == 1
    before = batches()
    four_at_once()
    assert batches() - before == 1  # a dry run changes nothing
    applied = stub.UpdatePolicy(
        pb.UpdatePolicyRequest(policy_json='{"lanes": [{"name": "hot", "max_batch": 1}]}')
    )
    assert json.loads(applied.policy_json)["lanes"][1]["max_batch"] == 32  # warm untouched
    before = batches()
    four_at_once()
    assert batches() - before == 4
    for bad, message in [
        ("{not json", "not JSON"),
        ('{"lanes": [{"name": "hot", "share": 3}]}', "policy.lanes[0].share"),
        (json.dumps({"lanes": [TEPID], "breaker": ALL_TEPID}), "renamed"),
    ]:
        with pytest.raises(grpc.RpcError) as caught:
            stub.UpdatePolicy(pb.UpdatePolicyRequest(policy_json=bad))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in caught.value.details()


def test_a_static_engine_runs_each_bucket_as_its_own_batch(
    variants: TritonServer, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    """A long request keeps the static engine busy; meanwhile six rows of two lengths arrive.
    The sidecar reads the engine profile (V1), keeps one batch in the engine, and sends each
    bucket as one multi-row request when the engine frees: the engine pads within the 1.5
    ratio. A pass-through FIFO lets all six wait inside the engine, whose batcher packs them
    together, length-blind, and pads the short rows to the long ones."""
    short, long = text_of(20), text_of(200)
    engine = "engine_static"

    def padding_of(config: dict[str, Any], name: str) -> tuple[float, float]:
        sidecar = sidecar_factory(variants, {"triton": {"engine_model": engine}, **config}, name)
        wait_engine_idle(variants.metrics_url, engine)
        before = scrape(variants.metrics_url)
        blocker = threading.Thread(target=ask, args=(sidecar, text_of(100), 40))
        blocker.start()
        eventually(lambda: stats(sidecar).in_flight == 1, "the long request runs")
        jobs = [lambda p=p: ask(sidecar, p, 3) for p in [short, long] * 3]
        results = in_threads(jobs)
        blocker.join(WAIT_S)
        assert all(isinstance(r, pb.GenerateResponse) for r in results), results
        wait_engine_idle(variants.metrics_url, engine)
        after = scrape(variants.metrics_url)

        def delta(name: str, **labels: str) -> float:
            return engine_metric(after, name, engine, **labels) - engine_metric(
                before, name, engine, **labels
            )

        processed = delta("scheduler_svc_engine_tokens_total", phase="context", kind="processed")
        useful = delta("scheduler_svc_engine_tokens_total", phase="context", kind="useful")
        requests = delta("nv_inference_request_success_total")
        return 1 - useful / processed, requests

    # Nothing pins the batching: the rules come from the engine profile alone.
    policy_padding, policy_requests = padding_of(
        # a bucket waits up to 0.5 s for its rows, so six threads' requests surely meet
        {"policy": {"lanes": [{**PATIENT_HOT["lanes"][0], "batch_timeout_s": 0.5}]}},
        "policy",
    )
    fifo_padding, fifo_requests = padding_of({"queue": {"scheduler": "fifo"}}, "fifo")
    assert policy_requests == 3  # the blocker, then one multi-row request per bucket
    # Each bucket holds rows of one length here, so the engine pads next to nothing (the 1.5
    # ratio bound is the most it could).
    assert policy_padding <= 0.05
    assert fifo_requests == 7  # one request per row
    assert fifo_padding > 0.3  # 20-token rows padded to 200 in one engine batch


def test_the_breaker_opens_under_a_hot_backlog_and_closes_after(
    triton: TritonServer, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    policy = {**PATIENT_HOT, "breaker": {"open_above": 3, "close_below": 1, "min_open_s": 0.2}}
    sidecar = sidecar_factory(triton, {"queue": {"max_in_flight": 1}, "policy": policy})
    blocker = threading.Thread(target=ask, args=(sidecar, STORY, 60))
    blocker.start()
    eventually(lambda: stats(sidecar).in_flight == 1, "a long request runs")
    hot = [threading.Thread(target=ask, args=(sidecar, f"Question {i}?", 2)) for i in range(5)]
    for t in hot:
        t.start()
    eventually(lambda: stats(sidecar).breaker_open, "the breaker opens")
    for t in [blocker, *hot]:
        t.join(WAIT_S)
    eventually(lambda: not stats(sidecar).breaker_open, "the breaker closes", timeout_s=10)
    assert stats(sidecar).policy_events["demoted"] == 0  # no warm traffic was there to demote


def test_a_cancelled_stream_releases_its_reservation_and_the_mirror_agrees_at_rest(
    triton: TritonServer, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    sidecar = sidecar_factory(triton, {})
    call = sidecar.scheduler().GenerateStream(pb.GenerateRequest(prompt=STORY, max_tokens=500))
    for received, _ in enumerate(call, start=1):
        if received == 2:
            assert stats(sidecar).kv.reserved_blocks > 0
            call.cancel()
            break
    eventually(lambda: stats(sidecar).kv.reserved_blocks == 0, "the reservation is released")
    engine = wait_engine_idle(triton.metrics_url, "tensorrt_llm")

    def agrees() -> bool:
        kv = stats(sidecar).kv
        return (kv.total_blocks, kv.free_blocks, kv.external_blocks, kv.stale) == (
            engine["max"],
            engine["free"],
            0,
            False,
        )

    eventually(agrees, "the KV mirror agrees with the engine's counts at rest", timeout_s=10)
    assert stats(sidecar).in_flight == 0


def test_drain_refuses_new_work_and_resume_takes_it_again(
    triton: TritonServer, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    sidecar = sidecar_factory(triton, {})
    health = health_pb2_grpc.HealthStub(sidecar.channel())
    drained = admin(sidecar).Drain(pb.DrainRequest())
    assert drained.in_flight == 0 and stats(sidecar).draining
    with pytest.raises(grpc.RpcError) as caught:
        ask(sidecar, "Anyone there?", 2)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "draining" in caught.value.details()
    status = health.Check(health_pb2.HealthCheckRequest()).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    admin(sidecar).Resume(pb.ResumeRequest())
    eventually(
        lambda: (
            health.Check(health_pb2.HealthCheckRequest()).status
            == health_pb2.HealthCheckResponse.SERVING
        ),
        "health says SERVING again",
    )
    assert ask(sidecar, "Anyone there?", 2).usage.completion_tokens == 2


def test_the_model_repository_is_reachable_through_admin(
    triton: TritonServer, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    sidecar = sidecar_factory(triton, {})
    models = {m.name: m.state for m in admin(sidecar).ListModels(pb.ListModelsRequest()).models}
    assert models["tensorrt_llm"] == "READY" and models["ensemble"] == "READY"
    with pytest.raises(grpc.RpcError) as caught:
        admin(sidecar).UnloadModel(pb.UnloadModelRequest(name="tensorrt_llm"))
    # The shared test Triton runs without explicit model control: Triton refuses, clearly.
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, caught.value.details()
    assert "Triton" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        admin(sidecar).LoadModel(pb.LoadModelRequest(name=""))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_replicas_share_the_load_and_a_dead_one_is_skipped(
    triton: TritonServer, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    ports = {"grpc_port": free_port(), "http_port": free_port(), "metrics_port": free_port()}
    second = TritonServer(CPU_REPO, **ports).start()
    try:
        config = {
            "triton": {
                "health_interval_s": 0.2,
                "replicas": [{"url": second.grpc_url, "metrics_url": second.metrics_url}],
            },
            "policy": {"lanes": [{"name": "hot", "max_batch": 1, "queue_timeout_s": 30}]},
        }
        sidecar = sidecar_factory(triton, config)

        def served(server: TritonServer) -> float:
            key = (
                "nv_inference_request_success_total",
                frozenset({"model": "tensorrt_llm", "version": "1"}.items()),
            )
            return scrape(server.metrics_url)[key]

        before = (served(triton), served(second))
        results = in_threads([lambda i=i: ask(sidecar, f"Question {i}?", 8) for i in range(8)])
        assert all(isinstance(r, pb.GenerateResponse) for r in results), results
        after = (served(triton), served(second))
        assert after[0] > before[0] and after[1] > before[1]  # both endpoints took requests
        kv = stats(sidecar).kv
        assert kv.total_blocks == 2 * 1024  # the mirror sees both pools
        second.stop()
        eventually(
            lambda: [b.ready for b in stats(sidecar).backends] == [True, False],
            "the stopped replica is marked not ready",
        )
        for i in range(4):
            assert ask(sidecar, f"Still there {i}?", 2).usage.completion_tokens == 2
    finally:
        second.stop()


def test_a_hot_request_past_its_timeout_goes_to_the_degrade_target(
    triton: TritonServer, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    # The degrade target here is the same Triton (in production: a smaller, faster model).
    config = {"queue": {"max_in_flight": 1}, "degrade": {"url": triton.grpc_url}}
    sidecar = sidecar_factory(triton, config)
    blocker = threading.Thread(target=ask, args=(sidecar, STORY, 80))
    blocker.start()
    eventually(lambda: stats(sidecar).in_flight == 1, "a long request runs")
    answer = ask(sidecar, "Quick one?", 3)  # waits past the hot lane's 100 ms, then degrades
    blocker.join(WAIT_S)
    assert answer.usage.completion_tokens == 3 and answer.lane == "hot"
    events = stats(sidecar).policy_events
    assert events["degraded_backend"] == 1 and events["expired_no_fallback"] == 0
    assert [b.role for b in stats(sidecar).backends] == ["primary", "degrade"]


def test_load_and_unload_pass_through_to_a_triton_with_explicit_model_control(
    tmp_path: Path, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    ports = {"grpc_port": free_port(), "http_port": free_port(), "metrics_port": free_port()}
    explicit = TritonServer(
        CPU_REPO, **ports, extra_args=["--model-control-mode=explicit", "--load-model=*"]
    ).start()
    try:
        sidecar = sidecar_factory(explicit, {})
        stub = admin(sidecar)

        def state(name: str) -> str:
            models = stub.ListModels(pb.ListModelsRequest()).models
            return {m.name: m.state for m in models}.get(name, "")

        assert state("postprocessing") == "READY"
        stub.UnloadModel(pb.UnloadModelRequest(name="postprocessing"))
        eventually(lambda: state("postprocessing") == "UNAVAILABLE", "postprocessing unloads")
        stub.LoadModel(pb.LoadModelRequest(name="postprocessing"))
        assert state("postprocessing") == "READY"
        with pytest.raises(grpc.RpcError) as caught:
            stub.LoadModel(pb.LoadModelRequest(name="no_such_model"))
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no_such_model" in caught.value.details()
    finally:
        explicit.stop()


def test_sighup_reloads_the_policy_from_the_config_file(
    triton: TritonServer, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    sidecar = sidecar_factory(triton, {})

    def hot_max_batch() -> int:
        current = admin(sidecar).UpdatePolicy(
            pb.UpdatePolicyRequest(policy_json="{}", dry_run=True)
        )
        return int(json.loads(current.policy_json)["lanes"][0]["max_batch"])

    assert hot_max_batch() == 16
    config = yaml.safe_load(sidecar.config_path.read_text())
    config["policy"] = {"lanes": [{"name": "hot", "max_batch": 4}]}
    sidecar.config_path.write_text(yaml.safe_dump(config))
    sidecar.signal(signal.SIGHUP)
    eventually(lambda: hot_max_batch() == 4, "the reloaded policy is in force")
    sidecar.config_path.write_text("policy: {lanes: [{name: hot, share: 7}]}\n")
    sidecar.signal(signal.SIGHUP)
    sidecar.wait_for_events(
        "config reload refused; the running policy stays", lambda events: len(events) >= 1
    )
    assert hot_max_batch() == 4
    assert ask(sidecar, "Still fine?", 2).usage.completion_tokens == 2


def test_cold_requests_past_their_timeout_go_to_the_elastic_pool(
    triton: TritonServer, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    config = {
        "queue": {"max_in_flight": 1},
        "elastic": {"url": triton.grpc_url},  # in production: an overflow cluster
        # On an in-flight engine a lane with a timeout acts at its TTFT target.
        "policy": {"lanes": [{"name": "cold", "queue_timeout_s": 0.2, "ttft_target_s": 0.2}]},
    }
    sidecar = sidecar_factory(triton, config)
    cold_prompt = text_of(1100)  # before the clock starts: the first tokenizer load is slow
    blocker = threading.Thread(target=ask, args=(sidecar, STORY, 200))
    blocker.start()
    eventually(lambda: stats(sidecar).in_flight == 1, "a long request runs")
    answer = ask(sidecar, cold_prompt, 3)
    blocker.join(WAIT_S)
    assert answer.lane == "cold" and answer.usage.completion_tokens == 3
    assert stats(sidecar).policy_events["elastic"] == 1


def test_a_batch_whose_triton_dies_mid_stream_ends_every_member_clearly(
    sidecar_factory: Callable[..., SidecarProcess],
) -> None:
    ports = {"grpc_port": free_port(), "http_port": free_port(), "metrics_port": free_port()}
    doomed = TritonServer(CPU_REPO, **ports).start()
    try:
        config = {
            # a multi-row request per batch on this in-flight engine, as a static one gets
            "triton": {"engine_batching": "static", "health_interval_s": 0.2},
            "policy": {"lanes": [{**PATIENT_HOT["lanes"][0], "batch_timeout_s": 0.5}]},
        }
        sidecar = sidecar_factory(doomed, config)
        first_tokens = threading.Barrier(4, timeout=WAIT_S)

        def member() -> grpc.StatusCode | None:
            call = sidecar.scheduler().GenerateStream(
                pb.GenerateRequest(prompt=STORY, max_tokens=800), timeout=WAIT_S
            )
            try:
                for n, _ in enumerate(call):
                    if n == 0:
                        first_tokens.wait()
            except grpc.RpcError as exc:
                return exc.code()
            return None

        results: list[Any] = []
        threads = [threading.Thread(target=lambda: results.append(member())) for _ in range(3)]
        for t in threads:
            t.start()
        first_tokens.wait()  # all three rows are streaming from one multi-row request
        assert stats(sidecar).policy_events["batches"] == 1
        doomed.stop(grace_s=0.0)  # killed, not drained: the streams break mid-answer
        for t in threads:
            t.join(WAIT_S)
        assert results == [grpc.StatusCode.UNAVAILABLE] * 3
        eventually(lambda: stats(sidecar).kv.reserved_blocks == 0, "the reservations are freed")
    finally:
        doomed.stop()


def test_buckets_flow_for_an_in_flight_engine_and_are_held_for_a_static_one(
    triton: TritonServer, variants: TritonServer, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    def continuous(sidecar: SidecarProcess) -> bool:
        current = admin(sidecar).UpdatePolicy(
            pb.UpdatePolicyRequest(policy_json="{}", dry_run=True)
        )
        return bool(json.loads(current.policy_json)["continuous_batching"])

    assert continuous(sidecar_factory(triton, {}, "inflight"))
    static = {"triton": {"engine_model": "engine_static"}}
    assert not continuous(sidecar_factory(variants, static, "static"))
    pinned = {"policy": {"continuous_batching": False}}
    assert not continuous(sidecar_factory(triton, pinned, "pinned"))  # the config file wins


def test_a_burst_past_what_the_lanes_drain_is_refused_at_arrival(
    triton: TritonServer, sidecar_factory: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    """Predictive admission on the real stack: once the sidecar has seen how fast its lanes
    drain, a burst's excess is refused at submission (predicted_late, with the predicted wait
    as the retry hint) rather than after a queue timeout, and every accepted request is
    served."""
    port = free_port()
    sidecar = sidecar_factory(
        triton,
        {
            "server": {"metrics_port": port},
            "queue": {"max_in_flight": 2},
            "policy": {"admission": {"min_completions": 4, "min_busy_s": 0.2}},
        },
    )
    metrics = f"http://127.0.0.1:{port}/metrics"

    def short(i: int) -> Callable[[], pb.GenerateResponse]:
        return lambda: ask(sidecar, f"Say something short, number {i}.", 8)

    def drain_learned() -> bool:
        return any(
            name == "scheduler_svc_lane_drain_tokens_per_second" and value > 0
            for (name, _), value in scrape(metrics).items()
        )

    # Learn: a short queue forms behind two running requests, and they drain (in waves of
    # four, so that none waits past hot's 250 ms target and is refused). A wave adds about two
    # completions and the time two requests take; on a fast host four waves can fall short of
    # the 0.2 s of busy time asked for, so waves go on (at most 16) until the rate is learned.
    learned: list[pb.GenerateResponse | grpc.RpcError] = []
    for w in range(16):
        learned += in_threads([short(4 * w + i) for i in range(4)])
        if w >= 3 and drain_learned():
            break
    assert sum(isinstance(r, pb.GenerateResponse) for r in learned) >= 8
    # the metrics page reads a stats snapshot that may trail by a moment
    eventually(drain_learned, "a lane's drain rate is learned")
    # The burst: far more at once than the lanes drain within the time they allow.
    burst = in_threads([short(100 + i) for i in range(48)])
    served = [r for r in burst if isinstance(r, pb.GenerateResponse)]
    refused = [r for r in burst if isinstance(r, grpc.RpcError)]
    assert len(served) + len(refused) == 48 and served
    assert all(len(r.token_ids) > 0 for r in served)
    early = [
        r
        for r in [*refused, *(r for r in learned if isinstance(r, grpc.RpcError))]
        if "would start it in about" in (r.details() or "")
    ]
    assert early, [r.details() for r in refused]
    for error in early:
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers: dict[str, str] = dict(error.trailing_metadata() or ())  # type: ignore[arg-type]
        assert int(trailers["retry-after-ms"]) > 0
    key = ("scheduler_svc_policy_events_total", frozenset({("event", "rejected_predicted_late")}))
    eventually(  # the metrics page reads a stats snapshot that may trail by a moment
        lambda: scrape(metrics)[key] == len(early), "every early refusal is counted"
    )


def test_deadline_order_goes_at_once_and_refuses_a_hot_request_past_its_target(
    triton: TritonServer, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    """The in-flight engine's deadline order on the real stack, with make run's lane targets:
    a request to an idle sidecar leaves its queue in the same turn it arrives (no batch timer,
    no bucket to fill), and a hot request that cannot start within hot's 250 ms target (the
    engine's one sequence is held by a long answer) is refused then, RESOURCE_EXHAUSTED naming
    the target, while the long request still runs: not served seconds late."""
    port = free_port()
    sidecar = sidecar_factory(
        triton, {"server": {"metrics_port": port}, "queue": {"max_in_flight": 1}}
    )
    metrics = f"http://127.0.0.1:{port}/metrics"
    long_done: list[pb.GenerateResponse] = []
    runner = threading.Thread(target=lambda: long_done.append(ask(sidecar, text_of(1100), 200)))
    runner.start()
    eventually(lambda: stats(sidecar).in_flight == 1, "the long request runs")
    wait = ("scheduler_svc_queue_wait_seconds", frozenset({("lane", "cold")}))
    eventually(lambda: scrape(metrics).get((f"{wait[0]}_count", wait[1])) == 1, "its wait seen")
    assert scrape(metrics)[(f"{wait[0]}_sum", wait[1])] < 0.005  # sent in its arrival's turn
    with pytest.raises(grpc.RpcError) as refused:
        ask(sidecar, "What time is it?", 4)
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "time-to-first-token target" in (refused.value.details() or "")
    assert not long_done and stats(sidecar).in_flight == 1  # the long answer is still running
    runner.join(WAIT_S)
    assert long_done and len(long_done[0].token_ids) == 200


def test_a_quiet_tenant_goes_ahead_of_a_noisy_tenants_backlog_and_takes_its_place(
    triton: TritonServer, sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    """Fair shares on the real stack (one engine sequence, a patient hot lane of five
    places): with the noisy tenant's answer running and its five more requests filling the
    lane, a quiet tenant's request takes the place of the noisy tenant's newest one (pushed out
    at once: RESOURCE_EXHAUSTED naming the fair share, a retry hint) and is served next, ahead
    of the four the noisy tenant queued before it. First come, first served would refuse it
    (the lane is full) and serve it last."""
    port = free_port()
    hot = {**PATIENT_HOT["lanes"][0], "max_queued": 5}
    sidecar = sidecar_factory(
        triton,
        {
            "server": {"metrics_port": port},
            "queue": {"max_in_flight": 1},
            "policy": {"lanes": [hot], "admission": {"enabled": False}},
        },
    )
    metrics = f"http://127.0.0.1:{port}/metrics"
    finished: list[str] = []
    outcomes: dict[str, Any] = {}

    def send(name: str, tenant: str, max_tokens: int) -> None:
        try:
            outcomes[name] = ask(sidecar, f"Tell me about {name}.", max_tokens, tenant=tenant)
        except grpc.RpcError as exc:
            outcomes[name] = exc
        finished.append(name)

    threads = [threading.Thread(target=send, args=("running", "noisy", 64))]
    threads[0].start()
    eventually(lambda: stats(sidecar).in_flight == 1, "the noisy tenant's answer runs")
    for i in range(5):
        threads.append(threading.Thread(target=send, args=(f"noisy{i}", "noisy", 8)))
        threads[-1].start()
        eventually(lambda n=i + 1: stats(sidecar).queued == n, f"noisy{i} waits")
    threads.append(threading.Thread(target=send, args=("quiet", "quiet", 8)))
    threads[-1].start()
    for t in threads:
        t.join(WAIT_S)
    pushed = outcomes["noisy4"]
    assert isinstance(pushed, grpc.RpcError), "the noisy tenant's newest request was served"
    assert pushed.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "fair share" in (pushed.details() or "")
    trailers: dict[str, str] = dict(pushed.trailing_metadata() or ())  # type: ignore[arg-type]
    assert int(trailers["retry-after-ms"]) > 0
    served = [n for n in finished if isinstance(outcomes[n], pb.GenerateResponse)]
    assert served == ["running", "quiet", "noisy0", "noisy1", "noisy2", "noisy3"]
    tokens = (
        "scheduler_svc_tenant_tokens_total",
        frozenset({("tenant", "quiet"), ("lane", "hot")}),
    )
    refusals = (
        "scheduler_svc_tenant_refusals_total",
        frozenset({("tenant", "noisy"), ("reason", "pushed_out")}),
    )
    page = scrape(metrics)
    assert page[tokens] > 8 and page[refusals] == 1
    assert page[("scheduler_svc_tenant_queued", frozenset({("tenant", "noisy")}))] == 0

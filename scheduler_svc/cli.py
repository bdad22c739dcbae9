"""Command line: `scheduler-svc <command>`.

Commands:
  serve    run the sidecar in front of a Triton server
  run      the embedded default: the bundled Triton with the CPU reference engine, plus the sidecar
  triton   start the bundled tritonserver on a model repository and keep it in the foreground
  simulate replay the source document's scenarios against the policy in virtual time
  model-repo render a Triton model repository from templates, or check one offline
  health   ask a sidecar's gRPC health service (exit 0 when SERVING); for container probes
  drain    drain a sidecar and wait until it is idle (Triton's preStop in Kubernetes)
  chaos    fuzz every front (gRPC, HTTP, TLS handshakes) and fault Triton (freeze, slow,
           kill, SIGTERM); reliability
  rollout  a sidecar's canary rollout: where it stands, a new share, the next step
  spec-gate  draft/target n-gram overlap on a prompt set; pass or fail (the 92 % gate)

Over 500 lines: the argument parsers of every command, and each command's few lines that call
serving or a tool; flat, read one command at a time, and no logic of its own. New work goes
into the tool's own module (`bench --engine-profile` lives in tools/bench/emulated*.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

from scheduler_svc import __version__
from scheduler_svc.config import SidecarConfig, load_config
from scheduler_svc.errors import ConfigError, SchedulerSvcError
from scheduler_svc.tools.triton.launcher import TritonPorts, TritonServer, start_tritons


def _triton(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        print(f"triton | {line}", file=sys.stderr, flush=True)

    server = TritonServer(
        args.model_repo,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        startup_timeout_s=args.startup_timeout,
        log=None if args.quiet else log,
        host=args.host,
    )

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        server.start()
        print(
            f"tritonserver ready: model repository {server.model_repo}\n"
            f"  gRPC     {server.grpc_url}\n"
            f"  HTTP     {server.http_url}\n"
            f"  metrics  {server.metrics_url}\n"
            "Ctrl-C stops it.",
            flush=True,
        )
        code = server.wait()
        print(f"tritonserver exited with code {code}", file=sys.stderr)
        return code or 1
    except KeyboardInterrupt:
        print("stopping tritonserver ...", file=sys.stderr, flush=True)
        return 0
    finally:
        server.stop()


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """CLI flags that were given, as nested config overrides."""
    flat = {
        ("triton", "url"): getattr(args, "triton_url", None),
        ("triton", "metrics_url"): getattr(args, "triton_metrics_url", None),
        ("server", "metrics_port"): getattr(args, "metrics_port", None),
        ("server", "host"): args.host,
        ("auth", "credentials_file"): getattr(args, "credentials_file", None),
        ("auth", "anonymous"): getattr(args, "anonymous", None),
        ("server", "port"): args.port,
        ("server", "admin_port"): getattr(args, "admin_port", None),
        ("server", "http_port"): getattr(args, "http_port", None),
        ("server", "log_level"): args.log_level,
    }
    nested: dict[str, Any] = {}
    for (section, key), value in flat.items():
        if value is not None:
            nested.setdefault(section, {})[key] = value
    return nested


async def _serve_until_signal(
    cfg: SidecarConfig,
    on_ready: str = "",
    config_path: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> None:
    from scheduler_svc.serving.app import Sidecar  # noqa: PLC0415 - keeps `triton` light

    sidecar = Sidecar(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    reloads: set[asyncio.Task[None]] = set()

    def reload() -> None:
        """SIGHUP: credentials and TLS files always (they are named by flags too); the policy
        only from a config file."""
        sidecar.reload_security()
        if config_path is not None:
            task = loop.create_task(sidecar.controls.reload(config_path, overrides or {}))
            reloads.add(task)  # keep a reference until it is done
            task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, reload)
    port = await sidecar.start()
    if on_ready:
        metrics_port = sidecar.metrics.port if sidecar.metrics is not None else "-"
        admin = f"127.0.0.1:{sidecar.admin_port}" if sidecar.admin_port is not None else "off"
        http = f"http://127.0.0.1:{sidecar.http_port}" if sidecar.http_port is not None else "off"
        print(
            on_ready.format(port=port, metrics_port=metrics_port, admin=admin, http=http),
            flush=True,
        )
    waiter = asyncio.create_task(sidecar.wait())
    await asyncio.wait(
        {waiter, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED
    )
    await sidecar.drain()
    waiter.cancel()


def _serve(args: argparse.Namespace) -> int:
    from scheduler_svc.serving import logs  # noqa: PLC0415

    overrides = _overrides(args)
    cfg = load_config(args.config, overrides)
    logs.configure(cfg.server.log_level)
    asyncio.run(_serve_until_signal(cfg, config_path=args.config, overrides=overrides))
    return 0


RUN_METRICS_PORT = 9464
RUN_HTTP_PORT = 8080


def _run(args: argparse.Namespace) -> int:
    """Triton with the reference engine (or `--replicas` of them), then the sidecar in front,
    until Ctrl-C."""
    from scheduler_svc.serving import logs  # noqa: PLC0415

    if not 1 <= args.replicas <= 8:
        raise ConfigError(f"--replicas must be 1 to 8 (got {args.replicas})")
    log_file = Path(args.triton_log)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        repo = Path(args.model_repo)
        if args.kv_cache_reuse:
            from scheduler_svc.tools.modelrepo import copy_repo_with  # noqa: PLC0415

            copy = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "repo"
            repo = copy_repo_with(repo, copy, "tensorrt_llm", {"enable_kv_cache_reuse": "true"})
        ports = TritonPorts(args.triton_grpc_port, args.triton_http_port, args.triton_metrics_port)
        servers = start_tritons(
            stack,
            repo,
            args.replicas,
            log_file,
            ports=ports,
            host=args.triton_host,
            announce=functools.partial(print, flush=True),
        )
        server = servers[0]
        overrides = _overrides(args)
        overrides.setdefault("triton", {})["url"] = server.grpc_url
        overrides["triton"]["metrics_url"] = server.metrics_url
        if len(servers) > 1:
            overrides["triton"]["replicas"] = [
                {"url": other.grpc_url, "metrics_url": other.metrics_url} for other in servers[1:]
            ]
        cfg = load_config(args.config, overrides)
        # The embedded default shows its metrics and serves HTTP.
        defaults = {"metrics_port": RUN_METRICS_PORT, "http_port": RUN_HTTP_PORT}
        for key, port in defaults.items():
            if getattr(cfg.server, key) is None:
                overrides.setdefault("server", {})[key] = port
        cfg = load_config(args.config, overrides)
        logs.configure(cfg.server.log_level)
        timers = "/".join(
            "–" if lane.queue_timeout_s is None else f"{lane.queue_timeout_s * 1000:g}"
            for lane in cfg.policy_config().lanes
        )
        tritons = "".join(
            f"tritonserver  gRPC {t.grpc_url}  HTTP {t.http_url}  metrics {t.metrics_url}\n"
            for t in servers
        )
        configured = cfg.triton.prefix_routing.slack
        slack = "the engine's slack" if configured is None else f"{configured} requests"
        routing = (
            f"replicas      {len(servers)} Tritons: a request goes where its session or prefix "
            f"went, within {slack} of the least loaded "
            f"(KV cache reuse {'on' if args.kv_cache_reuse else 'as the repository sets it'})\n"
            if len(servers) > 1
            else ""
        )
        ready = (
            tritons + routing + "sidecar       gRPC 127.0.0.1:{port}  "
            "(scheduler.v1, KServe v2, health, reflection)  "
            "metrics http://127.0.0.1:{metrics_port}/metrics\n"
            "              HTTP {http}  (OpenAI /v1, Triton generate /v2)\n"
            "              admin {admin} (loopback: no credential needed)\n"
            f"lanes         queue timeouts {timers} ms: the source document's A100 "
            "numbers unless the config says otherwise; a CPU engine step takes 20-60 ms, "
            'so scale them to the engine (docs/policy.md, "Timers and the engine")\n'
            "No credentials are configured: the client API is open on loopback only. To "
            "serve other hosts, set server.host and auth.credentials_file (docs/sidecar.md)."
            "\nCtrl-C stops both."
        )
        asyncio.run(
            _serve_until_signal(cfg, on_ready=ready, config_path=args.config, overrides=overrides)
        )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from scheduler_svc.tools.bench import plans, run  # noqa: PLC0415 - only this command needs it

    if args.engine_profile:
        return _bench_emulated(args)
    args.plan = args.plan or "full"
    if args.plan not in plans.PLANS:
        raise ConfigError(
            f"--plan {args.plan} needs --engine-profile (CPU plans: {', '.join(plans.PLANS)})"
        )
    chosen = plans.QUICK if args.quick else plans.PLANS[args.plan]
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out_dir = Path(args.out) if args.out else Path("results") / "bench" / f"{chosen.name}-{stamp}"
    command = "scheduler-svc bench" + (" --quick" if args.quick else f" --plan {args.plan}")
    if args.seed:
        command += f" --seed {args.seed}"
    results = run.run(chosen, out_dir, seed=args.seed, command=command)
    print((out_dir / "results.md").read_text())
    print(f"wrote {out_dir}/results.json, results.md and {len(results['plots'])} plots")
    return 0


def _bench_emulated(args: argparse.Namespace) -> int:
    from scheduler_svc.profiles import load_profile  # noqa: PLC0415
    from scheduler_svc.tools.bench import emulated, emulated_run  # noqa: PLC0415

    plan = args.plan or "agree"
    name = "quick" if args.quick else plan if plan in emulated.PLANS else None
    if name is None:
        raise ConfigError(
            f"--plan {plan}: with --engine-profile choose {', '.join(emulated.PLANS)}"
        )
    if args.time_scale is not None and args.time_scale < 1:
        raise ConfigError(f"--time-scale must be at least 1 (got {args.time_scale})")
    try:
        profile = load_profile(args.engine_profile)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    default = Path("results") / "bench" / f"{profile.name}-{name}-{stamp}"
    out_dir = Path(args.out) if args.out else default
    command = f"scheduler-svc bench --engine-profile {args.engine_profile} --plan {name}"
    if args.time_scale is not None:
        command += f" --time-scale {args.time_scale:g}"
    if args.seed:
        command += f" --seed {args.seed}"
    emulated_run.run(
        emulated.PLANS[name],
        args.engine_profile,
        profile,
        args.time_scale,
        out_dir,
        seed=args.seed,
        command=command,
    )
    print((out_dir / "results.md").read_text())
    print(f"wrote {out_dir}/results.json and results.md")
    return 0


def _chaos(args: argparse.Namespace) -> int:
    from scheduler_svc.tools import chaos  # noqa: PLC0415 - only this command needs it (and hypothesis)

    plan = chaos.Plan(
        cases=args.cases,
        http_cases=args.http_cases,
        tls_cases=args.tls_cases,
        concurrency=args.concurrency,
        streams=args.streams,
        seed=args.seed,
        phases=tuple(args.phase or chaos.Plan.phases),
    )
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(args.out) if args.out else Path("results") / "chaos" / stamp
    phases = chaos.run(plan, Path(args.model_repo), out, lambda line: print(line, flush=True))
    report = chaos.table(phases)
    (out / "results.md").write_text(report + "\n")
    (out / "results.json").write_text(
        json.dumps({"plan": plan.__dict__, "phases": [p.row() for p in phases]}, indent=1) + "\n"
    )
    print(report)
    ok = chaos.passed(phases)
    print(
        f"{'targets met' if ok else 'TARGETS MISSED'}: 0 never ended, 0 INTERNAL / UNKNOWN, 0 lost"
    )
    print(f"wrote {out}/results.md and results.json")
    return 0 if ok else 1


def _simulate(args: argparse.Namespace) -> int:
    from scheduler_svc.sim import suite  # noqa: PLC0415 - only this command needs it
    from scheduler_svc.sim.report import kv_table, table  # noqa: PLC0415

    if args.write_golden:
        result = suite.run_suite(suite.GOLDEN)
        golden = Path(args.write_golden)
        golden.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        print(f"wrote {golden} ({len(result['runs'])} runs)")
        return 0
    base = suite.KV_PROJECTION if args.kv else suite.SuiteParams()
    params = dataclasses.replace(
        base,
        scenarios=tuple(args.scenario or base.scenarios),
        engines=tuple(args.engine or base.engines),
        targets=tuple(args.target or base.targets),
        seed=args.seed,
        duration_scale=args.duration_scale,
        slo_search=not args.no_slo_search,
        kv_mode=args.kv_mode,
        kv_blocks=args.kv_blocks,
        profile=args.engine_profile or base.profile,
    )
    try:
        result = suite.run_suite(params, lambda step: print(f"  {step}", file=sys.stderr))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(result["runs"]))
    for field in ("goodput_rps", "qps_at_slo"):
        print(f"policy / fifo, {field}: {suite.ratios(result['runs'], field)}")
    if params.slo_search and "inflight_noevict" in params.engines:
        print("\nQPS at the SLO: P99 time to first token within each lane's bound")
        print(kv_table(result["runs"]))
        if params.tpot_slo_s is not None:
            bound = f"{params.tpot_slo_s * 1000:.0f} ms"
            print(f"\nQPS at the SLO: the same, and P99 time per output token within {bound}")
            print(kv_table(result["runs"], "_tpot"))
    out = Path(args.json or ("results/simulate-kv.json" if args.kv else "results/simulate.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"all figures: {out}")
    return 0


def _model_repo_render(args: argparse.Namespace) -> int:
    from scheduler_svc.tools import modelrepo  # noqa: PLC0415 - only this command needs it

    template = Path(args.template)
    values: dict[str, object] = {}
    values_file = Path(args.values) if args.values else template / "values.yaml"
    if values_file.is_file():
        loaded = yaml.safe_load(values_file.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{values_file} must be a mapping of key: value")
        values.update(loaded)
    elif args.values:
        raise ConfigError(f"values file {values_file} does not exist")
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: use KEY=VALUE")
        values[key] = value
    written = modelrepo.render(template, values, Path(args.out))
    problems = modelrepo.check(Path(args.out))
    print(f"wrote {len(written)} files to {args.out}")
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _model_repo_check(args: argparse.Namespace) -> int:
    from scheduler_svc.tools import modelrepo  # noqa: PLC0415

    problems = modelrepo.check(Path(args.repo))
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    if not problems:
        print(f"{args.repo}: every config.pbtxt parses and every ensemble is wired consistently")
    return 1 if problems else 0


def _tool_channel(args: argparse.Namespace) -> Any:
    """The channel a tool (health, drain, rollout) dials: plaintext, or TLS with --ca-file (a
    client certificate too with --cert-file/--key-file, for a listener that requires one)."""
    import grpc  # noqa: PLC0415

    if args.ca_file is None:
        if args.cert_file or args.key_file:
            raise ConfigError("--cert-file/--key-file need --ca-file (TLS)")
        return grpc.insecure_channel(args.address)
    try:
        roots = Path(args.ca_file).read_bytes()
        key = Path(args.key_file).read_bytes() if args.key_file else None
        chain = Path(args.cert_file).read_bytes() if args.cert_file else None
    except OSError as exc:
        raise ConfigError(f"cannot read {exc.filename}: {exc.strerror}") from None
    options = []
    if args.server_name:
        options.append(("grpc.ssl_target_name_override", args.server_name))
    credentials = grpc.ssl_channel_credentials(roots, key, chain)
    return grpc.secure_channel(args.address, credentials, options)


def _health(args: argparse.Namespace) -> int:
    import grpc  # noqa: PLC0415
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

    with _tool_channel(args) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(  # type: ignore[attr-defined]  # the stubs leave Check untyped
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _drain(args: argparse.Namespace) -> int:
    """Drain a sidecar through its admin listener and wait until nothing is queued or running
    (a Kubernetes preStop on Triton, so Triton stops only after the sidecar has let go)."""
    import grpc  # noqa: PLC0415

    from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb  # noqa: PLC0415
    from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc  # noqa: PLC0415

    deadline = time.monotonic() + args.timeout
    token = os.environ.get("SCHEDULER_SVC_ADMIN_TOKEN")  # never a flag: argv is public
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with _tool_channel(args) as channel:
        admin = pb_grpc.AdminStub(channel)  # type: ignore[no-untyped-call]
        try:
            admin.Drain(pb.DrainRequest(), timeout=5, metadata=metadata)
            while time.monotonic() < deadline:
                stats = admin.GetStats(pb.GetStatsRequest(), timeout=5, metadata=metadata)
                if stats.queued == 0 and stats.in_flight == 0:
                    print(f"{args.address}: drained")
                    return 0
                time.sleep(0.5)
        except grpc.RpcError as exc:  # nothing drained: a wrong address, or no sidecar there
            print(
                f"{args.address}: nothing drained: {exc.code().name}: {exc.details()}",
                file=sys.stderr,
            )
            return 1
    print(f"{args.address}: still busy after {args.timeout:g} s", file=sys.stderr)
    return 1


def _rollout(args: argparse.Namespace) -> int:
    """Show or change a sidecar's rollout through its admin listener."""
    import grpc  # noqa: PLC0415

    from scheduler_svc._gen.scheduler.v1 import scheduler_pb2 as pb  # noqa: PLC0415
    from scheduler_svc._gen.scheduler.v1 import scheduler_pb2_grpc as pb_grpc  # noqa: PLC0415

    token = os.environ.get("SCHEDULER_SVC_ADMIN_TOKEN")  # never a flag: argv is public
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with _tool_channel(args) as channel:
        admin = pb_grpc.AdminStub(channel)  # type: ignore[no-untyped-call]
        try:
            if args.action == "set":
                reply = admin.SetRollout(
                    pb.SetRolloutRequest(weight=args.weight), timeout=5, metadata=metadata
                )
            elif args.action == "advance":
                reply = admin.SetRollout(
                    pb.SetRolloutRequest(advance=True), timeout=5, metadata=metadata
                )
            else:
                reply = admin.GetRollout(pb.GetRolloutRequest(), timeout=5, metadata=metadata)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(
        f"{reply.current} -> {reply.candidate}: {reply.phase}, candidate at {reply.weight} %"
        + (f", current drains in {reply.hold_left_s:.0f} s" if reply.phase == "hold" else "")
    )
    print(f"{'group':<16}{'share':>7}{'ready':>7}{'requests':>10}{'errors':>8}{'SLO met':>9}")
    for g in reply.groups:
        met = f"{g.attained / g.requests:.1%}" if g.requests else "-"
        print(f"{g.group:<16}{g.share:>6}%{g.ready!s:>7}{g.requests:>10}{g.errors:>8}{met:>9}")
    return 0


def _spec_gate(args: argparse.Namespace) -> int:
    from scheduler_svc.contracts.gate_result import write_result  # noqa: PLC0415
    from scheduler_svc.serving.tokenizer import load_tokenizer  # noqa: PLC0415
    from scheduler_svc.tools import specgate  # noqa: PLC0415

    draft = specgate.ModelAddress.parse(args.draft)
    target = specgate.ModelAddress.parse(args.target)
    if not 0 < args.threshold <= 1:
        raise ConfigError(f"--threshold: {args.threshold} is outside (0, 1]")
    if not 1 <= args.max_tokens <= 4096:
        raise ConfigError(f"--max-tokens: {args.max_tokens} is outside 1..4096")
    tokenizer = load_tokenizer(args.tokenizer_dir)
    prompts = [tokenizer.encode(p).ids for p in specgate.read_prompts(args.prompts)]

    async def both() -> tuple[list[list[int]], list[list[int]]]:
        ends = (args.end_id, args.pad_id)
        return (
            await specgate.greedy_outputs(draft, prompts, args.max_tokens, *ends),
            await specgate.greedy_outputs(target, prompts, args.max_tokens, *ends),
        )

    try:
        drafts, targets = asyncio.run(both())
    except Exception as exc:  # grpc's errors and the backend's: one line, exit 2
        raise ConfigError(f"cannot run the models: {type(exc).__name__}: {exc}") from None
    result = specgate.judge(
        list(zip(drafts, targets, strict=True)), args.threshold, str(draft), str(target)
    )
    print(
        f"draft  {draft}\ntarget {target}\nprompts {result.prompts}, max_tokens {args.max_tokens}"
    )
    print(f"{'n':>3}{'overlap':>10}")
    for n, share in result.overlap.items():
        print(f"{n:>3}{share:>10.1%}")
    verdict = "PASS" if result.passed else "FAIL"
    print(f"{verdict}: smallest overlap {result.deciding:.1%}, threshold {args.threshold:.0%}")
    if args.out:
        write_result(result, Path(args.out))
        print(f"wrote {args.out}")
    return 0 if result.passed else 1


def _tls_flags(cmd: argparse.ArgumentParser) -> None:
    """A tool's TLS to the sidecar (an admin listener on loopback is always plaintext)."""
    cmd.add_argument("--ca-file", help="TLS: the CA that signed the sidecar's certificate")
    cmd.add_argument("--cert-file", help="TLS: a client certificate (a listener requiring one)")
    cmd.add_argument("--key-file", help="TLS: its private key")
    cmd.add_argument("--server-name", help="TLS: the name to expect in the sidecar's certificate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scheduler-svc",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"scheduler-svc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    def sidecar_flags(cmd: argparse.ArgumentParser) -> None:
        cmd.add_argument("--config", help="YAML config file (see config.example.yaml)")
        cmd.add_argument("--host", help="listen address (server.host)")
        cmd.add_argument("--credentials-file", help="tokens and identities (auth.credentials_file)")
        cmd.add_argument(
            "--anonymous",
            choices=("auto", "client", "none"),
            help="what callers without a credential may do (auth.anonymous); serving other "
            "hosts with no credentials file needs 'client', said on purpose",
        )
        cmd.add_argument("--port", type=int, help="gRPC port, 0 for a free one (server.port)")
        cmd.add_argument(
            "--admin-port",
            type=int,
            help="admin listener port, 0 for a free one (server.admin_port)",
        )
        cmd.add_argument(
            "--http-port",
            type=int,
            help="HTTP port (OpenAI /v1, Triton generate), 0 for a free one (server.http_port)",
        )
        cmd.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
        cmd.add_argument(
            "--metrics-port", type=int, help="Prometheus metrics port (server.metrics_port)"
        )

    serve = commands.add_parser("serve", help="run the sidecar in front of a Triton server")
    serve.add_argument("--triton-url", help="Triton gRPC address HOST:PORT (triton.url)")
    serve.add_argument(
        "--triton-metrics-url", help="Triton's metrics page, for KV counts (triton.metrics_url)"
    )
    sidecar_flags(serve)
    serve.set_defaults(func=_serve)

    run = commands.add_parser("run", help="the embedded default: bundled Triton + the sidecar")
    run.add_argument("--model-repo", default="model_repo/cpu", help="model repository folder")
    run.add_argument("--triton-grpc-port", type=int, default=8001)
    run.add_argument("--triton-http-port", type=int, default=8000)
    run.add_argument("--triton-metrics-port", type=int, default=8002)
    run.add_argument(
        "--triton-host",
        default="127.0.0.1",
        help="where Triton's own ports listen (loopback: they answer anyone, past every guard)",
    )
    run.add_argument("--triton-log", default="results/triton.log", help="where Triton's log goes")
    run.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="Tritons to start (1-8; the others on free ports, logs triton-2.log...), all behind "
        "the one sidecar with prefix and session affinity (triton.prefix_routing)",
    )
    run.add_argument(
        "--kv-cache-reuse",
        action="store_true",
        help="serve a copy of the repository with the engine's enable_kv_cache_reuse on",
    )
    sidecar_flags(run)
    run.set_defaults(func=_run)

    triton = commands.add_parser(
        "triton", help="run the bundled tritonserver on a model repository"
    )
    triton.add_argument("--model-repo", default="model_repo/cpu", help="model repository folder")
    triton.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (0: a free one)")
    triton.add_argument("--http-port", type=int, default=8000, help="HTTP port (0: a free one)")
    triton.add_argument(
        "--metrics-port", type=int, default=8002, help="metrics port (0: a free one)"
    )
    triton.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for readiness"
    )
    triton.add_argument("--quiet", action="store_true", help="do not forward Triton's log")
    triton.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address its ports listen on (0.0.0.0: every host, unauthenticated)",
    )
    triton.set_defaults(func=_triton)

    _add_tool_commands(commands)
    _add_rollout_commands(commands)
    return parser


def _add_bench_command(commands: Any) -> None:
    """`bench`: Triton alone against the sidecar, on the CPU engine or an emulated GPU."""
    bench = commands.add_parser(
        "bench",
        help="measure Triton alone against the sidecar (FIFO and policy) on the embedded stack",
    )
    bench.add_argument(
        "--quick", action="store_true", help="one mix, two loads, the burst (<3 min)"
    )
    bench.add_argument(
        "--plan",
        choices=(
            "full",
            "slo",
            "kv",
            "deadline",
            "budget",
            "overload",
            "guard",
            "prefill",
            "rows",
            "below",
            "agree",
            "document",
        ),
        default=None,
        help="on the CPU engine: full (the default: every mix, load and QPS-at-SLO search), "
        "slo (QPS at the P99 SLO on the static engine, longer trials), kv (QPS at the P99 SLO "
        "under KV pressure), deadline (issue 28's targets), budget (make run's sidecar against "
        "a pinned two-step prefill budget), overload (issue 28's overload and 8:1 at 0.9x, twice), "
        "guard (make run's sidecar against the same without its row guard, mixed and the burst), "
        "prefill (the same without its prefill guard, mixed and 8:1), rows (the same without "
        "the row wait at admission, mixed, 8:1 and the burst), below (issue 28's below-saturation "
        "cells twice, beside Triton alone run again on the same arrivals: the noise floor); "
        "with --engine-profile: agree (the default: the "
        "simulator against the live stack) or document (the source document's table on the "
        "profile)",
    )
    bench.add_argument(
        "--engine-profile",
        help="run on the reference engine with emulated timing from this cost profile (a "
        "bundled name, h200-8b-bf16 or a100-8b-awq, or a profile file)",
    )
    bench.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="with --engine-profile: each engine step takes its modelled time x this of wall "
        "time (arrivals slow and timers stretch with it); default: per mix, so that at its "
        "capacity the stack streams ~400 tokens a wall second",
    )
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", help="results folder (default: results/bench/<plan>-<time>)")
    bench.set_defaults(func=_bench)


def _add_tool_commands(commands: Any) -> None:
    """Commands that need no running sidecar: simulate, model-repo, health."""
    sim = commands.add_parser(
        "simulate", help="replay the source document's scenarios (A100 estimate by default)"
    )
    sim.add_argument("--scenario", action="append", help="a scenario (repeat; default: all)")
    sim.add_argument(
        "--engine",
        action="append",
        choices=["inflight", "inflight_noevict", "static"],
        help="inflight: max_utilization KV; inflight_noevict: guaranteed_no_evict; static: V1",
    )
    sim.add_argument(
        "--kv",
        action="store_true",
        help="the KV-pressure projection (issue 15): kv scenarios, both KV policies, 256 sequences",
    )
    sim.add_argument("--target", action="append", choices=["fifo", "priority", "policy"])
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument(
        "--duration-scale", type=float, default=1.0, help="multiply each scenario's duration"
    )
    sim.add_argument(
        "--kv-mode",
        choices=["paged", "contiguous"],
        default="paged",
        help="engine and mirror KV allocation; contiguous is the source document's 'before'",
    )
    sim.add_argument(
        "--kv-blocks",
        type=int,
        help="the engine's KV pool in blocks (default: what the profile's GPU leaves)",
    )
    sim.add_argument(
        "--engine-profile",
        help="the engine's cost profile: a bundled name (a100-8b-awq, the default; "
        "h200-8b-bf16) or a profile file (benchmarks/gpu_profile.py writes one)",
    )
    sim.add_argument("--no-slo-search", action="store_true", help="skip the QPS-at-SLO bisection")
    sim.add_argument(
        "--json", help="where the figures go (results/simulate.json, or simulate-kv.json)"
    )
    sim.add_argument(
        "--write-golden",
        metavar="FILE",
        help="write the stored summaries the tests compare to FILE (make sim-golden: "
        "tests/data/sim_golden.json)",
    )
    sim.set_defaults(func=_simulate)

    _add_bench_command(commands)

    repo = commands.add_parser("model-repo", help="render or check a Triton model repository")
    repo_commands = repo.add_subparsers(dest="repo_command", required=True)
    render = repo_commands.add_parser("render", help="write a repository from templates")
    render.add_argument("--template", default="model_repo/trtllm", help="template folder")
    render.add_argument("--values", help="YAML of key: value (default: <template>/values.yaml)")
    render.add_argument("--set", action="append", metavar="KEY=VALUE", help="override one value")
    render.add_argument("--out", required=True, help="output folder (new or empty)")
    render.set_defaults(func=_model_repo_render)
    check = repo_commands.add_parser("check", help="parse and cross-check every config.pbtxt")
    check.add_argument("repo", help="model repository folder")
    check.set_defaults(func=_model_repo_check)

    health = commands.add_parser("health", help="exit 0 if a sidecar's gRPC health is SERVING")
    health.add_argument("--address", default="127.0.0.1:50051", help="HOST:PORT of the sidecar")
    _tls_flags(health)
    health.add_argument("--service", default="", help="service name ('' is the whole server)")
    health.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for an answer")
    health.set_defaults(func=_health)

    chaos = commands.add_parser(
        "chaos", help="fuzz every front and fault Triton; print the reliability figures"
    )
    chaos.add_argument("--model-repo", default="model_repo/cpu", help="Triton model repository")
    chaos.add_argument("--cases", type=int, default=100_000, help="fuzzed gRPC calls to send")
    chaos.add_argument(
        "--http-cases", type=int, default=50_000, help="fuzzed calls on the HTTP fronts"
    )
    chaos.add_argument("--tls-cases", type=int, default=5_000, help="TLS handshakes, all kinds")
    chaos.add_argument("--concurrency", type=int, default=32, help="calls in flight at once")
    chaos.add_argument("--streams", type=int, default=4, help="streams per fault phase")
    chaos.add_argument("--seed", type=int, default=0, help="hypothesis seed")
    chaos.add_argument(
        "--phase",
        action="append",
        choices=["fuzz", "http", "tls", "freeze", "slow", "kill", "sigterm"],
        help="run only these phases (repeatable)",
    )
    chaos.add_argument("--out", help="results folder (default results/chaos/<time>)")
    chaos.set_defaults(func=_chaos)

    drain = commands.add_parser(
        "drain", help="drain a sidecar (admin listener) and wait until it is idle; for preStop"
    )
    drain.add_argument("--address", default="127.0.0.1:50052", help="the admin listener")
    _tls_flags(drain)
    drain.add_argument("--timeout", type=float, default=30.0, help="seconds to wait at most")
    drain.set_defaults(func=_drain)


def _add_rollout_commands(commands: Any) -> None:
    """The rollout's operator command and the speculative-decoding gate."""
    rollout = commands.add_parser(
        "rollout", help="show or change a sidecar's canary rollout (admin listener)"
    )
    rollout.add_argument("--address", default="127.0.0.1:50052", help="the admin listener")
    _tls_flags(rollout)
    actions = rollout.add_subparsers(dest="action")
    actions.add_parser("status", help="where the rollout stands (the default)")
    weight = actions.add_parser("set", help="give the candidate a share of the traffic")
    weight.add_argument("weight", type=int, help="percent, 0..100 (0 takes it all back)")
    actions.add_parser("advance", help="the next configured step (rollout.steps)")
    rollout.set_defaults(func=_rollout)

    gate = commands.add_parser(
        "spec-gate",
        help="run a draft and a target model greedily on a prompt set; report n-gram overlap",
    )
    gate.add_argument("--draft", required=True, help="HOST:PORT/MODEL of the draft engine")
    gate.add_argument("--target", required=True, help="HOST:PORT/MODEL of the target engine")
    gate.add_argument("--prompts", required=True, help="a text file, one prompt per line")
    gate.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    gate.add_argument(
        "--threshold", type=float, default=0.92, help="the overlap to pass (the document's 92 %%)"
    )
    gate.add_argument("--out", help="write the result JSON here (what spec_gate.result_file reads)")
    gate.add_argument(
        "--tokenizer-dir", default="deepseek-v4", help="tokenizer (model.tokenizer_dir)"
    )
    gate.add_argument("--end-id", type=int, default=1, help="the model's end token id")
    gate.add_argument("--pad-id", type=int, default=2, help="the model's pad token id")
    gate.set_defaults(func=_spec_gate)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SchedulerSvcError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

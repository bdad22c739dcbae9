"""Command line: `scheduler-svc <command>`.

Commands:
  triton   start the bundled tritonserver on a model repository and keep it in the foreground
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from scheduler_svc import __version__
from scheduler_svc.errors import SchedulerSvcError
from scheduler_svc.triton.launcher import TritonServer


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scheduler-svc",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"scheduler-svc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

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
    triton.set_defaults(func=_triton)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SchedulerSvcError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

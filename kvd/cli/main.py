"""`kvd`: the daemon and its operator tools (`kvd --version`: the release, see CHANGELOG.md).

kvd serve      run the daemon (config: defaults < --config TOML < KVD_* env < flags);
               --print-config shows the effective config and where each value came from
kvd selftest   move a checksummed pattern between two daemons through NIXL and verify it
               (--vram: engines' KV in GPU memory, registered through CUDA IPC)
kvd status     what a daemon is doing (--json for machines, --watch to refresh)
kvd health     exit 0 if a daemon's health service says SERVING, else 1 (probes, HEALTHCHECK)
kvd bench      kvd pulls vs raw NIXL reads of the same bytes, side by side; JSON and plots
kvd demo       prefill -> decode -> next turn with two daemons and two reference engines
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import sys

from kvd import __version__
from kvd.cli.bench import add_bench_arguments
from kvd.cli.health import add_health_arguments
from kvd.cli.status import add_status_arguments
from kvd.cli.tls import add_tls_arguments
from kvd.config import add_config_flags, format_config, resolve_from_args
from kvd.dataplane_protocol import STACKS_SIGNAL

logger = logging.getLogger(__name__)


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("nixl").setLevel(logging.WARNING)


def _cmd_serve(args: argparse.Namespace) -> int:
    """Exit 2 for a config problem, 1 for a runtime one; either way one line on stderr."""
    try:
        resolved = resolve_from_args(args)
    except ValueError as exc:
        print(f"kvd serve: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        for warning in resolved.warnings:
            print(f"kvd serve: warning: {warning}", file=sys.stderr)
        print(format_config(resolved), end="")
        return 0
    config = resolved.config
    _configure_logging(config.log_level)
    # A crash in native code (NIXL, UCX, torch) must not pass for a plain exit: SIGSEGV, SIGBUS,
    # SIGFPE, SIGABRT and SIGILL write every thread's Python stack to the log before the process dies.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # An operator's `kill -USR1` (or `systemctl kill -s USR1 --kill-whom=main kvd`) asks a daemon
    # that seems stuck where each thread is, without ending it: the same signal asks a worker.
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    for warning in resolved.warnings:
        logger.warning("%s", warning)
    from kvd.server.notify import Notifier  # noqa: PLC0415
    from kvd.server.startup import StartupError, preflight  # noqa: PLC0415

    try:
        preflight(config)  # before the heavy imports: a port in use is reported at once
        from kvd.server.app import serve  # noqa: PLC0415 - torch, NIXL: only for serve

        return asyncio.run(serve(config))
    except StartupError as exc:
        print(f"kvd serve: {exc}", file=sys.stderr)
        notifier = Notifier(config.notify_socket)  # systemctl status shows why, next to the exit code
        notifier.status(f"failed to start: {exc.cause}")
        notifier.close()
        return exc.exit_code


def _cmd_selftest(args: argparse.Namespace) -> int:
    from kvd.cli.selftest import run_selftest  # noqa: PLC0415

    _configure_logging("WARNING")
    return run_selftest(args)


def _cmd_status(args: argparse.Namespace) -> int:
    from kvd.cli.status import run_status  # noqa: PLC0415

    return run_status(args)


def _cmd_health(args: argparse.Namespace) -> int:
    from kvd.cli.health import run_health  # noqa: PLC0415

    return run_health(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvd.cli.bench import run_bench  # noqa: PLC0415

    _configure_logging("WARNING")
    return run_bench(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvd.cli.demo import run_demo  # noqa: PLC0415

    _configure_logging("WARNING")
    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvd", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kvd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon")
    add_config_flags(serve)
    serve.add_argument(
        "--print-config", action="store_true", help="print the effective config, each value with its source, and exit"
    )
    serve.set_defaults(func=_cmd_serve)

    selftest = sub.add_parser("selftest", help="check that two daemons move KV correctly through NIXL")
    selftest.add_argument("--target", default="", help="local daemon (default: start one for the test)")
    selftest.add_argument("--peer", default="", help="peer daemon host:port (default: start one for the test)")
    selftest.add_argument(
        "--size-mb", type=int, default=128, help="bytes to move per pull, in MiB (1..1024, default 128)"
    )
    selftest.add_argument("--iterations", type=int, default=5, help="timed pulls (default 5)")
    selftest.add_argument("--seed", type=int, default=0, help="pattern seed (default: random)")
    add_tls_arguments(selftest)  # TCP calls (the peer; --target when TCP) and the daemons it starts speak mTLS
    selftest.add_argument(
        "--vram",
        action="store_true",
        help="both engines' KV in GPU memory, registered through CUDA IPC; raw read VRAM to VRAM "
        "(needs CUDA; starts both daemons, so no --target/--peer)",
    )
    selftest.add_argument("--device", type=int, default=0, help="CUDA device of --vram (default 0)")
    selftest.add_argument("--json", default="", metavar="PATH", help="also write the result as JSON to PATH")
    selftest.set_defaults(func=_cmd_selftest)

    status = sub.add_parser("status", help="what a daemon is doing (person-readable; --json, --watch)")
    add_status_arguments(status)
    status.set_defaults(func=_cmd_status)

    health = sub.add_parser("health", help="exit 0 if a daemon's health service says SERVING, else 1")
    add_health_arguments(health)
    health.set_defaults(func=_cmd_health)

    bench = sub.add_parser(
        "bench", help="kvd pulls vs raw NIXL reads, concurrency, first contact, conversions; JSON and plots"
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)

    demo = sub.add_parser("demo", help="prefill -> decode -> next turn, two daemons, two reference engines")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

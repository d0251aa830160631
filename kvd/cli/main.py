"""`kvd`: the daemon and its operator tools.

    kvd serve      run the daemon (config: defaults < --config TOML < KVD_* env < flags)
    kvd selftest   move a checksummed pattern between two daemons through NIXL and verify it
    kvd status     print a daemon's status
    kvd bench      kvd pull vs a raw NIXL read of the same bytes, side by side
    kvd demo       prefill -> decode -> next turn with two daemons and two reference engines
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kvd.config import add_config_flags, config_from_args

logger = logging.getLogger(__name__)


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("nixl").setLevel(logging.WARNING)


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvd serve: {exc}", file=sys.stderr)
        return 2
    _configure_logging(config.log_level)
    from kvd.server.app import serve  # noqa: PLC0415 - heavy imports only for serve

    return asyncio.run(serve(config))


def _cmd_selftest(args: argparse.Namespace) -> int:
    from kvd.cli.selftest import run_selftest  # noqa: PLC0415

    _configure_logging("WARNING")
    return run_selftest(args)


def _cmd_status(args: argparse.Namespace) -> int:
    from google.protobuf import json_format  # noqa: PLC0415

    from kvd_client import KvdClient, errors  # noqa: PLC0415

    try:
        with KvdClient(args.target, timeout_s=args.timeout) as client:
            print(json_format.MessageToJson(client.get_status(), preserving_proto_field_name=True))
    except errors.KvdError as exc:
        print(f"kvd status: {args.target}: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 1
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvd.cli.bench import run_bench  # noqa: PLC0415

    _configure_logging("WARNING")
    return run_bench(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvd.cli.demo import run_demo  # noqa: PLC0415

    _configure_logging("WARNING")
    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvd", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon")
    add_config_flags(serve)
    serve.set_defaults(func=_cmd_serve)

    selftest = sub.add_parser("selftest", help="check that two daemons move KV correctly through NIXL")
    selftest.add_argument("--target", default="", help="local daemon (default: start one for the test)")
    selftest.add_argument("--peer", default="", help="peer daemon host:port (default: start one for the test)")
    selftest.add_argument("--size-mb", type=int, default=128, help="bytes to move per pull, in MiB (default 128)")
    selftest.add_argument("--iterations", type=int, default=5, help="timed pulls (default 5)")
    selftest.add_argument("--seed", type=int, default=0, help="pattern seed (default: random)")
    selftest.set_defaults(func=_cmd_selftest)

    status = sub.add_parser("status", help="print a daemon's status as JSON")
    status.add_argument("--target", default="127.0.0.1:50151", help="daemon address (host:port or unix:///path)")
    status.add_argument("--timeout", type=float, default=5.0)
    status.set_defaults(func=_cmd_status)

    bench = sub.add_parser("bench", help="kvd pull vs a raw NIXL read of the same bytes, side by side in one run")
    bench.add_argument("--size-mb", type=int, default=128)
    bench.add_argument("--iterations", type=int, default=10)
    bench.set_defaults(func=_cmd_bench)

    demo = sub.add_parser("demo", help="prefill -> decode -> next turn, two daemons, two reference engines")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

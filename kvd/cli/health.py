"""`kvd health`: is a daemon serving? The stock gRPC health check, as an exit status.

For probes that run a command rather than speak gRPC: the node image's ``HEALTHCHECK``
(deploy/Containerfile), a shell script, a person. It asks the listener named by ``--target``
(default: the plaintext health-only listener of deploy/kvd.toml and the DaemonSet, port 50152)
and exits 0 when the daemon reports SERVING, 1 when it is unreachable or NOT_SERVING (starting,
draining, no data-plane worker serving), 2 for flags it cannot use.
"""

from __future__ import annotations

import argparse
import sys

from kvd.cli.tls import TlsFlagsError, add_tls_arguments, tls_from_args
from kvd_client import KvdClient, errors

DEFAULT_HEALTH_TARGET = "127.0.0.1:50152"


def add_health_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default=DEFAULT_HEALTH_TARGET,
        help=f"the daemon's health_port, its TCP port or unix:///path (default {DEFAULT_HEALTH_TARGET})",
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer (default 3)")
    add_tls_arguments(parser)


def run_health(args: argparse.Namespace) -> int:
    try:
        tls = tls_from_args(args)
    except TlsFlagsError as exc:
        print(f"kvd health: {exc}", file=sys.stderr)
        return 2
    try:
        with KvdClient(args.target, timeout_s=args.timeout, tls=tls) as client:
            serving = client.health_check(timeout_s=args.timeout)
    except errors.KvdError as exc:
        print(f"kvd health: {args.target}: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 1
    print(f"{args.target}: {'SERVING' if serving else 'NOT_SERVING or unreachable'}")
    return 0 if serving else 1

"""`kvd status`: what a daemon is doing, for a person (default), a machine (``--json``) or a screen (``--watch``).

The person-readable view puts together the daemon's ``GetStatus`` (its version, and this CLI's
where they differ; engines and their layouts, peers with incarnation and last contact, leases,
transfers in flight) and its Prometheus
``/metrics`` page (bytes moved, outcomes, errors; rates between two refreshes under ``--watch``).
``--json`` prints every field of ``GetStatus``, zeros included, with numbers as numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from kvd import __version__
from kvd.cli.tls import TlsFlagsError, add_tls_arguments, tls_from_args
from kvd.core import metrics_text
from kvd_client import KvdClient, errors
from kvd_client.pb import router_pb2

_LAYOUT = {1: "NHD", 2: "HND"}
_FORMAT = {1: "split K/V", 2: "joint K|V", 3: "MLA", 4: "packed K|V"}
_DTYPE = {1: "fp16", 2: "bf16", 3: "fp32", 4: "fp8e4m3", 5: "fp8e5m2", 6: "uint8"}


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:50151", help="daemon address (host:port or unix:///path)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")
    parser.add_argument("--json", action="store_true", help="print GetStatus as JSON (every field) for machines")
    parser.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until interrupted, with rates between refreshes",
    )
    parser.add_argument("--metrics", default="", help="host:port of /metrics (default: what the daemon reports)")
    add_tls_arguments(parser)


def run_status(args: argparse.Namespace) -> int:
    try:
        tls = tls_from_args(args)
    except TlsFlagsError as exc:
        print(f"kvd status: {exc}", file=sys.stderr)
        return 2
    previous: Snapshot | None = None
    try:
        with KvdClient(args.target, timeout_s=args.timeout, tls=tls) as client:
            while True:
                snapshot = take_snapshot(client, args.target, args.metrics, args.timeout)
                if args.json:
                    text = json.dumps(message_to_dict(snapshot.status), indent=2)
                else:
                    text = render(snapshot, previous, args.target)
                if args.watch is not None and sys.stdout.isatty():
                    sys.stdout.write("\x1b[H\x1b[2J")  # clear the screen between refreshes
                print(text, flush=True)
                if args.watch is None:
                    return 0
                previous = snapshot
                time.sleep(args.watch)
                if not args.json and not sys.stdout.isatty():
                    print(flush=True)
    except errors.KvdError as exc:
        print(f"kvd status: {args.target}: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


@dataclasses.dataclass
class Snapshot:
    """One look at a daemon: its status, its metrics (empty with the reason when unreachable), when."""

    status: router_pb2.GetStatusResponse
    metrics: dict[str, float]
    metrics_error: str
    taken_at: float


def take_snapshot(client: KvdClient, target: str, metrics_override: str, timeout_s: float) -> Snapshot:
    status = client.get_status()
    address = metrics_override or metrics_address_for(status.metrics_address, target)
    samples: dict[str, float] = {}
    problem = ""
    if address:
        try:
            samples = _sum_samples(metrics_text.samples(metrics_text.fetch(address, timeout_s)))
        except OSError as exc:
            problem = f"metrics at {address} unreachable: {getattr(exc, 'reason', None) or exc}"
    else:
        problem = "metrics disabled on this daemon"
    return Snapshot(status, samples, problem, time.monotonic())


def metrics_address_for(reported: str, target: str) -> str:
    """Where to scrape: the daemon's metrics address, with a wildcard host replaced by the target's host."""
    if not reported:
        return ""
    host, _, port = reported.rpartition(":")
    if host in ("0.0.0.0", "::", "[::]"):
        if target.startswith("unix:"):
            host = "127.0.0.1"
        else:
            host = target.split("://", 1)[-1].rpartition(":")[0] or "127.0.0.1"
    return f"{host}:{port}"


def _sum_samples(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    """Samples keyed ``name|label=value|...`` (labels sorted), plus per-name totals under ``name``."""
    out: dict[str, float] = {}
    for name, labels, value in samples:
        out[name] = out.get(name, 0.0) + value
        for key, label in labels.items():
            if key in ("direction", "outcome", "operation", "code", "reason"):
                keyed = f"{name}|{key}={label}"
                out[keyed] = out.get(keyed, 0.0) + value
        if "operation" in labels and "code" in labels:
            pair = f"{name}|operation={labels['operation']}|code={labels['code']}"
            out[pair] = out.get(pair, 0.0) + value
        if "direction" in labels and "outcome" in labels:
            pair = f"{name}|direction={labels['direction']}|outcome={labels['outcome']}"
            out[pair] = out.get(pair, 0.0) + value
    return out


# --- JSON ---------------------------------------------------------------------------------------


def message_to_dict(message: Message) -> dict[str, Any]:
    """Every field of ``message`` (defaults included), 64-bit integers as JSON numbers, enums by name."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if _is_map(field):
            out[field.name] = dict(value)
        elif _is_repeated(field):
            out[field.name] = [_field_value(field, item) for item in value]
        else:
            out[field.name] = _field_value(field, value)
    return out


def _is_map(field: Any) -> bool:
    entry = field.message_type if field.type == FieldDescriptor.TYPE_MESSAGE else None
    return entry is not None and entry.GetOptions().map_entry


def _is_repeated(field: Any) -> bool:
    flag = getattr(field, "is_repeated", None)  # protobuf >= 5.28; `label` is deprecated there
    return bool(flag) if flag is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _field_value(field: Any, value: Any) -> Any:
    """One field's value as JSON (``field`` is a protobuf FieldDescriptor, of either implementation)."""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_to_dict(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        enum_value = field.enum_type.values_by_number.get(value)
        return enum_value.name if enum_value is not None else value
    if field.type == FieldDescriptor.TYPE_BYTES:
        return value.hex()
    return value


# --- the person-readable view ----------------------------------------------------------------------


def render(snapshot: Snapshot, previous: Snapshot | None, target: str) -> str:
    s = snapshot.status
    lines = [
        f"kvd {s.incarnation[:8]} at {target}: {'serving' if s.serving else 'NOT serving (shutting down)'}, "
        f"up {_duration(s.uptime_s)}, {_version(s.version)}",
        f"  agent {s.agent_name}, data-plane worker pid {s.dataplane_pid or '-'}"
        + (
            f", restarted {s.dataplane_restarts}x (last: {s.dataplane_last_restart})"
            if s.dataplane_restarts
            else ", never restarted"
        ),
        f"  peers reach it at {s.peer_address or '-'}; metrics at {s.metrics_address or 'off'}",
        "",
    ]
    lines += _engines(s)
    lines += _peers(s)
    lines.append(f"leases: {s.leases_held} held, {s.leases_draining} draining (reads under way)")
    if s.holds_ended:
        ended = ", ".join(f"{count} {reason}" for reason, count in sorted(s.holds_ended.items()))
        lines.append(f"  ended since start: {ended}")
    lines.append(f"transfers in flight: {s.transfers_in_flight}")
    lines.append("")
    lines += _traffic(snapshot, previous)
    return "\n".join(lines)


def _version(daemon_version: str) -> str:
    """The daemon's version, and this CLI's where they differ (a node mid-upgrade)."""
    if not daemon_version:
        return "version unknown (older than 0.2.0)"
    if daemon_version != __version__:
        return f"version {daemon_version} (this kvd status: {__version__})"
    return f"version {daemon_version}"


def _engines(s: router_pb2.GetStatusResponse) -> list[str]:
    if not s.engines:
        return ["engines: none registered", ""]
    total = sum(e.registered_bytes for e in s.engines)
    rows = [["ENGINE", "RANK", "STREAM", "REGISTERED", "HELD/SOFT/DRAINING", "LAYOUT"]]
    for e in sorted(s.engines, key=lambda e: (e.engine_id, e.tp_rank)):
        rows.append(
            [
                e.engine_id,
                f"{e.tp_rank}/{e.tp_size}",
                "connected" if e.stream_connected else "none",
                _bytes(e.registered_bytes),
                f"{_bytes(e.held_bytes)}/{_bytes(e.soft_held_bytes)}/{_bytes(e.draining_bytes)}",
                _layout(e.layout),
            ]
        )
    ranks = f"{len(s.engines)} rank{'s' if len(s.engines) != 1 else ''}"
    return [f"engines: {ranks}, {_bytes(total)} registered", *_table(rows), ""]


def _layout(spec: Any) -> str:
    heads = f"{spec.num_kv_heads}/{spec.total_num_kv_heads}" if spec.total_num_kv_heads else f"{spec.num_kv_heads}"
    return (
        f"{spec.num_layers} layers, {_FORMAT.get(spec.kv_format, '?')} {_LAYOUT.get(spec.layout, '?')}, "
        f"{spec.num_blocks} blocks of {spec.block_size}, {heads} heads x {spec.head_dim} {_DTYPE.get(spec.dtype, '?')}"
    )


def _peers(s: router_pb2.GetStatusResponse) -> list[str]:
    if not s.peers:
        return ["peers: none contacted", ""]
    rows = [["PEER", "INCARNATION", "LAST CONTACT", "STREAM", "AGENT"]]
    for p in sorted(s.peers, key=lambda p: p.address):
        stream = "framed" if p.framed_stream else "gRPC"
        rows.append([p.address, p.incarnation[:8], f"{_duration(p.last_contact_s_ago)} ago", stream, p.agent_name])
    return [f"peers: {len(s.peers)}", *_table(rows), ""]


def _traffic(snapshot: Snapshot, previous: Snapshot | None) -> list[str]:
    m = snapshot.metrics
    if snapshot.metrics_error:
        return [f"traffic: {snapshot.metrics_error}"]
    window = snapshot.taken_at - previous.taken_at if previous is not None else 0.0
    uptime = max(snapshot.status.uptime_s, 1e-9)
    out = [
        "traffic since start" + (f" (rate over the last {window:.1f} s)" if window else " (average rate since start)")
    ]
    for direction, verb in (("pull", "pulled"), ("serve", "served")):
        key = f"kvd_transfer_bytes_total|direction={direction}"
        moved = m.get(key, 0.0)
        if previous is not None and window > 0:
            rate = (moved - previous.metrics.get(key, 0.0)) / window
        else:
            rate = moved / uptime
        outcomes = ", ".join(
            f"{int(m.get(f'kvd_transfers_total|direction={direction}|outcome={o}', 0))} {o}"
            for o in ("done", "failed", "aborted")
        )
        out.append(f"  {verb:<7}{_bytes(int(moved)):>11}  {_rate(rate):>12}   transfers: {outcomes}")
    handshakes = {
        o: int(v) for k, v in m.items() if k.startswith("kvd_handshakes_total|outcome=") for o in [k.split("=", 1)[1]]
    }
    if handshakes:
        out.append("  handshakes: " + ", ".join(f"{n} {o}" for o, n in sorted(handshakes.items())))
    errors_by = sorted(
        (k.split("|")[1].split("=", 1)[1], k.split("|")[2].split("=", 1)[1], int(v))
        for k, v in m.items()
        if k.startswith("kvd_errors_total|operation=") and k.count("|") == 2 and v
    )
    if errors_by:
        out.append(f"errors: {sum(n for _, _, n in errors_by)}")
        out += [f"  {op:<22} {code:<20} {n}" for op, code, n in errors_by]
    else:
        out.append("errors: none")
    return out


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e8 else f"{bytes_per_s / 1e6:.2f} MB/s"


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    return f"{hours // 24}d{hours % 24:02d}h"

"""Which values a :class:`~kvd.config_fields.KvdConfig` refuses: each problem named with the
field, the value given and what would be accepted, all of them at once (one start-up failure
lists every mistake of a config, not the first only).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvd.config_fields import KvdConfig

MAX_COPY_THREADS = 64

_GROUP_RE = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_.-]*\$?|[0-9]+)$")


def problems(config: KvdConfig) -> list[str]:
    """Everything wrong with ``config`` (empty: nothing). KvdConfig raises ValueError with them."""
    found: list[str] = []
    if not config.unix_socket:
        found.append("unix_socket must not be empty")
    if not 0 <= config.port <= 65535:
        found.append(f"port {config.port} is not in 0..65535")
    if not -1 <= config.peer_stream_port <= 65535:
        found.append(f"peer_stream_port {config.peer_stream_port} is not in -1..65535")
    if not -1 <= config.metrics_port <= 65535:
        found.append(f"metrics_port {config.metrics_port} is not in -1..65535")
    if not -1 <= config.health_port <= 65535:
        found.append(f"health_port {config.health_port} is not in -1..65535")
    fixed = [(n, getattr(config, n)) for n in ("port", "metrics_port", "health_port") if getattr(config, n) > 0]
    for i, (name, value) in enumerate(fixed):
        for other, other_value in fixed[i + 1 :]:
            if value == other_value:
                found.append(f"{name} and {other} are both {value}: each listener needs its own port")
    if config.engine_group and not _GROUP_RE.match(config.engine_group):
        found.append(f"engine_group {config.engine_group!r} is neither a group name nor a numeric gid")
    if not math.isfinite(config.watchdog_s) or config.watchdog_s < 0:
        found.append(f"watchdog_s must be >= 0 (and finite), got {config.watchdog_s}")
    for name in (
        "lease_ttl_s",
        "max_lease_ttl_s",
        "transfer_deadline_s",
        "handshake_timeout_s",
        "commit_wait_s",
        "hold_check_timeout_s",
        "staging_wait_s",
        "fence_timeout_s",
        "peer_idle_s",
        "dataplane_heartbeat_timeout_s",
        "dataplane_restart_backoff_s",
        "dataplane_restart_stable_s",
    ):
        if not math.isfinite(getattr(config, name)) or getattr(config, name) <= 0:
            found.append(f"{name} must be > 0 (and finite), got {getattr(config, name)}")
    if not math.isfinite(config.early_read_window_s) or not 0 <= config.early_read_window_s <= 86_400:
        found.append(f"early_read_window_s must be in 0..86400, got {config.early_read_window_s}")
    if not math.isfinite(config.read_admission_margin_s) or config.read_admission_margin_s < 0:
        found.append(f"read_admission_margin_s must be >= 0, got {config.read_admission_margin_s}")
    if not math.isfinite(config.shutdown_grace_s) or config.shutdown_grace_s < 0:
        found.append(f"shutdown_grace_s must be >= 0, got {config.shutdown_grace_s}")
    if not (math.isfinite(config.read_descriptor_cost_s) and config.read_descriptor_cost_s >= 0):
        found.append(f"read_descriptor_cost_s must be >= 0, got {config.read_descriptor_cost_s}")
    if not (math.isfinite(config.convert_bytes_per_s) and config.convert_bytes_per_s > 0):
        found.append(f"convert_bytes_per_s must be > 0, got {config.convert_bytes_per_s}")
    if not 1e-6 <= config.gil_switch_interval_s <= 1.0:
        found.append(f"gil_switch_interval_s must be in 1e-6..1, got {config.gil_switch_interval_s}")
    if config.lease_ttl_s > config.max_lease_ttl_s:
        found.append(f"lease_ttl_s {config.lease_ttl_s} exceeds max_lease_ttl_s {config.max_lease_ttl_s}")
    if config.max_run_blocks < 1 or config.max_run_blocks & (config.max_run_blocks - 1):
        found.append(f"max_run_blocks must be a power of two >= 1, got {config.max_run_blocks}")
    if not 0 <= config.dataplane_copy_threads <= MAX_COPY_THREADS:
        found.append(
            f"dataplane_copy_threads must be 0 (automatic) to {MAX_COPY_THREADS}, got {config.dataplane_copy_threads}"
        )
    if config.dataplane_parallel_read_min_bytes < 1 << 20:
        found.append(
            "dataplane_parallel_read_min_bytes must be >= 1 MiB (1048576), "
            f"got {config.dataplane_parallel_read_min_bytes}"
        )
    if config.dataplane_max_post_bytes < 1 << 20:
        found.append(f"dataplane_max_post_bytes must be >= 1 MiB (1048576), got {config.dataplane_max_post_bytes}")
    if not (
        math.isfinite(config.dataplane_restart_backoff_max_s)
        and config.dataplane_restart_backoff_max_s >= config.dataplane_restart_backoff_s
    ):
        found.append(
            f"dataplane_restart_backoff_max_s must be >= dataplane_restart_backoff_s "
            f"({config.dataplane_restart_backoff_s}), got {config.dataplane_restart_backoff_max_s}"
        )
    if config.staging_pool_bytes < 0 or config.direct_read_min_bytes < 0:
        found.append("staging_pool_bytes and direct_read_min_bytes must be >= 0")
    if not config.nixl_backends:
        found.append("nixl_backends must name at least one backend")
    if bool(config.tls_cert) != bool(config.tls_key):
        found.append("tls_cert and tls_key must be given together")
    bad_uids = [u for u in config.loopback_uids if not u.isdigit()]
    if bad_uids:
        found.append(f"loopback_uids must be numeric uids, got {bad_uids}")
    if config.nixl_net_devices and not re.fullmatch(r"[A-Za-z0-9_.:,-]+", config.nixl_net_devices):
        found.append(f"nixl_net_devices {config.nixl_net_devices!r} is not a comma-separated device list")
    if config.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        found.append(f"log_level {config.log_level!r} is not DEBUG, INFO, WARNING or ERROR")
    return found

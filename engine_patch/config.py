"""The connector's configuration: one frozen dataclass, validated on construction.

In vLLM it comes from ``--kv-transfer-config``'s ``kv_connector_extra_config``::

    {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd_engine.connector",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"kvd_socket": "/run/kvd/engine.sock", "pull_threshold_tokens": 256}}

Types are strict, because the extra config is JSON and a value of the wrong JSON type is a
mistake, not a hint: ``7.9`` for an integer, ``true`` for a number, ``null`` or ``"256"`` for
anything are refused with the key's name instead of being turned into ``7``, ``1``, ``'None'``
(then used as a socket path) or ``256``. The one widening is an integer where a float is
expected (``"rpc_timeout_s": 2``). Every key and its default is listed in docs/operations.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, get_type_hints

from kvd_client.channel import normalize_target
from kvd_client.paths import default_engine_socket

from .nwor import NworMode

__all__ = ["DEFAULT_PULL_DEADLINE_MS", "KvdConnectorConfig"]

DEFAULT_PULL_DEADLINE_MS = 30_000
"""A pull's deadline when ``pull_deadline_ms`` is 0 (the daemon's own default, sent explicitly)."""


@dataclasses.dataclass(frozen=True)
class KvdConnectorConfig:
    """Every knob of the engine side of kvd. Unknown keys are refused (typos fail loudly)."""

    kvd_socket: str = dataclasses.field(default_factory=default_engine_socket)
    """The local daemon's engine socket: a path (Unix socket) or a full grpc target. The default,
    ``/tmp/kvd-<uid>/engine.sock``, is also `kvd serve`'s; deployments use ``/run/kvd/engine.sock``."""

    pull_threshold_tokens: int = 64
    """Prefill pulls a conversation's KV back from decode only when at least this many tokens
    would be loaded; below it, recomputing is cheaper than a transfer."""

    hold_on_decode: bool = True
    """Decode holds a finished request's KV under a lease for the next turn's prefill (multi-turn)."""

    decode_hold_mode: str = "soft"
    """How decode holds (hold_on_decode): "soft" pins nothing (the blocks go back to vLLM's prefix
    cache; a pull verifies them by block hash and pins them only while it reads), "hard" keeps
    the blocks until the lease ends (vLLM frees them at finished_sending)."""

    lease_renew_interval_ms: int = 1000
    """A request that will pull renews the holder's lease this often while it waits (reader
    heartbeats, batched per holder); 0 turns heartbeats off. Keep it well under the holder's TTL."""

    hold_ttl_ms: int = 0
    """Lease length asked for at hold time (0: the daemon's default)."""

    pull_deadline_ms: int = 0
    """Deadline of a pull (0: DEFAULT_PULL_DEADLINE_MS). Always sent with the pull, so the daemon
    and the connector agree on it whatever the daemon's own ``transfer_deadline_s``."""

    pull_timeout_slack_s: float = 5.0
    """A pull the daemon has not reported this long past its deadline is cancelled
    (CancelTransfer); it is reported failed (recomputed) once the daemon confirms it ended."""

    pull_last_resort_s: float = 300.0
    """A pull neither ended by the daemon (done, failed, cancelled) nor fenced (the link's
    re-registration) this long past its deadline + slack is failed anyway: a last resort
    against a daemon that never answers, far past any fence the daemon takes."""

    hold_last_resort_s: float = 3600.0
    """A hard hold the daemon has not ended (finished_sending) this long after it was made is
    released anyway. The daemon ends every lease itself, expiry included, and reader heartbeats
    renew leases there: keep this far past the daemon's ``max_lease_ttl_s`` and any queueing."""

    require_commits: bool = True
    """Register with require_commits: the daemon serves only tokens this rank committed."""

    commit_every_steps: int = 16
    """Send running requests' grown watermarks every this many steps (finished requests' at
    once). 1 sends every step; higher keeps the engine stream far below its message rate."""

    rpc_timeout_s: float = 2.0
    """Deadline of each unary call to the daemon (holds, pulls, registration)."""

    reconnect_initial_s: float = 0.2
    """First wait before reconnecting to a daemon that went away; doubles up to reconnect_max_s."""

    reconnect_max_s: float = 5.0
    """Longest wait between reconnection attempts."""

    nwor_mode: str = "stage"
    """Deferred KV writes for speculative decoding: "stage", "immediate" or "off"."""

    recompute_failed_loads: bool = True
    """Switch vLLM's kv_load_failure_policy to "recompute": a failed pull is recomputed, never
    a failed request."""

    def __post_init__(self) -> None:
        type_problems = [p for f in dataclasses.fields(self) if (p := _type_problem(f.name, getattr(self, f.name)))]
        if type_problems:
            raise ValueError("invalid kvd connector config: " + "; ".join(type_problems))
        problems = []
        if not self.kvd_socket:
            problems.append("kvd_socket must name the daemon's engine socket")
        if self.commit_every_steps < 1:
            problems.append(f"commit_every_steps must be >= 1, got {self.commit_every_steps}")
        if self.pull_threshold_tokens < 0:
            problems.append(f"pull_threshold_tokens must be >= 0, got {self.pull_threshold_tokens}")
        if self.decode_hold_mode not in ("soft", "hard"):
            problems.append(f"decode_hold_mode must be 'soft' or 'hard', got {self.decode_hold_mode!r}")
        for name in ("hold_ttl_ms", "pull_deadline_ms", "lease_renew_interval_ms"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "rpc_timeout_s",
            "reconnect_initial_s",
            "reconnect_max_s",
            "pull_timeout_slack_s",
            "pull_last_resort_s",
            "hold_last_resort_s",
        ):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0 (and finite), got {getattr(self, name)}")
        if self.reconnect_max_s < self.reconnect_initial_s:
            problems.append("reconnect_max_s must be >= reconnect_initial_s")
        try:
            NworMode(str(self.nwor_mode).lower())
        except ValueError:
            problems.append(f"nwor_mode must be one of stage, immediate, off; got {self.nwor_mode!r}")
        if problems:
            raise ValueError("invalid kvd connector config: " + "; ".join(problems))

    @property
    def effective_pull_deadline_ms(self) -> int:
        """The deadline sent with every pull: ``pull_deadline_ms``, or the connector's default."""
        return self.pull_deadline_ms or DEFAULT_PULL_DEADLINE_MS

    @property
    def target(self) -> str:
        """The grpc target of the daemon (a bare path means a Unix socket)."""
        return normalize_target(self.kvd_socket)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> KvdConnectorConfig:
        """Build from vLLM's ``kv_connector_extra_config``: known keys only, JSON types as declared."""
        extra = dict(extra or {})
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - fields)
        if unknown:
            raise ValueError(f"unknown kvd connector option(s) {unknown}; known: {sorted(fields)}")
        return cls(**{name: _widen(name, value) for name, value in extra.items()})


_TYPES: dict[str, Any] = get_type_hints(KvdConnectorConfig)
_JSON_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _widen(name: str, value: Any) -> Any:
    """An integer where a float is expected becomes that float; nothing else is converted."""
    if _TYPES[name] is float and type(value) is int:
        return float(value)
    return value


def _type_problem(name: str, value: Any) -> str:
    """Why ``value`` is not of ``name``'s declared type ("" when it is); bool is not an int here."""
    kind = _TYPES[name]
    ok = type(value) is kind or (kind is float and type(value) is int)
    if ok:
        return ""
    shown = "null" if value is None else repr(value)
    return f"{name} must be {_JSON_NAMES[kind]}, got {shown} ({type(value).__name__})"

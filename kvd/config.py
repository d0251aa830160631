"""Loading the daemon's one configuration object, and printing it.

Precedence, lowest first: field defaults < TOML file (``--config``) < ``KVD_*`` environment
variables < command-line flags. :func:`load_config` is the only place that reads the
environment; everything else receives a :class:`KvdConfig`. That includes what systemd hands
the daemon through its environment (``NOTIFY_SOCKET``, ``WATCHDOG_USEC``): they become the
``notify_socket`` and ``watchdog_s`` fields, so the server never reads the process environment.

:func:`resolve_config` also says where each value came from (``kvd serve --print-config``) and
which ``KVD_*`` variables it did not recognise (a typo is warned about, not silently ignored).

The dataclass itself, its fields and their help text, is :mod:`kvd.config_fields`; what it
refuses, :mod:`kvd.config_checks`. Both are importable from here, as they always were.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_type_hints

from kvd.config_checks import MAX_COPY_THREADS as MAX_COPY_THREADS
from kvd.config_fields import AUTO_COPY_THREADS_MAX as AUTO_COPY_THREADS_MAX
from kvd.config_fields import KvdConfig

ENV_PREFIX = "KVD_"

NOT_CONFIG_ENV = frozenset({"KVD_SETUP_VLLM"})
"""``KVD_*`` variables that belong to other tools (scripts/setup.sh): never warned about."""

SYSTEMD_ENV = {"notify_socket": "NOTIFY_SOCKET", "watchdog_s": "WATCHDOG_USEC"}
"""Fields systemd sets through its own variables (see :func:`_systemd_values`)."""


_FIELD_TYPES: dict[str, Any] = get_type_hints(KvdConfig)


def _coerce(name: str, value: Any, source: str) -> Any:
    """Convert a raw value (TOML value, env or flag string) to the field's type."""
    kind = _FIELD_TYPES[name]
    try:
        if kind is bool:
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered not in {"1", "0", "true", "false", "yes", "no", "on", "off"}:
                    raise ValueError(value)
                return lowered in {"1", "true", "yes", "on"}
            return bool(value)
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            if not isinstance(value, (int, float, str)):
                raise ValueError(value)
            return int(value)
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError(value)
            return float(value)
        if kind == tuple[str, ...]:
            if isinstance(value, str):
                return tuple(part.strip() for part in value.split(",") if part.strip())
            return tuple(str(part) for part in value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {name}={value!r} is not a valid {getattr(kind, '__name__', kind)}") from exc


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(KvdConfig)]


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per config field (``--lease-ttl-s``), defaulting to "not given"."""
    parser.add_argument("--config", type=Path, default=None, help="TOML file with config fields.")
    for f in dataclasses.fields(KvdConfig):
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            default=None,
            help=f.metadata.get("help", ""),
        )


RETIRED_KEYS: dict[str, str] = {
    "dataplane_max_restarts": "a crash loop of the data-plane worker backs off instead of ending the daemon "
    "(dataplane_restart_backoff_s, dataplane_restart_backoff_max_s, dataplane_restart_stable_s)",
    "dataplane_restart_window_s": "a crash loop of the data-plane worker backs off instead of ending the daemon "
    "(dataplane_restart_backoff_s, dataplane_restart_backoff_max_s, dataplane_restart_stable_s)",
}
"""Keys an earlier release read: a config that still sets one starts, with a warning saying what
replaced it (an upgrade must not turn a node's config into a start-up failure)."""


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    """A config, where each field's value came from, and what the environment got wrong."""

    config: KvdConfig
    sources: dict[str, str]
    """Field name -> "default", "file PATH", "env KVD_X", "systemd NOTIFY_SOCKET" or "flag --x"."""
    warnings: tuple[str, ...]
    """Unknown ``KVD_*`` variables, each with the nearest field name when there is one."""


def load_config(
    file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> KvdConfig:
    """Merge defaults < file < env < flags into a validated config.

    ``env`` defaults to the process environment; pass a dict in tests.
    """
    return resolve_config(file, env, flags).config


def resolve_config(
    file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> ResolvedConfig:
    """:func:`load_config`, keeping the source of every value and the environment's warnings.

    ``env`` defaults to ``os.environ``: this is the one function of kvd that reads the environment.
    """
    names = set(_field_names())
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    warnings: list[str] = []
    if file is not None:
        try:
            data = tomllib.loads(Path(file).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read config file {file}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {file} is not valid TOML: {exc}") from exc
        if "kvd" in data:
            stray = sorted(set(data) - {"kvd"})
            if stray:
                raise ValueError(f"config file {file}: keys {stray} are outside the [kvd] table")
        section = dict(data.get("kvd", data))
        for key in sorted(set(section) & set(RETIRED_KEYS)):
            del section[key]
            warnings.append(f"config file {file}: {key} no longer applies and is ignored: {RETIRED_KEYS[key]}")
        unknown = sorted(set(section) - names)
        if unknown:
            raise ValueError(f"config file {file}: unknown keys {unknown}; known: {sorted(names)}")
        for key, value in section.items():
            values[key] = _coerce(key, value, f"config file {file}")
            sources[key] = f"file {file}"
    environ: Mapping[str, str] = os.environ if env is None else env
    for name, value in _systemd_values(environ).items():
        values[name] = value
        sources[name] = f"systemd {SYSTEMD_ENV[name]}"
    for key, value in sorted(environ.items()):
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name in names:
            values[name] = _coerce(name, value, f"environment {key}")
            sources[name] = f"env {key}"
        elif name in RETIRED_KEYS:
            warnings.append(f"environment variable {key} no longer applies and is ignored: {RETIRED_KEYS[name]}")
        elif key not in NOT_CONFIG_ENV:
            near = difflib.get_close_matches(name, sorted(names), n=1)
            hint = f" (did you mean {ENV_PREFIX}{near[0].upper()}?)" if near else ""
            warnings.append(f"environment variable {key} is not a kvd setting and is ignored{hint}")
    for key, value in (flags or {}).items():
        if key in names and value is not None:
            values[key] = _coerce(key, value, f"flag --{key.replace('_', '-')}")
            sources[key] = f"flag --{key.replace('_', '-')}"
    config = KvdConfig(**values)
    return ResolvedConfig(config, {n: sources.get(n, "default") for n in _field_names()}, tuple(warnings))


def _systemd_values(environ: Mapping[str, str]) -> dict[str, Any]:
    """``NOTIFY_SOCKET`` and ``WATCHDOG_USEC`` as config values (``KVD_*`` and flags override them).

    ``WATCHDOG_PID``, when set, names the process the watchdog is meant for: another pid
    (a child that inherited the environment) does not ping.
    """
    out: dict[str, Any] = {}
    if environ.get("NOTIFY_SOCKET"):
        out["notify_socket"] = environ["NOTIFY_SOCKET"]
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if usec and (not pid or pid == str(os.getpid())):
        try:
            out["watchdog_s"] = int(usec) / 1e6
        except ValueError as exc:
            raise ValueError(f"environment WATCHDOG_USEC={usec!r} is not a number of microseconds") from exc
    return out


def format_config(resolved: ResolvedConfig) -> str:
    """The effective config as a TOML ``[kvd]`` table, each value commented with its source."""
    lines = ["[kvd]"]
    for f in dataclasses.fields(KvdConfig):
        value = getattr(resolved.config, f.name)
        if isinstance(value, tuple):
            text = "[" + ", ".join(_toml_string(v) for v in value) + "]"
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = repr(value)
        else:
            text = _toml_string(value)
        lines.append(f"{f.name} = {text}".ljust(56) + f"  # {resolved.sources[f.name]}")
    return "\n".join(lines) + "\n"


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> KvdConfig:
    """Build the config from parsed CLI arguments (see :func:`add_config_flags`)."""
    return load_config(getattr(args, "config", None), env, vars(args))


def resolve_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ResolvedConfig:
    """:func:`config_from_args` with sources and warnings; ``env`` defaults to the process environment."""
    return resolve_config(getattr(args, "config", None), env, vars(args))


def flags_for(config: KvdConfig, base: KvdConfig | None = None) -> list[str]:
    """Command-line flags that reproduce ``config`` (fields differing from ``base``): to spawn daemons."""
    reference = base or KvdConfig()
    out: list[str] = []
    for f in dataclasses.fields(KvdConfig):
        value = getattr(config, f.name)
        if value == getattr(reference, f.name):
            continue
        text = ",".join(value) if isinstance(value, tuple) else str(value)
        out.append(f"--{f.name.replace('_', '-')}={text}")
    return out

"""kvd.config: one frozen config, defaults < TOML file < KVD_* env < flags, validated on construction."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.config import KvdConfig, add_config_flags, config_from_args, flags_for, load_config, resolve_config

REPO = Path(__file__).resolve().parents[3]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return parser


def _toml(tmp_path: Path, text: str, name: str = "kvd.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- defaults -----------------------------------------------------------------------------------


def test_default_config_needs_no_file_and_no_environment() -> None:
    """A fresh machine runs with no config at all: no file, empty env, no flags gives the defaults."""
    config = load_config(None, env={}, flags={})
    assert config == KvdConfig()
    assert config.host == "127.0.0.1"  # TCP binds to loopback unless told otherwise
    assert config.unix_socket == f"/tmp/kvd-{os.getuid()}/engine.sock"
    assert not config.tls_enabled


def test_default_config_from_an_empty_command_line() -> None:
    """`kvd serve` with no flags and an empty environment builds the default config."""
    assert config_from_args(_parser().parse_args([]), env={}) == KvdConfig()


def test_env_defaults_to_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """load_config(env=None) reads os.environ (the one place that does)."""
    monkeypatch.setenv("KVD_PORT", "4321")
    assert load_config().port == 4321


def test_config_is_frozen() -> None:
    """The config is immutable once built."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        KvdConfig().port = 1  # type: ignore[misc]


def test_every_field_has_help_text_and_a_flag() -> None:
    """Each field carries help text, and add_config_flags makes one --flag per field."""
    parser = _parser()
    dests = {action.dest for action in parser._actions}
    for f in dataclasses.fields(KvdConfig):
        assert f.metadata.get("help"), f"field {f.name} has no help text"
        assert f.name in dests
    assert "config" in dests


# --- precedence ---------------------------------------------------------------------------------


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    """Each field comes from the highest layer that sets it: flags > env > file > default."""
    file = _toml(tmp_path, 'port = 1001\nlease_ttl_s = 11.0\nhost = "10.0.0.1"\nmax_run_blocks = 8\n')
    env = {"KVD_PORT": "1002", "KVD_LEASE_TTL_S": "12", "KVD_STAGING_WAIT_S": "3.5"}
    flags = {"port": "1003", "commit_wait_s": None}
    config = load_config(file, env=env, flags=flags)
    assert config.port == 1003  # flag beats env and file
    assert config.lease_ttl_s == 12.0  # env beats file
    assert config.host == "10.0.0.1"  # file beats default
    assert config.max_run_blocks == 8
    assert config.staging_wait_s == 3.5  # env alone
    assert config.commit_wait_s == KvdConfig().commit_wait_s  # a None flag means "not given"
    assert config.metrics_port == KvdConfig().metrics_port  # untouched: default


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(in_file=st.booleans(), in_env=st.booleans(), in_flags=st.booleans())
def test_precedence_property(tmp_path: Path, in_file: bool, in_env: bool, in_flags: bool) -> None:
    """For any subset of layers setting a field, the highest layer present wins."""
    file = _toml(tmp_path, "port = 2001\n") if in_file else None
    env = {"KVD_PORT": "2002"} if in_env else {}
    flags = {"port": "2003"} if in_flags else {}
    expected = 2003 if in_flags else 2002 if in_env else 2001 if in_file else KvdConfig().port
    assert load_config(file, env=env, flags=flags).port == expected


def test_config_from_args_uses_the_config_flag_and_env(tmp_path: Path) -> None:
    """config_from_args reads --config, then env, then the other flags, in that order."""
    file = _toml(tmp_path, 'host = "10.1.1.1"\nport = 5\nmetrics_port = 6\n')
    args = _parser().parse_args(["--config", str(file), "--port", "7", "--nixl-backends", "UCX,GDS"])
    config = config_from_args(args, env={"KVD_PORT": "8", "KVD_METRICS_PORT": "9", "PATH": "/bin"})
    assert config.port == 7
    assert config.metrics_port == 9
    assert config.host == "10.1.1.1"
    assert config.nixl_backends == ("UCX", "GDS")


def test_file_may_use_a_kvd_table(tmp_path: Path) -> None:
    """A TOML file may put the fields at top level or under a [kvd] table."""
    top = _toml(tmp_path, "port = 11\n", "top.toml")
    table = _toml(tmp_path, "[kvd]\nport = 12\nnixl_backends = ['UCX', 'GDS']\n", "table.toml")
    assert load_config(top, env={}).port == 11
    config = load_config(table, env={})
    assert config.port == 12
    assert config.nixl_backends == ("UCX", "GDS")


def test_env_list_and_unrelated_variables() -> None:
    """KVD_* lists are comma-separated; non-KVD variables and unknown KVD_* names are ignored."""
    env = {"KVD_NIXL_BACKENDS": " UCX , GDS ,", "HOME": "/root", "KVD_DISABLE_NWOR": "1"}
    assert load_config(None, env=env).nixl_backends == ("UCX", "GDS")


# --- coercion errors name the source and the field ----------------------------------------------


@pytest.mark.parametrize(("field", "bad"), [("port", "eighty"), ("lease_ttl_s", "soon"), ("max_run_blocks", "1.5")])
def test_env_coercion_error_names_variable_and_field(field: str, bad: str) -> None:
    """A KVD_* value of the wrong type fails naming the environment variable and the field."""
    key = "KVD_" + field.upper()
    with pytest.raises(ValueError, match=rf"environment {key}.*{field}="):
        load_config(None, env={key: bad})


@pytest.mark.parametrize(("field", "bad"), [("port", "eighty"), ("lease_ttl_s", "soon"), ("metrics_port", "")])
def test_flag_coercion_error_names_flag_and_field(field: str, bad: str) -> None:
    """A flag value of the wrong type fails naming the flag and the field."""
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=rf"flag {flag}.*{field}="):
        load_config(None, env={}, flags={field: bad})


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('port = "eighty"', "port"),
        ("lease_ttl_s = [1, 2]", "lease_ttl_s"),
        ("port = true", "port"),
        ("nixl_backends = 5", "nixl_backends"),
    ],
)
def test_file_coercion_error_names_file_and_field(tmp_path: Path, line: str, field: str) -> None:
    """A TOML value of the wrong type fails naming the file and the field."""
    file = _toml(tmp_path, line + "\n")
    with pytest.raises(ValueError, match=rf"config file {re.escape(str(file))}.*{field}="):
        load_config(file, env={})


@pytest.mark.parametrize(
    ("line", "field"),
    [("port = 8080.5", "port"), ("max_run_blocks = 64.9", "max_run_blocks"), ("lease_ttl_s = true", "lease_ttl_s")],
)
def test_file_values_of_the_wrong_toml_type_are_refused_not_truncated(tmp_path: Path, line: str, field: str) -> None:
    """A TOML float for an integer field (or a bool for a number) is refused, as the env string is.

    KVD_PORT=8080.5 is refused; ``port = 8080.5`` in the file must not silently become 8080.
    """
    file = _toml(tmp_path, line + "\n")
    with pytest.raises(ValueError, match=rf"config file .*{field}"):
        load_config(file, env={})


def test_unreadable_or_malformed_file_is_a_clear_error(tmp_path: Path) -> None:
    """A missing file or broken TOML fails with a message naming the file."""
    missing = tmp_path / "nope.toml"
    with pytest.raises(ValueError, match="cannot read config file .*nope.toml"):
        load_config(missing, env={})
    broken = _toml(tmp_path, "port = = 3\n", "broken.toml")
    with pytest.raises(ValueError, match="broken.toml is not valid TOML"):
        load_config(broken, env={})


# --- unknown keys -------------------------------------------------------------------------------


def test_a_retired_key_in_a_file_or_the_environment_starts_with_a_warning_naming_its_replacement(
    tmp_path: Path,
) -> None:
    """A node's config from an earlier release (its crash-loop limit) must not become a start-up
    failure on upgrade: the key is ignored and the warning says what replaced it."""
    file = _toml(tmp_path, "[kvd]\ndataplane_max_restarts = 5\nlease_ttl_s = 7.0\n")
    resolved = resolve_config(file, env={"KVD_DATAPLANE_RESTART_WINDOW_S": "60"})
    assert resolved.config.lease_ttl_s == 7.0
    assert [w.split(" no longer applies")[0] for w in resolved.warnings] == [
        f"config file {file}: dataplane_max_restarts",
        "environment variable KVD_DATAPLANE_RESTART_WINDOW_S",
    ]
    assert all("dataplane_restart_backoff_s" in w for w in resolved.warnings)


@pytest.mark.parametrize(
    ("text", "unknown"),
    [("prot = 1\n", "prot"), ("[kvd]\nlease_ttl = 3\n", "lease_ttl"), ("[kvdd]\nport = 1\n", "kvdd")],
)
def test_unknown_toml_keys_are_refused(tmp_path: Path, text: str, unknown: str) -> None:
    """A misspelt key (or table) is refused, naming it, instead of being ignored."""
    file = _toml(tmp_path, text)
    with pytest.raises(ValueError, match=rf"unknown keys .*'{unknown}'"):
        load_config(file, env={})


def test_keys_outside_the_kvd_table_are_refused(tmp_path: Path) -> None:
    """With a [kvd] table present, a top-level key beside it is not silently dropped."""
    file = _toml(tmp_path, 'port = 1\n[kvd]\nhost = "10.0.0.2"\n')
    with pytest.raises(ValueError, match="port"):
        load_config(file, env={})


# --- validation in __post_init__ ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"port": -1}, "port -1 is not in 0..65535"),
        ({"port": 65536}, "port 65536"),
        ({"metrics_port": -2}, "metrics_port -2"),
        ({"metrics_port": 70000}, "metrics_port 70000"),
        ({"lease_ttl_s": 0.0}, "lease_ttl_s must be > 0"),
        ({"max_lease_ttl_s": -1.0}, "max_lease_ttl_s must be > 0"),
        ({"transfer_deadline_s": 0.0}, "transfer_deadline_s must be > 0"),
        ({"handshake_timeout_s": 0.0}, "handshake_timeout_s must be > 0"),
        ({"commit_wait_s": -0.5}, "commit_wait_s must be > 0"),
        ({"staging_wait_s": 0.0}, "staging_wait_s must be > 0"),
        ({"shutdown_grace_s": -1.0}, "shutdown_grace_s must be >= 0"),
        ({"lease_ttl_s": 700.0}, "lease_ttl_s 700.0 exceeds max_lease_ttl_s"),
        ({"max_run_blocks": 0}, "max_run_blocks must be a power of two"),
        ({"max_run_blocks": 48}, "max_run_blocks must be a power of two"),
        ({"staging_pool_bytes": -1}, "staging_pool_bytes"),
        ({"direct_read_min_bytes": -1}, "direct_read_min_bytes"),
        ({"dataplane_max_post_bytes": 4096}, "dataplane_max_post_bytes must be >= 1 MiB"),
        ({"nixl_backends": ()}, "nixl_backends"),
        ({"tls_cert": "c.pem"}, "tls_cert and tls_key must be given together"),
        ({"tls_key": "k.pem"}, "tls_cert and tls_key must be given together"),
        ({"log_level": "LOUD"}, "log_level 'LOUD'"),
        ({"unix_socket": ""}, "unix_socket must not be empty"),
    ],
)
def test_invalid_values_are_refused_on_construction(changes: dict[str, object], message: str) -> None:
    """__post_init__ refuses each bad value with a message naming the field."""
    with pytest.raises(ValueError, match=re.escape(message)):
        KvdConfig(**changes)  # type: ignore[arg-type]


def test_all_problems_are_reported_at_once() -> None:
    """Several bad fields give one error listing each of them."""
    with pytest.raises(ValueError) as info:
        KvdConfig(port=-5, lease_ttl_s=0.0, max_run_blocks=3)
    text = str(info.value)
    assert "port" in text and "lease_ttl_s" in text and "max_run_blocks" in text


def test_edge_values_are_accepted() -> None:
    """Port 0 (any free port), metrics_port -1 (disabled), grace 0, TLS pair and lower-case level are valid."""
    config = KvdConfig(port=0, metrics_port=-1, shutdown_grace_s=0.0, tls_cert="c", tls_key="k", log_level="debug")
    assert config.tls_enabled


@settings(deadline=None)
@given(st.integers(min_value=-4, max_value=1 << 20))
def test_max_run_blocks_valid_exactly_for_powers_of_two(n: int) -> None:
    """max_run_blocks is accepted if and only if it is a power of two >= 1."""
    is_power = n >= 1 and (n & (n - 1)) == 0
    if is_power:
        assert KvdConfig(max_run_blocks=n).max_run_blocks == n
    else:
        with pytest.raises(ValueError, match="max_run_blocks"):
            KvdConfig(max_run_blocks=n)


def test_validation_applies_to_env_and_flags() -> None:
    """Values from env and flags go through the same validation."""
    with pytest.raises(ValueError, match="port 70000"):
        load_config(None, env={"KVD_PORT": "70000"})
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        load_config(None, env={}, flags={"tls_cert": "/c.pem"})


@pytest.mark.parametrize("field", ["lease_ttl_s", "transfer_deadline_s", "commit_wait_s", "staging_wait_s"])
def test_nan_durations_are_refused(field: str) -> None:
    """A NaN duration (KVD_*=nan, or `nan` in TOML) is refused: it would make deadlines never pass."""
    with pytest.raises(ValueError, match=field):
        load_config(None, env={"KVD_" + field.upper(): "nan"})


# --- flags_for round trip -----------------------------------------------------------------------

_safe_text = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789/._:", min_size=1, max_size=20)
_durations = st.floats(min_value=1e-3, max_value=1e5, allow_nan=False, allow_infinity=False)


@st.composite
def _configs(draw: st.DrawFn) -> KvdConfig:
    max_ttl = draw(_durations)
    tls = draw(st.booleans())
    return KvdConfig(
        unix_socket="/" + draw(_safe_text),
        host=draw(st.sampled_from(["127.0.0.1", "0.0.0.0", "::1", "node-7.example"])),
        port=(port := draw(st.integers(0, 65535))),
        advertise_address=draw(st.one_of(st.just(""), _safe_text)),
        metrics_host=draw(st.sampled_from(["127.0.0.1", "0.0.0.0"])),
        metrics_port=draw(st.integers(-1, 65535).filter(lambda p: p <= 0 or p != port)),
        lease_ttl_s=draw(st.floats(min_value=1e-3, max_value=max_ttl)),
        max_lease_ttl_s=max_ttl,
        transfer_deadline_s=draw(_durations),
        handshake_timeout_s=draw(_durations),
        commit_wait_s=draw(_durations),
        shutdown_grace_s=draw(st.one_of(st.just(0.0), _durations)),
        max_run_blocks=1 << draw(st.integers(0, 12)),
        direct_read_min_bytes=draw(st.integers(0, 1 << 30)),
        staging_pool_bytes=draw(st.integers(0, 1 << 40)),
        dataplane_max_post_bytes=draw(st.integers(1 << 20, 1 << 40)),
        staging_wait_s=draw(_durations),
        nixl_backends=tuple(
            draw(st.lists(st.sampled_from(["UCX", "GDS", "POSIX", "LIBFABRIC"]), min_size=1, max_size=3))
        ),
        agent_name_prefix=draw(_safe_text),
        tls_cert=draw(_safe_text) if tls else "",
        tls_key=draw(_safe_text) if tls else "",
        tls_ca=draw(st.one_of(st.just(""), _safe_text)),
        ready_file=draw(st.one_of(st.just(""), _safe_text)),
        log_level=draw(st.sampled_from(["DEBUG", "INFO", "WARNING", "ERROR", "info"])),
    )


@settings(max_examples=150, deadline=None)
@given(_configs())
def test_flags_for_round_trips(config: KvdConfig) -> None:
    """Parsing flags_for(config) with the CLI parser rebuilds exactly that config."""
    args = _parser().parse_args(flags_for(config))
    assert config_from_args(args, env={}) == config


def test_flags_for_the_default_config_is_empty() -> None:
    """Only fields that differ from the default become flags."""
    assert flags_for(KvdConfig()) == []
    assert flags_for(KvdConfig(port=7, metrics_port=-1)) == ["--port=7", "--metrics-port=-1"]


def test_flags_for_relative_to_a_base() -> None:
    """With a base, only fields that differ from the base become flags."""
    base = KvdConfig(port=9, lease_ttl_s=5.0)
    assert flags_for(KvdConfig(port=9, lease_ttl_s=6.0), base) == ["--lease-ttl-s=6.0"]


def test_float_flags_round_trip_exactly() -> None:
    """A float that is not exactly representable in short decimal still round-trips."""
    config = KvdConfig(lease_ttl_s=0.1 + 0.2, transfer_deadline_s=1 / 3)
    rebuilt = config_from_args(_parser().parse_args(flags_for(config)), env={})
    assert rebuilt.lease_ttl_s == config.lease_ttl_s and not math.isnan(rebuilt.lease_ttl_s)
    assert rebuilt.transfer_deadline_s == config.transfer_deadline_s


# --- only load_config reads the environment -----------------------------------------------------

_ALLOWED_ENV_READERS = {
    ("kvd/config.py", "resolve_config"),
    ("kvd/spawn.py", "child_env"),
    ("kvd/server/startup.py", "apply_nixl_env"),  # writes UCX's variable from the config, reads nothing
}


def _enclosing_function(tree: ast.Module, line: int) -> str:
    best = ""
    best_start = -1
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            end = node.end_lineno or node.lineno
            if node.lineno <= line <= end and node.lineno > best_start:
                best, best_start = node.name, node.lineno
    return best


def test_nothing_but_load_config_reads_the_environment() -> None:
    """'os.environ' / 'getenv' appear in kvd/ and client/ only in resolve_config (behind load_config)
    and spawn.child_env."""
    offenders = []
    for tree_root in ("kvd", "client", "engine_patch"):
        for path in sorted((REPO / tree_root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith("client/v1/"):
                continue  # generated protobuf code
            text = path.read_text()
            if "os.environ" not in text and "getenv" not in text and "from os import" not in text:
                continue
            tree = ast.parse(text)
            for number, line in enumerate(text.splitlines(), start=1):
                if "os.environ" in line or "getenv" in line or re.search(r"from os import .*environ", line):
                    where = (rel, _enclosing_function(tree, number))
                    if where not in _ALLOWED_ENV_READERS:
                        offenders.append(f"{rel}:{number} in {where[1] or '<module>'}: {line.strip()}")
    assert not offenders, "environment read outside load_config:\n" + "\n".join(offenders)

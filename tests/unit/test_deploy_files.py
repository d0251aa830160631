"""The files in deploy/ stay true: the example config loads, the unit's command parses."""

from __future__ import annotations

import shlex
from pathlib import Path

from kvd.cli.main import build_parser
from kvd.config import config_from_args, load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_example_config_loads() -> None:
    config = load_config(DEPLOY / "kvd.toml", env={})
    assert config.unix_socket == "/run/kvd/engine.sock"
    assert config.port == 50151


def test_systemd_unit_command_parses() -> None:
    exec_start = next(
        line.split("=", 1)[1]
        for line in (DEPLOY / "kvd.service").read_text().splitlines()
        if line.startswith("ExecStart=")
    )
    argv = shlex.split(exec_start)
    assert argv[0].endswith("/kvd") and argv[1:3] == ["serve", "--config"]
    args = build_parser().parse_args(["serve", "--config", str(DEPLOY / "kvd.toml"), *argv[4:]])
    assert args.command == "serve"
    assert config_from_args(args, env={}).port == 50151

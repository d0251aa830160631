"""The connector's config: strict JSON types naming the key, the daemon's default socket, every key documented."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvd.config import KvdConfig
from kvd_engine.config import KvdConnectorConfig

DOCS = Path(__file__).resolve().parents[3] / "docs"


@pytest.mark.parametrize(
    ("key", "value", "wanted"),
    [
        ("pull_threshold_tokens", 7.9, "an integer"),  # was truncated to 7
        ("pull_threshold_tokens", 8.0, "an integer"),
        ("commit_every_steps", True, "an integer"),  # was 1
        ("kvd_socket", None, "a string"),  # was the socket path 'None'
        ("kvd_socket", 5, "a string"),
        ("pull_threshold_tokens", "256", "an integer"),
        ("rpc_timeout_s", "2", "a number"),
        ("rpc_timeout_s", False, "a number"),
        ("hold_on_decode", 1, "a boolean"),
        ("hold_on_decode", "false", "a boolean"),
        ("nwor_mode", None, "a string"),
    ],
)
def test_a_wrong_json_type_is_an_error_naming_the_key(key: str, value: Any, wanted: str) -> None:
    extra = json.loads(json.dumps({key: value}))  # what vLLM hands over: parsed JSON
    with pytest.raises(ValueError, match=rf"{key} must be {wanted}, got "):
        KvdConnectorConfig.from_extra_config(extra)


def test_right_json_types_are_taken_as_they_are() -> None:
    config = KvdConnectorConfig.from_extra_config(
        json.loads('{"kvd_socket": "/run/kvd/engine.sock", "pull_threshold_tokens": 256, "hold_on_decode": false,'
                   ' "rpc_timeout_s": 2, "pull_timeout_slack_s": 2.5, "nwor_mode": "off"}')
    )  # fmt: skip
    assert config.pull_threshold_tokens == 256 and config.hold_on_decode is False
    assert config.rpc_timeout_s == 2.0 and isinstance(config.rpc_timeout_s, float)  # int -> float is the one widening
    assert config.target == "unix:///run/kvd/engine.sock"


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(ValueError) as excinfo:
        KvdConnectorConfig.from_extra_config({"pull_threshold_tokens": 1.5, "kvd_socket": None})
    assert "pull_threshold_tokens" in str(excinfo.value) and "kvd_socket" in str(excinfo.value)


def test_the_connector_and_the_daemon_default_to_the_same_socket() -> None:
    assert KvdConnectorConfig().kvd_socket == KvdConfig().unix_socket
    assert KvdConnectorConfig().target == f"unix://{KvdConfig().unix_socket}"


def _documented_defaults(doc: str, heading: str) -> dict[str, str]:
    """``| `key` | `default` | ... |`` rows of the table under ``heading`` in ``docs/<doc>``."""
    text = (DOCS / doc).read_text()
    section = text[text.index(heading) :]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    return dict(re.findall(r"^\| `([a-z_]+)` \| `([^`]*)` \|", section, flags=re.M))


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return json.dumps(list(value))
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def test_every_connector_key_is_documented_with_its_default() -> None:
    documented = _documented_defaults("connector-config.md", "## Keys")
    config = KvdConnectorConfig()
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(KvdConnectorConfig)}
    assert set(documented) == set(fields)
    for name, value in fields.items():
        if name == "kvd_socket":
            assert documented[name] == '"/tmp/kvd-<uid>/engine.sock"'
        else:
            assert documented[name] == _shown(value), name


def test_every_daemon_key_is_documented_with_its_default() -> None:
    documented = _documented_defaults("operations.md", "## Daemon configuration")
    config = KvdConfig()
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(KvdConfig)}
    assert set(documented) == set(fields)
    for name, value in fields.items():
        if name == "unix_socket":
            assert documented[name] == '"/tmp/kvd-<uid>/engine.sock"'
        else:
            assert documented[name] == _shown(value), name

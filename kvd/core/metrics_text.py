"""Reading a daemon's /metrics page (for `kvd demo` and operators' scripts)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def fetch(metrics_address: str, timeout_s: float = 10.0) -> str:
    """The text of ``http://<address>/metrics``."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=timeout_s) as response:
        return response.read().decode()


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a metrics page as ``(name, labels, value)`` (``*_created`` left out)."""
    return [
        (sample.name, dict(sample.labels), float(sample.value))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    ]


def scrape(metrics_address: str, timeout_s: float = 10.0) -> dict[str, float]:
    """Every sample on ``http://<address>/metrics`` as ``{'name{labels}': value}``."""
    out: dict[str, float] = {}
    for name, labels, value in samples(fetch(metrics_address, timeout_s)):
        label_text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        out[f"{name}{{{label_text}}}" if label_text else name] = value
    return out


def counters_that_moved(metrics_address: str, before: dict[str, float]) -> dict[str, float]:
    """Samples that changed since ``before`` (all non-zero ones when ``before`` is empty)."""
    now = scrape(metrics_address)
    if not before:
        return now
    return {
        name: value
        for name, value in now.items()
        if value != before.get(name, 0.0) and not name.startswith(("process_", "python_"))
    }

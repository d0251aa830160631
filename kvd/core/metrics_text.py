"""Reading a daemon's /metrics page (for `kvd demo` and operators' scripts)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(metrics_address: str, timeout_s: float = 10.0) -> dict[str, float]:
    """Every sample on ``http://<address>/metrics`` as ``{'name{labels}': value}``."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return samples


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

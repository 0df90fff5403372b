"""Scrape a Prometheus endpoint in tests, parsed with prometheus_client's own text parser."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str, timeout_s: float = 10) -> dict[str, float]:
    """``{'name{label="v",...}': value}`` for every sample the endpoint at ``url`` serves."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples

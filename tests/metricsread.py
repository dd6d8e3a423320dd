"""Reading an in-memory OpenTelemetry metric reader in tests: one metric's points by attributes."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader


def points(reader: InMemoryMetricReader, name: str) -> dict[tuple[tuple[str, Any], ...], Any]:
    """``name``'s data points now, keyed by their sorted attributes: a counter's or gauge's
    value, a histogram's (count, sum). Empty if nothing was recorded."""
    data = reader.get_metrics_data()
    out: dict[tuple[tuple[str, Any], ...], Any] = {}
    if data is None:
        return out
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name != name:
                    continue
                for p in metric.data.data_points:
                    key = tuple(sorted((p.attributes or {}).items()))
                    out[key] = (p.count, p.sum) if hasattr(p, "bucket_counts") else p.value
    return out


def total(reader: InMemoryMetricReader, name: str, **attrs: Any) -> float:
    """Sum of ``name``'s values (a histogram: its count) over points whose attributes include
    ``attrs``."""
    got = 0.0
    for key, v in points(reader, name).items():
        if all((k, x) in key for k, x in attrs.items()):
            got += v[0] if isinstance(v, tuple) else v
    return got

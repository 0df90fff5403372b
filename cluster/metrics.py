"""Per-step metrics: one JSON line per step in ``<output_dir>/metrics.jsonl``, a console line, Prometheus gauges.

Metric keys are free-form ``group/name`` strings; each becomes a gauge ``grpo_<key>`` with every character outside
``[a-zA-Z0-9_:]`` replaced by ``_`` (``reward/mean`` → ``grpo_reward_mean``), labelled ``job``. The console line
shows the keys in :data:`CONSOLE_FIELDS` that are present, e.g.::

    step 3 | reward 0.125 acc 0.062 fmt 0.250 | kl 0.0012 clip 0.000 ent 1.23 gnorm 0.41 | len 96 | gen 12.1s ...

Usage::

    with MetricsLogger("runs/x", port=0) as metrics:
        metrics.log(1, {"reward/mean": 0.125, "timing/step_s": 44.0, "sync/verified": True})
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

__all__ = ["CONSOLE_FIELDS", "MetricsError", "MetricsLogger", "prometheus_name", "format_console_line",
           "read_metrics_jsonl"]

CONSOLE_FIELDS: tuple[tuple[tuple[str, str], ...], ...] = (
    (("policy_version", "v{:.0f}"),),
    (("reward/mean", "reward {:.3f}"), ("reward/accuracy", "acc {:.3f}"), ("reward/format", "fmt {:.3f}"),
     ("groups/all_equal_fraction", "flat {:.2f}")),
    (("actor/loss", "loss {:.4f}"), ("actor/kl", "kl {:.4f}"), ("actor/clip_fraction", "clip {:.3f}"),
     ("actor/entropy", "ent {:.2f}"), ("actor/grad_norm", "gnorm {:.2f}")),
    (("response_length/mean", "len {:.0f}"), ("response_length/clip_ratio", "trunc {:.2f}")),
    (("timing/generate_s", "gen {:.1f}s"), ("timing/train_s", "train {:.1f}s"), ("timing/sync_s", "sync {:.1f}s"),
     ("timing/step_s", "step {:.1f}s")),
    (("perf/rollout_tokens_per_s", "{:.0f} tok/s"),),
    (("sync/verified", "verified|NOT VERIFIED"),),
)
"""Console line layout: groups separated by ' | ', each a (metric key, format) list; a bool's format is
'shown if true|shown if false'. Keys not present in a step's metrics are left out."""


class MetricsError(RuntimeError):
    """The metrics endpoint could not be started."""


def prometheus_name(key: str) -> str:
    """``reward/mean`` → ``grpo_reward_mean``: prefix ``grpo_``, characters outside [a-zA-Z0-9_:] → ``_``."""
    return "grpo_" + re.sub(r"[^a-zA-Z0-9_:]", "_", key)


def _as_number(value: Any) -> float | None:
    """bool → 0/1, real numbers (incl. numpy/torch scalars via .item()) → float, anything else → None."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            value = value.item()
        except (TypeError, ValueError):
            return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _jsonable(value: Any) -> Any:
    """NaN/±inf → None (JSON has neither); scalars with .item() unwrapped; other non-JSON values → str."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            value = value.item()
        except (TypeError, ValueError):
            return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def format_console_line(step: int, metrics: Mapping[str, Any]) -> str:
    """The one-line human summary of a step (see :data:`CONSOLE_FIELDS`)."""
    groups = [f"step {step}"]
    for group in CONSOLE_FIELDS:
        parts = []
        for key, fmt in group:
            if key not in metrics:
                continue
            value = metrics[key]
            if "|" in fmt:
                parts.append(fmt.split("|")[0 if value else 1])
                continue
            number = _as_number(value)
            parts.append(fmt.format(number) if number is not None else f"{key} {value}")
        if parts:
            groups.append(" ".join(parts))
    return " | ".join(groups)


class MetricsLogger:
    """Writes ``<output_dir>/metrics.jsonl`` (append), prints a line per logged step, serves Prometheus gauges.

    port: TCP port of the ``/metrics`` HTTP endpoint on ``host``; 0 picks a free one (read it from ``.port``);
    None serves nothing. Gauges live in a private CollectorRegistry, so several loggers can coexist in a process.
    Raises MetricsError if the port cannot be bound.
    """

    def __init__(self, output_dir: str | Path, *, host: str = "127.0.0.1", port: int | None = 9300,
                 job: str = "grpo", echo: bool = True):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / "metrics.jsonl"
        self.host = host
        self.job = job
        self.echo = echo
        self.registry = CollectorRegistry(auto_describe=True)
        self._gauges: dict[str, Gauge] = {}
        self._server = self._thread = None
        self.port: int | None = None
        if port is not None:
            try:
                self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
            except OSError as exc:
                raise MetricsError(f"cannot serve Prometheus metrics on {host}:{port}: {exc}; set metrics.port to "
                                   f"a free port, 0 for any free port, or null to disable") from exc
            self.port = int(self._server.server_port)
        self._file = self.path.open("a", encoding="utf-8")

    @property
    def url(self) -> str | None:
        """``http://host:port/metrics``, or None when no server runs."""
        return None if self.port is None else f"http://{self.host}:{self.port}/metrics"

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one step: a JSON line ``{"step": step, **metrics}`` (NaN → null), a console line, gauges.

        Numbers and bools (as 0/1) go to Prometheus; other values only to the JSON line.
        """
        if "step" in metrics:
            raise ValueError(f"metrics must not contain the key 'step' (given as the step argument); got "
                             f"step={metrics['step']!r}")
        if self._file.closed:
            raise ValueError(f"MetricsLogger for {self.path} is closed")
        record = {"step": int(step), **{str(k): _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self.echo:
            print(format_console_line(step, metrics), flush=True)
        self._set_gauge("step", float(step))
        for key, value in metrics.items():
            number = _as_number(value)
            if number is not None:
                self._set_gauge(str(key), number)

    def _set_gauge(self, key: str, value: float) -> None:
        name = prometheus_name(key)
        gauge = self._gauges.get(name)
        if gauge is None:
            gauge = Gauge(name, f"GRPO metric {key!r}", labelnames=["job"], registry=self.registry)
            self._gauges[name] = gauge
        gauge.labels(job=self.job).set(value)

    def close(self) -> None:
        """Stop the HTTP server and close the jsonl file; safe to call twice."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = self._thread = None
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_metrics_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file, in order; blank lines ignored; raises ValueError with file:line."""
    records = []
    with Path(path).open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: invalid JSON: {exc.msg} at column {exc.colno}") from None
    return records

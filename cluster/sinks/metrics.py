"""Per-step metrics: one JSON line per step in ``<output_dir>/metrics.jsonl``, a console line, Prometheus gauges.

Metric keys are free-form ``group/name`` strings; each becomes a gauge ``grpo_<key>`` with every character outside
``[a-zA-Z0-9_:]`` replaced by ``_`` (``reward/mean`` → ``grpo_reward_mean``; the names, labels and HELP texts are
:mod:`cluster.sinks.metric_names`'). Every series carries three labels:

- ``job``: the job name (``spec.name``);
- ``pool``: ``rollout``, ``train``, ``sync`` or ``driver``, derived from the key for the driver's figures
  (:func:`cluster.sinks.metric_names.pool_of`: ``actor/*`` → train, ``rollout/*`` → rollout, ``sync/*`` → sync,
  …) or given to :meth:`MetricsLogger.log_worker`;
- ``worker``: ``driver`` for the driver's aggregate figures (:meth:`MetricsLogger.log`), else the worker's name
  (``engine-0``, ``train-3``) for per-worker figures (:meth:`MetricsLogger.log_worker`, also written to
  ``<output_dir>/workers.jsonl``).

So ``grpo_perf_rollout_tokens_per_s{worker="driver"}`` is the pool's throughput and
``grpo_perf_rollout_tokens_per_s{worker!="driver"}`` one series per engine. The console line shows the keys in
:data:`CONSOLE_FIELDS` that are present, e.g.::

    step 3 | reward 0.125 acc 0.062 fmt 0.250 | kl 0.0012 clip 0.000 ent 1.23 gnorm 0.41 | len 96 | gen 12.1s ...

Usage::

    with MetricsLogger("runs/x", port=0) as metrics:
        metrics.log(1, {"reward/mean": 0.125, "timing/step_s": 44.0, "sync/verified": True})
        metrics.log_worker(1, "rollout", "engine-0", {"perf/rollout_tokens_per_s": 93.8, "rollout/queue_depth": 2})
"""

from __future__ import annotations

import json
import math
import numbers
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from cluster.sinks.metric_names import (DRIVER_WORKER, LABELS, LAST_STEP_TIMESTAMP_KEY, METRIC_HELP, POOLS, pool_of,
                                       prometheus_name)
from cluster.spec.agents import AGENT_REWARD
from grpo.rewards import REWARD_SUMMARY_METRICS

__all__ = ["CONSOLE_COMPONENTS", "CONSOLE_FIELDS", "MetricSinks", "MetricsError", "MetricsLogger",
           "format_console_line", "read_metrics_jsonl", "reward_components"]

CONSOLE_FIELDS: tuple[tuple[tuple[str, str], ...], ...] = (
    (("policy_version", "v{:.0f}"),),
    (("reward/mean", "reward {:.3f}"), ("reward/accuracy", "acc {:.3f}"), ("reward/format", "fmt {:.3f}"),
     ("reward/*", "{} {:.3f}"), ("reward/infra_failed", "?unscored {:.0f}"),
     ("groups/all_equal_fraction", "flat {:.2f}")),
    (("actor/loss", "loss {:.4f}"), ("actor/kl", "kl {:.4f}"), ("actor/clip_fraction", "clip {:.3f}"),
     ("actor/entropy", "ent {:.2f}"), ("actor/grad_norm", "gnorm {:.2f}")),
    (("response_length/mean", "len {:.0f}"), ("response_length/clip_ratio", "trunc {:.2f}")),
    (("timing/generate_s", "gen {:.1f}s"), ("timing/train_s", "train {:.1f}s"), ("timing/sync_s", "sync {:.1f}s"),
     ("timing/step_s", "step {:.1f}s")),
    (("perf/rollout_tokens_per_s", "{:.0f} tok/s"),),
    (("sync/verified", "verified|NOT VERIFIED"),),
    (("eval/accuracy", "eval {:.3f}"), ("eval/accuracy_ci_low", "[{:.3f},"), ("eval/accuracy_ci_high", "{:.3f}]"),
     ("eval/n", "n={:.0f}"), ("eval/unscored", "?unscored {:.0f}"), ("eval/dropped", "dropped {:.0f}")),
    (("monitor/tripped", "GUARD TRIPPED|guard ok"),),
)
"""Console line layout: groups separated by ' | ', each a (metric key, format) list; a bool's format is
'shown if true|shown if false'; one starting with '?' only when the value is not 0 (``reward/infra_failed``,
``eval/unscored``: what could not be scored). Keys not present in a step's metrics are left out. ``reward/*`` stands
for the reward's other components (:func:`reward_components`), each as ``<name> 0.125``."""

#: The most reward components ``reward/*`` names on the console line (the first by name; ``+N more`` for the rest,
#: all of them are in metrics.jsonl).
CONSOLE_COMPONENTS = 4
#: ``reward/<name>`` keys that are not a component ``reward/*`` shows: the driver's summaries (counts, spread), the
#: components the line names by their own abbreviation, and an agent's total (the reward itself with an agent).
_NOT_COMPONENTS = frozenset({*(f"reward/{name}" for name in REWARD_SUMMARY_METRICS), "reward/accuracy",
                             "reward/format", f"reward/{AGENT_REWARD}"})


class MetricsError(RuntimeError):
    """The metrics endpoint could not be started."""


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


def reward_components(metrics: Mapping[str, Any]) -> list[str]:
    """The reward's components a step's console line names besides ``acc`` and ``fmt``: each ``reward/<name>`` that
    holds a number and is not in ``_NOT_COMPONENTS`` (nor a per-component count ``reward/scored/<name>``), as
    ``<name> 0.125``, the first :data:`CONSOLE_COMPONENTS` by name, then ``+N more`` when there are more."""
    names = sorted(key for key, value in metrics.items() if key.startswith("reward/") and key.count("/") == 1
                   and key not in _NOT_COMPONENTS and _as_number(value) is not None)
    shown = [f"{key.removeprefix('reward/')} {_as_number(metrics[key]):.3f}" for key in names[:CONSOLE_COMPONENTS]]
    more = len(names) - CONSOLE_COMPONENTS
    return shown + [f"+{more} more"] if more > 0 else shown


def format_console_line(step: int, metrics: Mapping[str, Any]) -> str:
    """The one-line human summary of a step (see :data:`CONSOLE_FIELDS`)."""
    groups = [f"step {step}"]
    for group in CONSOLE_FIELDS:
        parts = []
        for key, fmt in group:
            if key == "reward/*":
                parts.extend(reward_components(metrics))
                continue
            if key not in metrics:
                continue
            value = metrics[key]
            if "|" in fmt:
                parts.append(fmt.split("|")[0 if value else 1])
                continue
            number = _as_number(value)
            if fmt.startswith("?") and not number:
                continue
            fmt = fmt.removeprefix("?")
            parts.append(fmt.format(number) if number is not None else f"{key} {value}")
        if parts:
            groups.append(" ".join(parts))
    return " | ".join(groups)


class MetricsLogger:
    """Writes ``<output_dir>/metrics.jsonl`` (append), prints a line per logged step, serves Prometheus gauges.

    port: TCP port of the ``/metrics`` HTTP endpoint on ``host`` (prometheus_client's server: it serves the
    exposition text and nothing else); 0 picks a free one (read it from ``.port``); None serves nothing. Gauges live in
    a private CollectorRegistry, so several loggers can coexist in a process. Every series is labelled
    ``job``/``pool``/``worker`` (see the module docstring). Raises MetricsError if the port cannot be bound.
    """

    def __init__(self, output_dir: str | Path, *, host: str = "127.0.0.1", port: int | None = 9300,
                 job: str = "grpo", echo: bool = True):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / "metrics.jsonl"
        self.workers_path = self.output_dir / "workers.jsonl"
        self.host = host
        self.job = job
        self.echo = echo
        self.registry = CollectorRegistry(auto_describe=True)
        self._gauges: dict[str, Gauge] = {}
        self._worker_series: dict[tuple[str, str], set[str]] = {}  # (pool, worker) → gauge names it has set
        self._lock = threading.Lock()
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
        self._workers_file = None  # opened on the first log_worker call
        self._set_gauge(LAST_STEP_TIMESTAMP_KEY, "driver", DRIVER_WORKER, time.time())

    @property
    def url(self) -> str | None:
        """``http://host:port/metrics``, or None when no server runs."""
        return None if self.port is None else f"http://{self.host}:{self.port}/metrics"

    def reopen(self) -> None:
        """Reopen ``metrics.jsonl`` and ``workers.jsonl`` after they were replaced on disk (a rollback cuts them back
        with an atomic rename, which leaves open handles on the old files)."""
        with self._lock:
            for fh in (self._file, self._workers_file):
                if fh is not None:
                    fh.close()
            self._file = self.path.open("a", encoding="utf-8")
            self._workers_file = None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one step: a JSON line ``{"step": step, **metrics}`` (NaN → null), a console line, gauges.

        Numbers and bools (as 0/1) go to Prometheus with ``worker="driver"`` and ``pool=pool_of(key)``, plus
        ``grpo_step`` and ``grpo_last_step_timestamp_seconds`` (now); other values only to the JSON line.
        Raises ValueError if ``metrics`` has a ``step`` key or the logger is closed.
        """
        if "step" in metrics:
            raise ValueError(f"metrics must not contain the key 'step' (given as the step argument); got "
                             f"step={metrics['step']!r}")
        self._check_open()
        record = {"step": int(step), **{str(k): _jsonable(v) for k, v in metrics.items()}}
        with self._lock:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        if self.echo:
            print(format_console_line(step, metrics), flush=True)
        self._set_gauge("step", "driver", DRIVER_WORKER, float(step))
        self._set_gauge(LAST_STEP_TIMESTAMP_KEY, "driver", DRIVER_WORKER, time.time())
        for key, value in metrics.items():
            number = _as_number(value)
            if number is not None:
                self._set_gauge(str(key), pool_of(str(key)), DRIVER_WORKER, number)

    def log_worker(self, step: int, pool: str, worker: str, metrics: Mapping[str, Any]) -> None:
        """Record one worker's own figures (e.g. an engine's tokens/s, KV-cache use, queue depth, restarts).

        Each number becomes the gauge of the same name as :meth:`log` would export (``rollout/queue_depth`` →
        ``grpo_rollout_queue_depth``) with labels ``pool=pool, worker=worker``; the whole record goes to
        ``<output_dir>/workers.jsonl`` as ``{"step", "pool", "worker", **metrics}``. Nothing is printed.

        Raises:
            ValueError: ``pool`` not in :data:`POOLS`; ``worker`` empty or ``"driver"`` (reserved for aggregates);
                ``metrics`` has a ``step``, ``pool`` or ``worker`` key; the logger is closed.
        """
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {list(POOLS)}; got {pool!r}")
        if not worker or worker == DRIVER_WORKER:
            raise ValueError(f"worker must be a non-empty name other than {DRIVER_WORKER!r} (reserved for the "
                             f"driver's aggregate figures); got {worker!r}")
        clash = sorted({"step", "pool", "worker"} & set(metrics))
        if clash:
            raise ValueError(f"worker metrics must not contain the keys {clash} (given as arguments)")
        self._check_open()
        record = {"step": int(step), "pool": pool, "worker": worker,
                  **{str(k): _jsonable(v) for k, v in metrics.items()}}
        with self._lock:
            if self._workers_file is None:
                self._workers_file = self.workers_path.open("a", encoding="utf-8")
            self._workers_file.write(json.dumps(record, allow_nan=False) + "\n")
            self._workers_file.flush()
        for key, value in metrics.items():
            number = _as_number(value)
            if number is not None:
                self._set_gauge(str(key), pool, worker, number)

    def remove_worker(self, pool: str, worker: str) -> int:
        """Drop every series of a worker that left the job (e.g. a rollout engine removed by scaling), so Prometheus
        stops seeing it. Returns the number of series removed (0 for an unknown worker)."""
        with self._lock:
            names = self._worker_series.pop((pool, worker), set())
            for name in names:
                self._gauges[name].remove(self.job, pool, worker)
        return len(names)

    def _check_open(self) -> None:
        if self._file.closed:
            raise ValueError(f"MetricsLogger for {self.path} is closed")

    def _set_gauge(self, key: str, pool: str, worker: str, value: float) -> None:
        name = prometheus_name(key)
        with self._lock:
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = Gauge(name, METRIC_HELP.get(key, f"GRPO metric {key!r}"), labelnames=list(LABELS),
                              registry=self.registry)
                self._gauges[name] = gauge
            gauge.labels(job=self.job, pool=pool, worker=worker).set(value)
            if worker != DRIVER_WORKER:
                self._worker_series.setdefault((pool, worker), set()).add(name)

    def close(self) -> None:
        """Stop the HTTP server and close the jsonl files; safe to call twice."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = self._thread = None
        with self._lock:
            for fh in (self._file, self._workers_file):
                if fh is not None and not fh.closed:
                    fh.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class MetricSinks:
    """Several metric sinks (``contract.protocols.MetricSink``) as one: every call goes to each, in order.

    Attributes:
        sinks: the sinks. url: the first sink's Prometheus address that is not None (None when none serves one).
        port: that sink's port (None likewise).
    """

    def __init__(self, sinks: list):
        self.sinks = list(sinks)

    @property
    def url(self) -> str | None:
        return next((s.url for s in self.sinks if getattr(s, "url", None) is not None), None)

    @property
    def port(self) -> int | None:
        return next((s.port for s in self.sinks if getattr(s, "port", None) is not None), None)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def log_worker(self, step: int, pool: str, worker: str, metrics: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.log_worker(step, pool, worker, metrics)

    def remove_worker(self, pool: str, worker: str) -> int:
        """Returns the series removed, summed over the sinks."""
        return sum(sink.remove_worker(pool, worker) for sink in self.sinks)

    def log_samples(self, step: int, records: list) -> None:
        """The step's sample records (``cluster.loop.samples``) to every sink that takes them (``log_samples``:
        ``samples.jsonl``, the trackers' tables); a sink without the method is passed over."""
        for sink in self.sinks:
            log = getattr(sink, "log_samples", None)
            if log is not None:
                log(step, records)

    def reopen(self) -> None:
        for sink in self.sinks:
            sink.reopen()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


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

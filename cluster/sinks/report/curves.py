"""The report's curves: one plotly figure per panel, every panel against the training step.

Panels (a panel whose keys the run did not log is left out, and named in :func:`curve_figures`' ``missing``):

- the ``grpo-cluster plot`` panels, from the same selection (``cluster.sinks.plot.plot_data``): reward components,
  held-out accuracy with its 95 % interval as a band (and the best so far), mean response length, KL to the
  reference policy, and the guard (each detector's firings; every trip a red line across the panels);
- clip fraction (``actor/clip_fraction``) and the trainer-vs-engine logprob gap (``rollout/logprob_diff``: the mean
  of what the sample browser shades per token);
- health warnings (``health/<detector>`` = 1 when it warned) beside the guard's detectors;
- timings: ``timing/<phase>_s`` of each step (generate, score, train, sync, and the step);
- time by pool (``time/<pool>_busy_s``, worker-seconds of the step) and goodput (``goodput/tokens_per_s``), when the
  run logged them.

Imports plotly (the ``report`` dependency) when called.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from cluster.sinks.plot import (EVAL_BEST_KEY, EVAL_KEY, LENGTH_KEY, REWARD_PREFIX, PlotData, Series, interval_band,
                                series)

__all__ = ["MEAN_COLOR", "curve_figures"]

#: The colour of the main series of each panel (``reward/mean``, held-out accuracy, ...): tests find it on a screenshot.
MEAN_COLOR = "#1f77b4"
TRIP_COLOR = "#d62728"
PHASE_KEYS = ("timing/generate_s", "timing/score_s", "timing/train_s", "timing/sync_s", "timing/step_s")
POOL_BUSY = re.compile(r"^time/([a-z0-9_]+)_busy_s$")
HEALTH = re.compile(r"^health/([a-z0-9_]+)$")
HEALTH_SUMMARY = {"health/warnings"}


def _line(go, s: Series, name: str | None = None, **style) -> Any:
    style = {"marker": {"size": 4}, **style}
    return go.Scatter(x=list(s.steps), y=list(s.values), name=name or s.key, mode="lines+markers", **style)


class _Panels:
    """The panels of one run: its records, plot data, guard trips and last step (every x axis spans 0..last)."""

    def __init__(self, go, records: Sequence[Mapping[str, Any]], data: PlotData):
        self.go = go
        self.records = records
        self.data = data
        self.keys = {k for record in records for k in record}
        self.last_step = max(1, max(int(r["step"]) for r in records))

    def figure(self, title: str, ytitle: str, traces: list):
        fig = self.go.Figure(traces)
        fig.update_layout(title={"text": title, "x": 0.01, "font": {"size": 14}}, height=300,
                          margin={"l": 55, "r": 10, "t": 40, "b": 35}, legend={"font": {"size": 10}},
                          template="plotly_white", hovermode="x unified")
        fig.update_xaxes(title_text="step", range=[-0.02 * self.last_step, 1.02 * self.last_step], tick0=0,
                         dtick=max(1, math.ceil(self.last_step / 10)))
        fig.update_yaxes(title_text=ytitle)
        for step in self.data.trips:
            fig.add_vline(x=step, line_color=TRIP_COLOR, opacity=0.4)
        return fig

    def rewards(self):
        """``reward/mean`` drawn last (on top: a single component has the same values) and listed first."""
        mean = f"{REWARD_PREFIX}mean"
        traces = [_line(self.go, s) for s in self.data.rewards if s.key != mean]
        traces += [_line(self.go, s, line={"color": MEAN_COLOR, "width": 3}, legendrank=1)
                   for s in self.data.rewards if s.key == mean]
        return self.figure("Reward components (training samples)", "reward", traces) if traces else None

    def held_out(self):
        data, go = self.data, self.go
        if data.eval_accuracy is None:
            return None
        traces = []
        if data.eval_low is not None and data.eval_high is not None:
            steps, lows, highs = interval_band(data.eval_low, data.eval_high)
            traces.append(go.Scatter(x=steps, y=highs, mode="lines", line={"width": 0}, showlegend=False,
                                     hoverinfo="skip"))
            traces.append(go.Scatter(x=steps, y=lows, mode="lines", line={"width": 0}, fill="tonexty",
                                     fillcolor="rgba(31,119,180,0.2)", name="95 % interval"))
        traces.append(_line(go, data.eval_accuracy, EVAL_KEY, line={"color": MEAN_COLOR, "width": 3},
                            marker={"size": 8}))
        if data.eval_best is not None:
            traces.append(_line(go, data.eval_best, EVAL_BEST_KEY, line={"dash": "dash", "color": "#555"}))
        return self.figure("Held-out accuracy (95 % Wilson interval)", "pass@1", traces)

    def single(self, s: Series | None, title: str, ytitle: str):
        if s is None:
            return None
        return self.figure(title, ytitle, [_line(self.go, s, line={"color": MEAN_COLOR, "width": 2})])

    def several(self, keys: Sequence[str], title: str, ytitle: str):
        traces = [_line(self.go, s) for key in keys if (s := series(self.records, key)) is not None]
        return self.figure(title, ytitle, traces) if traces else None

    def firings(self):
        """The guard's detectors and the health warnings: a mark on each step a ``monitor/<name>`` or
        ``health/<name>`` was 1."""
        data = self.data
        rows = [(f"guard: {name}", list(steps)) for name, steps in data.detectors.items()]
        for key in sorted(k for k in self.keys if HEALTH.match(k) and k not in HEALTH_SUMMARY):
            fired = series(self.records, key)
            rows.append((f"health: {HEALTH.match(key).group(1)}",
                         [] if fired is None else [s for s, v in zip(fired.steps, fired.values) if v >= 1.0]))
        if not rows and not data.guard_logged:
            return None
        marker = {"symbol": "line-ns-open", "size": 14, "color": TRIP_COLOR, "line": {"width": 3}}
        traces = [self.go.Scatter(x=steps, y=[name] * len(steps), mode="markers", name=name, showlegend=False,
                                  marker=marker) for name, steps in rows]
        fired = any(steps for _, steps in rows)
        fig = self.figure("Guard detectors and health warnings" + ("" if fired or data.trips else " (none fired)"),
                          "", traces)
        fig.update_yaxes(categoryorder="array", categoryarray=[name for name, _ in rows], type="category")
        return fig


def curve_figures(records: Sequence[Mapping[str, Any]], data: PlotData) -> tuple[list, list[str]]:
    """The report's panels (module docstring) from a run's metrics records (at least one) and their plot data.

    Returns:
        (the plotly figures, in page order; the titles of the panels the run logged nothing for).
    """
    import plotly.graph_objects as go

    panels = _Panels(go, records, data)
    pools = sorted(m.group(1) for k in panels.keys if (m := POOL_BUSY.match(k)))
    figures = [
        ("Reward components", panels.rewards()),
        ("Held-out accuracy", panels.held_out()),
        ("Response length", panels.several((LENGTH_KEY, "response_length/max"), "Response length", "tokens")),
        ("KL", panels.single(data.kl, "KL to the reference policy (actor/kl)", "nats/token")),
        ("Clip fraction", panels.single(series(records, "actor/clip_fraction"),
                                        "Clip fraction (actor/clip_fraction)", "fraction of tokens")),
        ("Logprob gap", panels.single(series(records, "rollout/logprob_diff"),
                                      "Trainer vs engine logprob gap (rollout/logprob_diff)", "nats/token")),
        ("Guard and health", panels.firings()),
        ("Timings", panels.several(PHASE_KEYS, "Step timings", "seconds")),
        ("Time by pool", panels.several([f"time/{p}_busy_s" for p in pools],
                                        "Busy time by pool (time/<pool>_busy_s)", "worker-seconds")),
        ("Goodput", panels.several(("goodput/tokens_per_s",), "Goodput (goodput/tokens_per_s)",
                                   "trained tokens / s")),
    ]
    missing = [title for title, fig in figures if fig is None and title not in ("Time by pool", "Goodput")]
    return [fig for _, fig in figures if fig is not None], missing

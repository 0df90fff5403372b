"""The report page: one self-contained HTML file (plotly's JavaScript, the styles, the browser's script and the run's
data all inside it), which opens offline from disk with no server.

Sections: the job's header and the reading's notes; the end-of-run summary (``summary.txt``) when the run wrote one;
the curves (:mod:`cluster.sinks.report.curves`); the held-out evaluation table (``eval/*`` of every evaluated step,
the trackers' ``eval/table``); the sample browser (``browser.js``: step → group → completion, and each evaluation's
problems; a completion opens with its tokens shaded by advantage, by trainer-vs-engine logprob gap or by whether they
were trained on, a multi-turn episode turn by turn with its tool calls and observations). The URL fragment names what
is open: ``#train/<step>/<group id>/<completion>``, ``#eval/<step>/<problem>/<completion>`` (a shorter fragment opens
a step or a group).

The run's data goes in as JSON inside a ``<script type="application/json">`` element with ``<``, ``>`` and ``&``
escaped, and the browser puts every text from it into the page as text (``textContent``), never as markup: a
completion that writes ``</script>`` or ``<img onerror=...>`` shows as those characters.
"""

from __future__ import annotations

import html
import json
import math
from importlib import resources
from string import Template
from typing import Any

from cluster.sinks.report.curves import curve_figures
from cluster.sinks.report.run import RunView
from cluster.sinks.trackers import eval_table

__all__ = ["render_page"]

#: No mode bar (drag to zoom, double-click to reset, hover for values), no plotly logo.
PLOTLY_CONFIG = {"displaylogo": False, "displayModeBar": False, "responsive": True}

PAGE = Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>$title</title>
<style>$css</style>
<script>$plotly</script>
</head>
<body>
<header>
<h1>$title</h1>
<p class="meta">$meta</p>
$notes
</header>
$summary
<section id="curves">
<h2>Curves</h2>
<p class="meta">Against the training step; red vertical lines: steps where the reward-hacking guard tripped.$missing</p>
<div class="grid">
$figures
</div>
</section>
<section id="eval">
<h2>Held-out evaluation</h2>
$eval_table
</section>
<section id="samples">
<h2>Samples</h2>
<p class="meta">Each step's sampled groups (metrics.samples_per_step) and every held-out problem of each evaluation
(samples.jsonl). Choose a step, a group, then a completion: its tokens are shaded by the mode chosen below.</p>
<div id="browser">
<div class="col"><h3>Step</h3><ul id="steps"></ul></div>
<div class="col"><h3 id="groups-title">Group</h3><ul id="groups"></ul></div>
<div class="col"><h3>Completion</h3><ul id="completions"></ul></div>
</div>
<div id="sample-view"><p class="meta">No completion open.</p></div>
</section>
<script type="application/json" id="samples-data">$data</script>
<script>$browser</script>
</body>
</html>
""")


def _asset(name: str) -> str:
    return resources.files("cluster.sinks.report").joinpath(name).read_text(encoding="utf-8")


def _finite_json(value: Any) -> Any:
    """``value`` with every NaN or ±inf float as None: JSON has neither, and a ``samples.jsonl`` written by hand or
    by another program may hold them (Python's ``json`` reads ``NaN``, ``Infinity`` and ``1e400``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    return value


def _json_for_script(value: Any) -> str:
    """JSON that cannot end its ``<script>`` element early nor open markup: ``<``, ``>`` and ``&`` as escapes; a
    number that is not finite as null."""
    text = json.dumps(_finite_json(value), ensure_ascii=False, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _number(value: Any, percent: bool = False) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return ""
    return f"{100 * value:.1f} %" if percent else f"{value:.4g}" if isinstance(value, float) else str(value)


def _eval_table(view: RunView) -> str:
    """The ``eval/table`` rows as an HTML table (accuracy with its interval, as percentages)."""
    table = eval_table(view.records)
    if not table.rows:
        return '<p class="meta">The run logged no held-out evaluation (no eval section).</p>'
    head = ("<tr><th>step</th><th>accuracy</th><th>95 % interval</th><th>completions</th><th>format rate</th>"
            "<th>mean length</th><th>truncated</th></tr>")
    rows = []
    for row in table.rows:
        r = dict(zip(table.columns, row))
        interval = (f"[{_number(r['eval/accuracy_ci_low'], True)}, {_number(r['eval/accuracy_ci_high'], True)}]"
                    if r.get("eval/accuracy_ci_low") is not None else "")
        cells = (r["step"], _number(r["eval/accuracy"], True), interval, _number(r.get("eval/n")),
                 _number(r.get("eval/format_rate"), True), _number(r.get("eval/response_length_mean")),
                 _number(r.get("eval/truncated_fraction"), True))
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return f'<table class="eval">{head}{"".join(rows)}</table>'


def _summary(view: RunView) -> str:
    if view.summary is None:
        return ""
    return f'<section id="summary"><h2>Summary</h2><pre>{html.escape(view.summary)}</pre></section>'


def render_page(view: RunView) -> str:
    """The whole page of ``view`` (module docstring), as HTML text."""
    from plotly.offline import get_plotlyjs

    figures, missing = curve_figures(view.records, view.data)
    divs = ['<div class="curve">' + fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"curve-{i}",
                                                 config=PLOTLY_CONFIG) + "</div>" for i, fig in enumerate(figures)]
    steps = f"{view.last_step} steps" + (f" of {view.total_steps}" if view.total_steps is not None else "")
    notes = "".join(f'<p class="note">{html.escape(note)}</p>' for note in view.notes)
    data = {"train": {str(step): records for step, records in sorted(view.train.items())},
            "eval": {str(step): records for step, records in sorted(view.evals.items())}}
    return PAGE.substitute(
        title=html.escape(f"{view.name}: run report"), css=_asset("report.css"), plotly=get_plotlyjs(),
        meta=html.escape(f"{steps} · run folder {view.run_dir.resolve()}"), notes=notes, summary=_summary(view),
        missing=html.escape(f" Not logged by this run: {', '.join(missing)}." if missing else ""),
        figures="\n".join(divs), eval_table=_eval_table(view), data=_json_for_script(data),
        browser=_asset("browser.js"))

"""What the tracker modules share: the held-out evaluation table's columns, the default project name, the run
configuration as flat parameters and a table as Markdown.

Imports only the standard library.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from contract.trackers import Table

__all__ = ["DEFAULT_PROJECT", "EVAL_COLUMNS", "EVAL_TABLE", "flatten", "last_step", "markdown_table"]

#: Columns of the held-out evaluation table, in order (``step`` first).
EVAL_COLUMNS: tuple[str, ...] = ("step", "eval/accuracy", "eval/accuracy_ci_low", "eval/accuracy_ci_high", "eval/n",
                                 "eval/unscored", "eval/format_rate", "eval/response_length_mean",
                                 "eval/truncated_fraction")
#: The name the held-out evaluation table is logged under (:class:`contract.trackers.Table`).
EVAL_TABLE = "eval/table"
#: Project (wandb, trackio) or experiment (MLflow) when ``metrics.project`` is null.
DEFAULT_PROJECT = "grpo-cluster"


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config → ``{"spec.train.lr": "1e-06", ...}``: dotted keys, values as JSON text (strings unquoted)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def _markdown_cell(value: Any) -> str:
    """A table cell as Markdown: floats with 4 significant digits, None empty; in text, ``|`` escaped and line
    breaks as ``<br>`` (a cell is one line of the table)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "<br>").replace("\n", "<br>")


def markdown_table(table: Table) -> str:
    """A Markdown table (TensorBoard's text plugin renders it): one line per row (:func:`_markdown_cell`)."""
    cells = [" | ".join(table.columns), " | ".join("---" for _ in table.columns)]
    cells += [" | ".join(_markdown_cell(v) for v in row) for row in table.rows]
    return "\n".join(cells)


def last_step(tables: Sequence[Table]) -> int:
    """The largest integer in the first column of ``tables``' rows whose first column is ``step``; 0 when none (the
    step TensorBoard files end-of-job artifacts at)."""
    steps = [row[0] for table in tables if table.columns[:1] == ("step",) for row in table.rows]
    return max((step for step in steps if isinstance(step, int)), default=0)

"""The curves of a multi-turn run (``rollout.multi_turn``) from its ``metrics.jsonl``, as one PNG.

Panels against the training step: the reward (``reward/mean``); tool use (``episode/tool_calls_mean``,
``episode/tool_success_rate``, ``episode/turns_mean``); held-out accuracy (``eval/accuracy`` with its 95 % interval,
evaluations marked) and held-out tool calls per episode (``eval/tool_calls_mean``); the sampled length
(``response_length/mean``) and the observation tokens (``episode/observation_tokens_mean``) per episode.

    .venv/bin/python -m bench.plot_multi_turn runs/tool_calc_cpu docs/tool_calc_cpu_12_steps.png [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def column(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that logged ``key`` with a finite number."""
    pairs = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))
             and not isinstance(r.get(key), bool) and math.isfinite(float(r[key]))]
    return [s for s, _ in pairs], [v for _, v in pairs]


def render(rows: list[dict], out: Path, title: str) -> Path:
    """Draw the four panels into ``out`` (Agg canvas, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 7.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2, sharex=True).flatten()
    panels = [
        ("reward", [("reward/mean", "reward/mean")]),
        ("tool use per episode (training samples)", [("episode/tool_calls_mean", "tool calls"),
                                                     ("episode/tool_success_rate", "tool call success rate"),
                                                     ("episode/turns_mean", "turns")]),
        ("held-out (greedy episodes)", [("eval/accuracy", "accuracy"), ("eval/tool_calls_mean", "tool calls")]),
        ("tokens per episode", [("response_length/mean", "sampled"),
                                ("episode/observation_tokens_mean", "observation")]),
    ]
    for ax, (name, keys) in zip(axes, panels):
        for key, label in keys:
            steps, values = column(rows, key)
            if steps:
                ax.plot(steps, values, marker="o" if key.startswith("eval/") else None, label=label)
        if name.startswith("held-out"):
            steps, low = column(rows, "eval/accuracy_ci_low")
            _, high = column(rows, "eval/accuracy_ci_high")
            if steps:
                ax.fill_between(steps, low, high, alpha=0.2, label="accuracy 95 % CI")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[2:]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--title", default=None, help="figure title; default the run folder's name")
    args = p.parse_args()
    rows = [json.loads(line) for line in (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    print(render(rows, Path(args.out), args.title or Path(args.run_dir).name))


if __name__ == "__main__":
    main()

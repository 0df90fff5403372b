"""The end-of-run summary: what a run showed and where everything it wrote is, printed at its end and written to
``summary.json`` and ``summary.txt`` in the run folder.

Built from the run's ``metrics.jsonl`` rows (every step of the run, across resumes) and what only the finishing job
knows (its wall time, why it stopped, the accounting's own cost):

- **Held-out accuracy before and after**: the first and the last ``eval/accuracy`` rows with their 95 % Wilson
  intervals (``eval/accuracy_ci_low``/``_high``) and ``eval/n``. The rule for "beyond noise": the two intervals do not
  overlap (the later one wholly above: ``improved``; wholly below: ``worse``; else ``within noise``). It is
  conservative: for two independent proportions non-overlapping 95 % intervals mean p < 0.01 or so, and both
  evaluations score the same held-out problems (positively correlated outcomes), which only makes a real change
  easier to see than the rule admits.
- **Steps and wall time by phase**: steps trained, the sums of ``timing/{generate,score,train,sync,step}_s`` and of
  ``eval/seconds``, and this process's wall time from the job's construction, with what the steps and evaluations
  leave of it (start-up, checkpoints) when every step was run by this process.
- **Goodput** (``cluster.loop.goodput``): trained tokens over the steps' wall time and per core-second, and each
  pool's busy / waiting / idle worker-seconds summed over the steps, as shares of its workers × wall.
- **Warnings and guard trips**: the steps each ``health/<detector>`` warned on, the steps the guard tripped on
  (``monitor/tripped``) with its detectors, and its rollbacks.
- **Outputs**: each file the run wrote and each folder holding something (checkpoints only when one was saved), with
  what it is, then the commands that draw the run (``grpo-cluster plot``, ``grpo-cluster report``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from cluster.loop.checkpoints import complete_checkpoints

__all__ = ["SUMMARY_JSON", "SUMMARY_TXT", "build_summary", "summary_text", "write_summary"]

SUMMARY_JSON, SUMMARY_TXT = "summary.json", "summary.txt"
PHASES = ("generate", "score", "train", "sync")
_POOL_KEY = re.compile(r"time/([a-z0-9]+)_(workers|busy_s|waiting_s|idle_s)$")
_HEALTH_KEY = re.compile(r"health/([a-z_]+)$")
_MONITOR_SKIP = {"monitor/tripped", "monitor/rollbacks"}

#: Run-folder entries the summary lists when they exist: (path under output_dir, what it is).
OUTPUTS = (
    ("metrics.jsonl", "one row of metrics per step (step 0: the starting weights' evaluation)"),
    ("workers.jsonl", "per-engine figures per step"),
    ("trained_prompts.jsonl", "the prompts each step trained on"),
    ("samples.jsonl", "sampled completions per step"),
    ("spec.yaml", "the spec as run"),
    (SUMMARY_JSON, "this summary, as JSON"),
    (SUMMARY_TXT, "this summary, as text"),
    ("driver.log", "library log records of the driver below ERROR"),
    ("logs", "each worker's log"),
    ("wandb", "wandb run (offline)"), ("mlflow", "MLflow store"), ("tensorboard", "TensorBoard events"),
    ("trackio", "trackio database"), ("plot.png", "the run's picture (grpo-cluster plot)"),
)


def _num(row: Mapping, key: str) -> float | None:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _total(rows: Iterable[Mapping], key: str) -> float:
    return sum(v for r in rows if (v := _num(r, key)) is not None)


def _eval_point(row: Mapping) -> dict:
    return {"step": int(row["step"]), "accuracy": _num(row, "eval/accuracy"),
            "ci_low": _num(row, "eval/accuracy_ci_low"), "ci_high": _num(row, "eval/accuracy_ci_high"),
            "n": _num(row, "eval/n")}


def held_out_change(rows: list[Mapping]) -> dict | None:
    """The first and last held-out evaluations and the verdict (module docstring); ``after`` None with one
    evaluation; None without any."""
    evals = [r for r in rows if _num(r, "eval/accuracy") is not None]
    if len(evals) < 2:
        return {"before": _eval_point(evals[0]), "after": None, "verdict": "one evaluation only"} if evals else None
    before, after = _eval_point(evals[0]), _eval_point(evals[-1])
    verdict = "within noise"
    if None in (before["ci_low"], before["ci_high"], after["ci_low"], after["ci_high"]):
        verdict = "no interval"
    elif after["ci_low"] > before["ci_high"]:
        verdict = "improved beyond noise"
    elif after["ci_high"] < before["ci_low"]:
        verdict = "worse beyond noise"
    return {"before": before, "after": after, "verdict": verdict,
            "rule": "beyond noise when the two 95 % Wilson intervals do not overlap"}


def pool_times(rows: list[Mapping]) -> dict[str, dict[str, float]]:
    """Each pool's worker-seconds summed over the steps: ``{pool: {busy_s, waiting_s, idle_s, capacity_s,
    workers_max}}``; a pool's capacity is Σ workers × the step's wall (its driver figures)."""
    pools: dict[str, dict[str, float]] = {}
    for row in rows:
        for key in row:
            m = _POOL_KEY.match(key)
            value = _num(row, key)
            if m is None or value is None:
                continue
            pool = pools.setdefault(m.group(1), dict.fromkeys(("busy_s", "waiting_s", "idle_s", "capacity_s",
                                                               "workers_max"), 0.0))
            if m.group(2) == "workers":
                pool["workers_max"] = max(pool["workers_max"], value)
            else:
                pool[m.group(2)] += value
                pool["capacity_s"] += value
    return pools


def _wall(row: Mapping) -> float:
    """A step's wall seconds as its goodput figures measured it: the driver's parts (one worker)."""
    return sum(_num(row, f"time/driver_{part}") or 0.0 for part in ("busy_s", "waiting_s", "idle_s"))


def goodput(rows: list[Mapping]) -> dict:
    """Trained tokens over the steps' wall time and per core-second (``goodput/*``), and the pools' time."""
    steps = [r for r in rows if _num(r, "goodput/trained_tokens") is not None]
    tokens = _total(steps, "goodput/trained_tokens")
    wall = sum(_wall(r) for r in steps)
    core_s = sum((_num(r, "goodput/cores") or 0.0) * _wall(r) for r in steps)
    cores = sorted({c for r in steps if (c := _num(r, "goodput/cores")) is not None})
    return {"steps": len(steps), "trained_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else None,
            "tokens_per_core_s": tokens / core_s if core_s > 0 else None, "cores": cores, "pools": pool_times(steps)}


def warnings_seen(rows: list[Mapping]) -> tuple[dict[str, list[int]], dict]:
    """(health detector → steps it warned on, the guard's ``{"tripped": steps, "detectors": {name: steps},
    "rollbacks": n}``)."""
    health: dict[str, list[int]] = {}
    guard = {"tripped": [], "detectors": {}, "rollbacks": 0}
    for row in rows:
        step = int(row["step"])
        for key in row:
            m = _HEALTH_KEY.match(key)
            if m is not None and m.group(1) != "warnings" and _num(row, key):
                health.setdefault(m.group(1), []).append(step)
            if key.startswith("monitor/") and key not in _MONITOR_SKIP and "/" not in key[8:] and _num(row, key):
                guard["detectors"].setdefault(key[8:], []).append(step)
        if _num(row, "monitor/tripped"):
            guard["tripped"].append(step)
        guard["rollbacks"] = int(_num(row, "monitor/rollbacks") or guard["rollbacks"])
    return health, guard


def _holds_something(path: Path) -> bool:
    """A file, or a folder with at least one entry: an output that was written (an empty folder was only made)."""
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def build_summary(rows: list[Mapping], *, name: str, output_dir: str | Path, total_steps: int, wall_s: float,
                  steps_run: Iterable[int], stop_reason: str | None = None, accounting_s: float = 0.0,
                  checkpoint_dir: str | Path | None = None) -> dict:
    """The summary (module docstring) as a JSON-able dict.

    Args:
        rows: the run's ``metrics.jsonl`` records, in order. name: the job's name. output_dir: the run folder.
        total_steps: the spec's. wall_s: this process's wall seconds from the job's construction.
        steps_run: the steps this process ran (the "other" time is given only when it ran all of them).
        stop_reason: why the job stopped early (the guard), None when it ran to the end.
        accounting_s: seconds the goodput and health accounting took in this process.
        checkpoint_dir: where the checkpoints are (None: ``output_dir/checkpoints``).
    """
    train_rows = [r for r in rows if int(r["step"]) >= 1 and "policy_version" in r]
    phases = {p: _total(train_rows, f"timing/{p}_s") for p in PHASES}
    step_s, eval_s = _total(train_rows, "timing/step_s"), _total(rows, "eval/seconds")
    ran_all = sorted(steps_run) == sorted(int(r["step"]) for r in train_rows)
    health, guard = warnings_seen(rows)
    out = Path(output_dir)
    ckpt = Path(checkpoint_dir) if checkpoint_dir else out / "checkpoints"
    outputs = [{"path": str(out / rel), "what": what} for rel, what in OUTPUTS
               if _holds_something(out / rel) or rel in (SUMMARY_JSON, SUMMARY_TXT)]
    if saved := complete_checkpoints(ckpt):
        outputs.append({"path": str(ckpt), "what": f"checkpoints (HF folders: {len(saved)}, the newest "
                                                   f"{saved[-1].name}; `latest` names the newest)"})
    return {
        "name": name, "output_dir": str(out), "steps": len(train_rows), "total_steps": total_steps,
        "stopped_early": stop_reason, "held_out": held_out_change(rows),
        "time": {"phases_s": phases, "steps_s": step_s, "eval_s": eval_s, "wall_s": wall_s,
                 "other_s": wall_s - step_s - eval_s if ran_all else None},
        "goodput": {**goodput(train_rows), "accounting_s": accounting_s,
                    "accounting_share": accounting_s / step_s if step_s > 0 else None},
        "health_warnings": health, "guard": guard, "outputs": outputs,
    }


def _pct(x: float | None) -> str:
    """A fraction as a percentage: one decimal, or two significant digits below 1 % (0.04 %, 0.0013 %)."""
    if x is None:
        return "–"
    return f"{100 * x:.1f} %" if abs(x) >= 0.01 or x == 0 else f"{100 * x:.2g} %"


def _acc(p: dict) -> str:
    return f"{_pct(p['accuracy'])} [{_pct(p['ci_low'])}, {_pct(p['ci_high'])}] (n={p['n']:.0f}, step {p['step']})"


def _steps(steps: list[int]) -> str:
    return f"step{'s' if len(steps) > 1 else ''} " + ", ".join(str(s) for s in steps[:12]) + (
        f" (+{len(steps) - 12} more)" if len(steps) > 12 else "")


def summary_text(s: dict) -> str:
    """The summary as the lines printed at the end of a run."""
    lines = [f"[grpo-cluster] done: {s['steps']} steps of {s['total_steps']} ({s['name']})"
             + (f", stopped early: {s['stopped_early']}" if s["stopped_early"] else "")]
    h = s["held_out"]
    if h is None:
        lines.append("  held-out accuracy: no evaluation (add an eval section)")
    elif h["after"] is None:
        lines.append(f"  held-out accuracy: {_acc(h['before'])}; {h['verdict']}")
    else:
        lines.append(f"  held-out accuracy: {_acc(h['before'])} -> {_acc(h['after'])}: {h['verdict']} "
                     f"({h['rule']})")
    t = s["time"]
    phases = ", ".join(f"{p} {v:.0f} s" for p, v in t["phases_s"].items())
    other = f", other (start-up, checkpoints) {t['other_s']:.0f} s" if t["other_s"] is not None else ""
    lines.append(f"  time: {t['wall_s']:.0f} s in this process; steps {t['steps_s']:.0f} s ({phases}), "
                 f"evaluation {t['eval_s']:.0f} s{other}")
    lines += _goodput_lines(s["goodput"])
    warned = s["health_warnings"]
    lines.append("  health warnings: " + ("none" if not warned else "; ".join(
        f"{name} at {_steps(steps)}" for name, steps in warned.items())))
    g = s["guard"]
    lines.append("  guard: " + ("never tripped" if not g["tripped"] else f"tripped at {_steps(g['tripped'])} ("
                 + ", ".join(f"{d}: {_steps(st)}" for d, st in g["detectors"].items()) + ")")
                 + (f", {g['rollbacks']} rollback(s)" if g["rollbacks"] else ""))
    lines.append("  outputs:")
    lines += [f"    {o['path']}  {o['what']}" for o in s["outputs"]]
    lines.append(f"    picture: grpo-cluster plot {s['output_dir']}")
    lines.append(f"    page: grpo-cluster report {s['output_dir']}  (curves, held-out table, sample browser; one HTML "
                 f"file)")
    return "\n".join(lines)


def _goodput_lines(g: dict) -> list[str]:
    if not g["steps"]:
        return ["  goodput: no step recorded its time"]
    cores = "/".join(f"{c:g}" for c in g["cores"])
    per_core = f"{g['tokens_per_core_s']:.2f}" if g["tokens_per_core_s"] is not None else "–"
    lines = [f"  goodput: {g['trained_tokens']:.0f} trained tokens in {g['wall_s']:.0f} s of steps: "
             f"{g['tokens_per_s']:.2f} tokens/s, {per_core} per core-second ({cores} cores); accounting "
             f"{1000 * g['accounting_s']:.1f} ms ({_pct(g['accounting_share'])} of the steps)"]
    lines.append("  time by pool (share of workers x step wall): " + "; ".join(
        f"{pool} x{p['workers_max']:g} busy {_pct(p['busy_s'] / p['capacity_s'])} waiting "
        f"{_pct(p['waiting_s'] / p['capacity_s'])} idle {_pct(p['idle_s'] / p['capacity_s'])}"
        for pool, p in g["pools"].items() if p["capacity_s"] > 0))
    return lines


def write_summary(output_dir: str | Path, summary: dict) -> tuple[Path, Path]:
    """Write ``summary.json`` and ``summary.txt`` into ``output_dir``; returns their paths."""
    out = Path(output_dir)
    json_path, txt_path = out / SUMMARY_JSON, out / SUMMARY_TXT
    json_path.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    txt_path.write_text(summary_text(summary) + "\n", encoding="utf-8")
    return json_path, txt_path

"""The reward-hacking guard in the loop: feeds each step's metrics row to :class:`grpo.monitor.Monitor`, adds its
``monitor/*`` metrics to the row, and acts as ``monitor.action`` says (spec section :class:`cluster.spec.MonitorSpec`).

Metrics added to every row (only when the spec has an enabled ``monitor`` section): ``monitor/<detector>`` for each
enabled detector and ``monitor/tripped`` (1.0 on a step where any fired); with ``action: rollback`` also
``monitor/rollbacks`` (rollbacks so far) and ``monitor/reward_weight/<name>`` (each reward component's weight in use).

Actions on a tripped step (after its row is logged and its checkpoint, when due, written):

- ``warn``: one status line naming the detectors, their metrics' values and the estimated onset step.
- ``stop``: the job ends cleanly after the step. The *last good* checkpoint is marked: the newest complete checkpoint
  whose step is at most ``onset_step - 2``. Why ``- 2``: a step's row describes the policy that sampled it, the one
  trained up to the step before (checkpoint ``step_{s-1}``); the onset row ``O`` was sampled by ``step_{O-1}``, the
  first drifting policy, so the last policy that sampled only rows before the onset is ``step_{O-2}``. The mark is the
  file ``<checkpoint dir>/last_good`` holding the folder name (as ``latest`` does); the trip is recorded in
  ``<checkpoint dir>/guard.json``. ``--resume`` of such a job stops with exit 2 unless ``--resume-past-trip`` (or
  ``monitor.resume_past_trip: true``) is given: it then continues from the latest checkpoint, and the guard keeps
  watching (it acts again if its detectors still fire).
- ``rollback``: the last good checkpoint (as for stop) is restored by the resume machinery (the job's collaborators
  restarted from it: weights, optimizer, data position, controllers; engines start from its weights), checkpoints
  after it are renamed
  ``step_N.rollback<k>`` (kept, never resumed), the per-step logs are cut back to its step, the offending reward
  component's weight is multiplied by ``rollback_reward_scale``, and the run continues. The offending component is the
  watched shaping component (``monitor.shaping_rewards``, default every weighted one but ``verifiable_reward``) whose
  recent mean rose most above its baseline (same windows as the detectors). With no checkpoint at or before
  ``onset_step - 2``, or after ``max_rollbacks`` rollbacks, the guard stops as ``stop`` does.

The guard acts on the job only through :class:`GuardTarget` (stop, restore a checkpoint, change a reward weight).

Known limit: ``checkpoint.keep_last`` may prune the last good checkpoint before the trip; the guard then finds none
and stops (keep at least ``baseline_steps + window_steps`` checkpoints).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol

from cluster.loop.checkpoints import complete_checkpoints, write_atomic
from cluster.loop.setup import SetupError
from grpo.monitor import ENTROPY_KEY, EVAL_KEY, KL_KEY, LENGTH_KEY, TRIPPED_KEY, Monitor, MonitorConfig

#: Guard record in the checkpoint dir: trips, whether the guard stopped the job, rollbacks, reward weights in use.
GUARD_STATE = "guard.json"
#: Marker file in the checkpoint dir naming the last good checkpoint folder.
LAST_GOOD = "last_good"
ROLLBACKS_KEY = "monitor/rollbacks"
WEIGHT_PREFIX = "monitor/reward_weight/"
_DETECTOR_KEYS = {"length_drift": [LENGTH_KEY], "kl_band": [KL_KEY], "entropy_band": [ENTROPY_KEY],
                  "eval_drop": [EVAL_KEY]}


class GuardTarget(Protocol):
    """What the guard may do to a job (:class:`cluster.driver.GRPOJob` implements it).

    Attributes:
        step: the last finished step. metrics_path: the job's ``metrics.jsonl``.
    """

    step: int
    metrics_path: Path

    def request_stop(self, reason: str) -> None:
        """End the job cleanly after the running step."""
        ...

    def restore(self, path: Path) -> None:
        """Return the job to checkpoint ``path``: its collaborators restarted from it, its driver state, per-step
        logs and finished steps cut back to its step.

        Raises:
            SetupError: the checkpoint does not fit the job.
        """
        ...

    def set_reward_weight(self, name: str, weight: float) -> None:
        """Use ``weight`` for reward component ``name`` from the next step on."""
        ...


def monitor_config(spec) -> MonitorConfig:
    """The :class:`MonitorConfig` of a ``monitor`` spec section (the same fields)."""
    names = [f for f in MonitorConfig.__dataclass_fields__ if f != "samples_per_step"]
    return MonitorConfig(**{name: getattr(spec, name) for name in names})


def step_of(path: Path) -> int:
    """``step_000012`` → 12."""
    return int(path.name[len("step_"):])


def last_good_checkpoint(root: Path, onset_step: int) -> Path | None:
    """The newest complete checkpoint under ``root`` whose step is at most ``onset_step - 2`` (module docstring)."""
    good = [p for p in complete_checkpoints(root) if step_of(p) <= onset_step - 2]
    return good[-1] if good else None


def read_state(root: Path) -> dict:
    """``guard.json`` under ``root``, or an empty record when there is none.

    Raises:
        SetupError: the file exists but is not a guard record (not JSON, wrong types, a folder), naming the file.
    """
    path = Path(root) / GUARD_STATE
    if not path.exists():
        return {"trips": [], "stopped": False, "rollbacks": 0}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        problem = _state_problem(state)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        raise SetupError(f"{path}: not a reward-hacking guard record ({problem}); move it away to resume without "
                         f"the guard's history")
    return state


def _state_problem(state) -> str | None:
    """What makes ``state`` (parsed ``guard.json``) unusable, or None."""
    def number(x) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)

    if not isinstance(state, dict):
        return f"expected an object, got {type(state).__name__}"
    if not isinstance(state.get("stopped", False), bool):
        return f"'stopped': expected true or false, got {state['stopped']!r}"
    if not isinstance(state.get("rollbacks", 0), int) or isinstance(state.get("rollbacks", 0), bool):
        return f"'rollbacks': expected a whole number, got {state['rollbacks']!r}"
    trips = state.get("trips", [])
    trip_keys = {"step", "detectors", "onset_step"}
    if not isinstance(trips, list) or not all(isinstance(t, dict) and trip_keys <= set(t) for t in trips):
        return f"'trips': expected a list of objects with {sorted(trip_keys)}, got {trips!r:.200}"
    if state.get("stopped") and not trips:
        return "'stopped' is true but no trip is recorded"
    weights = state.get("reward_weights", {})
    if not isinstance(weights, dict) or not all(number(w) and w >= 0 for w in weights.values()):
        return f"'reward_weights': expected {{name: weight >= 0}}, got {weights!r:.200}"
    return None


def check_resume(root: Path, allowed: bool, clear: bool = False) -> None:
    """Refuse to resume a job the guard stopped unless ``allowed``; with ``clear`` an allowed resume marks the record
    as no longer stopped (a later restart resumes without asking again).

    Raises:
        SetupError: ``guard.json`` under ``root`` says the guard stopped the job and ``allowed`` is false.
    """
    state = read_state(root)
    if not state.get("stopped"):
        return
    if allowed:
        if clear:
            write_atomic(Path(root) / GUARD_STATE, json.dumps(state | {"stopped": False}, indent=2))
        return
    trip = state["trips"][-1]
    good = f"last good checkpoint {Path(root) / trip['last_good']}" if trip.get("last_good") else \
        "no checkpoint before the onset"
    raise SetupError(
        f"monitor: the reward-hacking guard stopped this job at step {trip['step']} ({', '.join(trip['detectors'])}"
        f" fired, onset about step {trip['onset_step']}; {good}); resuming would continue past the trip. Pass "
        f"--resume-past-trip (or set monitor.resume_past_trip: true) to continue anyway, or start a new run from "
        f"the last good checkpoint (model.path: that folder)")


def metric_rows(path: Path, max_step: int) -> list[dict]:
    """Rows of ``metrics.jsonl`` at ``path`` with ``step <= max_step``, in file order (missing file: none)."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if isinstance(r.get("step"), int) and r["step"] <= max_step]


class Guard:
    """The guard of one job.

    Args:
        spec: the enabled ``monitor`` spec section.
        root: the job's checkpoint dir (``guard.json``, ``last_good``).
        weights: the reward weights the job starts with (``algorithm.rewards``); the guard keeps its own copy and
            changes the job's through :meth:`GuardTarget.set_reward_weight`.
        status: prints a status line.
        resumed: the job resumes: the record in ``guard.json`` (rollbacks, weights) is taken over; call
            :meth:`apply_weights` to give the job the weights it records.
    """

    def __init__(self, spec, root: Path, weights: Mapping[str, float], status: Callable[[str], None],
                 resumed: bool = False):
        self.spec, self.root, self.weights, self.status = spec, Path(root), dict(weights), status
        self.state = read_state(self.root) if resumed else {"trips": [], "stopped": False, "rollbacks": 0}
        self.state["stopped"] = False
        saved = self.state.get("reward_weights", {})
        unknown = sorted(set(saved) - set(weights))
        if unknown:
            raise SetupError(f"{self.root / GUARD_STATE}: reward_weights {unknown} are not in algorithm.rewards "
                             f"{sorted(weights)}; the spec's rewards changed since the guard wrote it")
        self.weights.update(saved)
        self.monitor = Monitor(monitor_config(spec))
        self.rows: dict[int, dict] = {}

    def apply_weights(self, target: GuardTarget) -> None:
        """Give ``target`` the reward weights in use (those ``guard.json`` records after a rollback)."""
        for name, weight in self.weights.items():
            target.set_reward_weight(name, weight)

    def replay(self, rows: Iterable[dict]) -> None:
        """Feed earlier rows (``metrics.jsonl`` rows with their ``step``) to a fresh monitor without acting."""
        self.monitor, self.rows = Monitor(monitor_config(self.spec)), {}
        for row in rows:
            step = row["step"]
            self._update(step, {k: v for k, v in row.items() if k != "step"})

    def _update(self, step: int, row: dict) -> dict[str, float]:
        clean = {k: v for k, v in row.items() if not k.startswith("monitor/")}
        self.rows[step] = clean
        return self.monitor.update(step, clean)

    def observe(self, step: int, row: dict) -> bool:
        """Feed step ``step``'s row and add the ``monitor/*`` metrics to it. Returns whether a detector fired."""
        out = self._update(step, row)
        row.update(out)
        if self.spec.action == "rollback":
            row[ROLLBACKS_KEY] = float(self.state["rollbacks"])
            row.update({f"{WEIGHT_PREFIX}{name}": float(w) for name, w in self.weights.items()})
        return out[TRIPPED_KEY] == 1.0

    def fired(self, row: dict) -> list[str]:
        """Detectors that fired on ``row`` (its ``monitor/<detector>`` values)."""
        return [d for d in self.spec.detectors if row.get(f"monitor/{d}") == 1.0]

    def describe(self, step: int, row: dict) -> str:
        """Status line: the detectors that fired, their metrics' values, the estimated onset."""
        values = []
        for detector in self.fired(row):
            keys = _DETECTOR_KEYS.get(detector) or [f"reward/{n}" for n in self.shaping()]
            values += [f"{k}={row[k]:.4g}" for k in keys if isinstance(row.get(k), int | float)]
        trip = self.monitor.first_trip
        onset = f"onset about step {trip.onset_step}" if trip is not None else "onset unknown"
        return (f"monitor: step {step}: reward hacking suspected: {', '.join(self.fired(row))} fired "
                f"({', '.join(values) or 'no value'}); {onset}")

    def shaping(self) -> list[str]:
        """The watched shaping reward components."""
        if self.spec.shaping_rewards is not None:
            return list(self.spec.shaping_rewards)
        return sorted(n for n in self.weights if n != self.spec.verifiable_reward)

    def offending_reward(self) -> str | None:
        """The watched shaping component whose recent mean rose most above its baseline (None: none watched)."""
        rises = {}
        for name in self.shaping():
            series = [v for _, r in sorted(self.rows.items())
                      if isinstance(v := r.get(f"reward/{name}"), int | float) and math.isfinite(v)]  # NaN: scored none
            base, after = series[:self.spec.baseline_steps], series[self.spec.baseline_steps:]
            if base and after:
                recent = after[-self.spec.window_steps:]
                rises[name] = sum(recent) / len(recent) - sum(base) / len(base)
        return max(rises, key=rises.get) if rises else None

    def act(self, target: GuardTarget, step: int, row: dict) -> None:
        """Act on the tripped step ``step`` (row already logged): warn, stop (:meth:`GuardTarget.request_stop`), or
        roll back (:meth:`GuardTarget.restore`, with the offending reward's weight reduced) and go on."""
        self.status(self.describe(step, row))
        if self.spec.action == "warn":
            return
        trip = self.monitor.first_trip
        good = last_good_checkpoint(self.root, trip.onset_step)
        record = {"step": step, "onset_step": trip.onset_step, "detectors": list(trip.detectors),
                  "last_good": good.name if good is not None else None, "action": self.spec.action}
        if good is not None:
            write_atomic(self.root / LAST_GOOD, good.name)
        if self.spec.action == "rollback" and good is not None and self.state["rollbacks"] < self.spec.max_rollbacks:
            self._rollback(target, good, record)
            return
        why = ""
        if self.spec.action == "rollback":
            why = (f"; cannot roll back: no checkpoint at or before step {trip.onset_step - 2}" if good is None
                   else f"; {self.spec.max_rollbacks} rollback(s) used")
        self._save(record | {"action": "stop"}, stopped=True)
        message = (f"monitor: stopping after step {step}{why}; last good checkpoint: "
                   f"{good if good is not None else 'none before the onset'}")
        self.status(message)
        target.request_stop(message)

    def _rollback(self, target: GuardTarget, good: Path, record: dict) -> None:
        self.state["rollbacks"] += 1
        n = self.state["rollbacks"]
        offending = self.offending_reward()
        if offending is not None:
            self.weights[offending] *= self.spec.rollback_reward_scale
        self._save(record | {"reduced": offending}, stopped=False)
        for later in complete_checkpoints(self.root):
            if step_of(later) > step_of(good):
                os.replace(later, later.with_name(f"{later.name}.rollback{n}"))
        write_atomic(self.root / "latest", good.name)
        self.status(f"monitor: rollback {n}/{self.spec.max_rollbacks} to {good}; reward weights now "
                    f"{self.weights} ({offending or 'no shaping component'} reduced)")
        target.restore(good)
        if target.step != step_of(good):
            raise SetupError(f"monitor: checkpoint {good} holds step {target.step}, expected {step_of(good)}")
        self.apply_weights(target)
        self.replay(metric_rows(target.metrics_path, target.step))

    def _save(self, record: dict, stopped: bool) -> None:
        self.state["trips"].append(record)
        self.state.update(stopped=stopped, reward_weights=dict(self.weights))
        write_atomic(self.root / GUARD_STATE, json.dumps(self.state, indent=2))


def build_guard(spec, root: Path, weights: Mapping[str, float], status: Callable[[str], None],
                resumed_at: int | None, metrics_path: Path) -> Guard | None:
    """The guard of a job (its step logs open), or None when ``spec`` (the ``monitor`` section) is absent or
    disabled. ``resumed_at``: the step a resumed job continues from (None: a fresh start); a resumed job's guard takes
    over ``guard.json`` under ``root`` and replays ``metrics_path`` up to that step, so its windows are those of the
    run so far (the caller then applies its recorded weights, :meth:`Guard.apply_weights`)."""
    if spec is None or not spec.enabled:
        return None
    guard = Guard(spec, root, weights, status, resumed=resumed_at is not None)
    if resumed_at is not None:
        guard.replay(metric_rows(metrics_path, resumed_at))
    return guard

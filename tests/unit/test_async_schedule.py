"""``rollout.mode: async`` (``cluster.loop.overlap.AsyncSchedule``) with scripted generate/train/sync callables: the
producer's queue bound and the staleness it gives, stale heads dropped and counted, the sync at a generation
boundary, errors, deferral and discard — no Ray, no engine, no trainer. Order is forced with events and conditions
(bounded waits), never with sleeps."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from cluster.loop.overlap import AsyncSchedule, make_schedule


class Trace:
    """Stand-in engines and trainer: ``generate(k)`` returns ``(k, engine version)``; ``train`` raises the trainer's
    version by ``jumps.get(step, 1)`` and returns (step, staleness); ``sync`` gives the engines the trainer's version.
    ``wait_queued(n)`` (for ``train``) blocks until the schedule holds ``n`` queued batches."""

    def __init__(self, jumps: dict[int, int] | None = None):
        self.events: list[str] = []
        self.cond = threading.Condition()
        self.trainer_version = self.engine_version = 0
        self.jumps = jumps or {}
        self.dropped: list[list] = []
        self.threads: set[str] = set()
        self.schedule: AsyncSchedule | None = None

    def log(self, event: str) -> None:
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def generate(self, step: int):
        self.threads.add(threading.current_thread().name)
        self.log(f"gen{step}+")
        batch = (step, self.engine_version)
        self.log(f"gen{step}-")
        return batch

    def train(self, batch):
        step, sampled_with = batch
        self.log(f"train{step}+")
        staleness = self.trainer_version - sampled_with
        self.trainer_version += self.jumps.get(step, 1)
        self.log(f"train{step}-")
        return step, staleness

    def sync(self, trained):
        self.log(f"sync{trained[0]}")
        self.engine_version = self.trainer_version
        return self.engine_version

    def wait_queued(self, n: int) -> None:
        """Poll (every 5 ms, at most 10 s: a batch is queued just after its generate call returns, with no event to
        wait on) until ``n`` batches are queued."""
        for _ in range(2000):
            if len(self.schedule.queued) >= n:
                return
            with self.cond:
                self.cond.wait(0.005)
        raise AssertionError(f"the producer never queued {n} batches: {self.events}")

    def wait_event(self, event: str) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: event in self.events, timeout=10), f"no {event!r}: {self.events}"

    def build(self, k: int, train=None, generate=None, last_step=None, deferrable=()) -> AsyncSchedule:
        self.schedule = AsyncSchedule(generate or self.generate, train or self.train, self.sync, max_staleness=k,
                                      version=lambda: self.trainer_version, batch_version=lambda b: b[1],
                                      drop=self.dropped.append, last_step=last_step, deferrable=deferrable)
        return self.schedule


def _filling_train(t: Trace, k: int, steps: int):
    """A train that ends only once the producer has filled the queue (k batches, fewer near the run's end), so the
    run is deterministic: the producer always gets as far as the bound lets it."""
    def train(batch):
        t.wait_queued(min(k, steps - batch[0]))
        return t.train(batch)
    return train


@pytest.mark.parametrize("k", [1, 2, 3])
def test_async_producer_stays_within_max_staleness(k):
    t, steps = Trace(), 7
    schedule = t.build(k, train=_filling_train(t, k, steps), last_step=steps)
    outcomes = [schedule.step(s) for s in range(1, steps + 1)]
    staleness = [o.trained[1] for o in outcomes]
    assert max(staleness) == k and all(0 <= s <= k for s in staleness)
    assert staleness[0] == 0 and not outcomes[0].prefetched and all(o.prefetched for o in outcomes[1:])
    # the producer ran ahead as far as the bound allows: batch s (s > k) was sampled by version s - 1 - k
    assert [o.batch[1] for o in outcomes] == [max(0, s - 1 - k) for s in range(1, steps + 1)]
    assert t.events.count("gen8+") == 0 and schedule.queued == []  # nothing past last_step
    assert [t.events.count(f"gen{s}+") for s in range(1, steps + 1)] == [1] * steps  # each batch generated once
    assert all(o.dropped == [] for o in outcomes) and t.dropped == []
    assert any(name.startswith("async-producer-1") for name in t.threads)


def test_async_stale_head_is_dropped_with_the_queue_counted_and_generated_again():
    """The trainer jumps 3 versions at step 1 (k = 2): batches 2 and 3, sampled by version 0, are now 3 behind; both
    are dropped and told to ``drop`` (oldest first), and step 2 generates its batch itself on the synced weights."""
    k, steps = 2, 4
    t = Trace(jumps={1: 3})
    schedule = t.build(k, train=_filling_train(t, k, steps), last_step=steps)
    first = schedule.step(1)
    assert schedule.queued == [(2, 0), (3, 0)] and first.queued == 2
    second = schedule.step(2)
    assert second.dropped == [(2, 0), (3, 0)] and t.dropped == [[(2, 0), (3, 0)]]
    assert not second.prefetched and second.batch == (2, 3) and second.trained[1] == 0
    rest = [schedule.step(s) for s in (3, 4)]
    assert [o.batch for o in rest] == [(3, 3), (4, 3)] and all(o.dropped == [] for o in rest)
    assert [o.trained[1] for o in rest] == [1, 2]


def test_async_sync_waits_for_the_generate_call_in_flight():
    """Weight sync at a generation boundary: train 1 ends while generate 2 is running; the sync comes after it."""
    t = Trace()
    train_ended = threading.Event()

    def generate(step):
        if step == 2:
            t.log("gen2 called")
            assert train_ended.wait(10), "train 1 never ended"
        return t.generate(step)

    def train(batch):
        if batch[0] == 1:
            t.wait_event("gen2 called")
        out = t.train(batch)
        train_ended.set()
        return out

    schedule = t.build(3, train=train, generate=generate)
    out = schedule.step(1)
    e = t.events
    assert e.index("gen2 called") < e.index("train1-") < e.index("gen2-") < e.index("sync1")
    started = [int(x[3:-1]) for x in e if x.startswith("gen") and x.endswith("+")]
    assert all(e.index(f"gen{s}-") < e.index("sync1") for s in started)  # every call started ended before the sync
    assert out.queued == len(started) - 1  # step 1's own batch was not queued


def test_async_generate_error_is_raised_after_train_and_nothing_stays_queued():
    t = Trace()

    def generate(step):
        if step == 3:
            t.log("gen3 failing")
            raise RuntimeError("engine exploded")
        return t.generate(step)

    def train(batch):
        t.wait_event("gen3 failing")
        return t.train(batch)

    schedule = t.build(3, train=train, generate=generate)
    with pytest.raises(RuntimeError, match="engine exploded"):
        schedule.step(1)
    assert "train1-" in t.events and "sync1" not in t.events and schedule.queued == []
    assert not any(th.name.startswith("async-producer") for th in threading.enumerate())


def test_async_train_error_waits_for_the_producer_and_chains_its_error():
    t = Trace()
    released = threading.Event()

    def generate(step):
        if step == 2:
            assert released.wait(10)
            raise ValueError("generate failed too")
        return t.generate(step)

    def train(batch):
        released.set()
        raise RuntimeError("rank 1 died")

    schedule = t.build(2, train=train, generate=generate)
    with pytest.raises(RuntimeError, match="rank 1 died") as info:
        schedule.step(1)
    assert isinstance(info.value.__context__, ValueError)
    assert "sync1" not in t.events and schedule.queued == []
    assert not any(th.name.startswith("async-producer") for th in threading.enumerate())


def test_async_deferrable_producer_error_keeps_the_queued_batches():
    class Deferred(RuntimeError):
        pass

    t, fail = Trace(), {3}

    def generate(step):
        if step in fail:
            fail.discard(step)
            t.log(f"gen{step} deferred")
            raise Deferred("engine died during the overlap")
        return t.generate(step)

    def train(batch):
        if batch[0] == 1:
            t.wait_event("gen3 deferred")
        return t.train(batch)

    schedule = t.build(3, train=train, generate=generate, deferrable=(Deferred,))
    first = schedule.step(1)
    assert first.prefetch_deferred and schedule.queued == [(2, 0)] and "sync1" in t.events
    second = schedule.step(2, prefetch_next=False)
    assert second.prefetched and second.batch == (2, 0) and not second.prefetch_deferred
    third = schedule.step(3, prefetch_next=False)  # nothing queued: generated on the synced weights
    assert not third.prefetched and third.batch == (3, 2)


def test_async_discard_on_stop_and_a_head_for_another_step_is_refused():
    t = Trace()
    filling = _filling_train(t, 2, 3)
    schedule = t.build(2, train=lambda batch: filling(batch) if batch[0] == 1 else t.train(batch))
    schedule.step(1)
    events = list(t.events)
    with pytest.raises(ValueError, match="step 5: the queued head was generated for step 2; discard"):
        schedule.step(5)
    assert t.events == events and schedule.queued == [(2, 0), (3, 0)]
    assert schedule.discard() == [(2, 0), (3, 0)] and schedule.queued == [] and schedule.pending is None
    assert t.dropped == []  # a discard is the caller's (it rewinds the data position itself)
    assert schedule.step(5, prefetch_next=False).batch == (5, 1)


def test_async_needs_max_staleness_1_and_is_made_by_mode():
    t = Trace()
    with pytest.raises(ValueError, match="rollout.max_staleness: mode 'async' needs >= 1, got 0"):
        t.build(0)
    schedule = make_schedule("async", t.generate, t.train, t.sync, max_staleness=1, version=lambda: 0,
                             batch_version=lambda b: b[1], drop=t.dropped.append)
    assert isinstance(schedule, AsyncSchedule) and schedule.mode == "async"


def test_async_bench_stand_ins_long_tail_staleness_within_bound():
    """bench/bench_async.py's async row drives the same schedule: staleness 1..k over a long-tail of scripted
    generate seconds (the same seeded durations in every mode, mean as asked)."""
    from bench.bench_async import long_tail_durations, measure

    durations = long_tail_durations(0.01, 12, sigma=1.0)
    assert abs(sum(durations) / 12 - 0.01) < 1e-12 and durations == long_tail_durations(0.01, 12, sigma=1.0)
    assert max(durations) > 2 * min(durations)  # a tail, not a constant
    result = measure("async", durations.__getitem__, 0.0, 0.0, 8, max_staleness=2)
    assert set(result["staleness"]) <= {1, 2} and len(result["staleness"]) == 8


def test_queued_can_be_read_while_the_producer_appends():
    """``queued`` (read by whoever watches the queue while a step trains, as these tests' ``wait_queued`` do) is a
    snapshot: iterating the deque itself while the producer appends raised 'deque mutated during iteration'. Thread
    switches are forced every microsecond so the reads interleave with the appends."""
    k, errors, reads = 1000, [], []

    def train(batch):
        while len(reads) < 100_000:
            try:
                reads.append(len(schedule.queued))
            except RuntimeError as exc:
                errors.append(exc)
                break
            if reads[-1] >= k:
                break
        return batch

    def generate(step):
        time.sleep(0)  # yields the GIL (no timing): the reader runs between appends
        return step

    schedule = AsyncSchedule(generate, train, lambda trained: trained, max_staleness=k, version=lambda: 0,
                             batch_version=lambda batch: 0, drop=lambda batches: None)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        schedule.step(1)
    finally:
        sys.setswitchinterval(interval)
    assert errors == [] and reads[-1] >= 1 and len(schedule.queued) <= k

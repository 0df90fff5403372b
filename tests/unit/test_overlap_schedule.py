"""``rollout.mode`` schedules (``cluster.loop.overlap``) with scripted generate/train/sync callables: event order, the
producer's queue bound and the staleness it gives, stale heads dropped and counted, the sync at a generation boundary,
errors, deferral, discard and threads — no Ray, no engine, no trainer. ``one_step_off`` is ``AsyncSchedule`` with
``max_staleness`` 1, so most tests run for it and for ``async`` with k = 1..3 (their ids carry the mode, so
``pytest -k one_step_off`` and ``-k async`` select them). Order is forced with events and conditions (bounded waits),
never with sleeps."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from cluster.loop.overlap import AsyncSchedule, SyncSchedule, make_schedule

#: (rollout.mode, max_staleness k): one_step_off is k = 1 by construction.
MODES = [pytest.param("one_step_off", 1, id="one_step_off"), pytest.param("async", 1, id="async-k1"),
         pytest.param("async", 2, id="async-k2"), pytest.param("async", 3, id="async-k3")]


def producer_prefix(mode: str) -> str:
    """The name prefix of the producer threads of ``mode`` (``async-producer``, ``one-step-off-producer``)."""
    return f"{mode.replace('_', '-')}-producer"


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

    def build(self, mode: str, k: int, train=None, generate=None, last_step=None, deferrable=()) -> AsyncSchedule:
        """The schedule of ``mode`` as the driver builds it (``make_schedule``; one_step_off ignores ``k``)."""
        self.schedule = make_schedule(mode, generate or self.generate, train or self.train, self.sync,
                                      deferrable=deferrable, max_staleness=k, version=lambda: self.trainer_version,
                                      batch_version=lambda b: b[1], drop=self.dropped.append, last_step=last_step)
        return self.schedule


def _filling_train(t: Trace, k: int, steps: int):
    """A train that ends only once the producer has filled the queue (k batches, fewer near the run's end), so the
    run is deterministic: the producer always gets as far as the bound lets it."""
    def train(batch):
        t.wait_queued(min(k, steps - batch[0]))
        return t.train(batch)
    return train


def test_sync_schedule_one_step_off_baseline_order_and_staleness_0():
    t = Trace()
    outcomes = [SyncSchedule(t.generate, t.train, t.sync).step(k, prefetch_next=True) for k in (1, 2, 3)]
    assert t.events == [e for k in (1, 2, 3) for e in (f"gen{k}+", f"gen{k}-", f"train{k}+", f"train{k}-", f"sync{k}")]
    assert [o.trained[1] for o in outcomes] == [0, 0, 0]  # on-policy
    assert [o.prefetched for o in outcomes] == [False] * 3


@pytest.mark.parametrize("mode,k", MODES)
def test_producer_stays_within_max_staleness(mode, k):
    """one_step_off: staleness 0 then exactly 1; async: up to k, the producer running as far ahead as k allows."""
    t, steps = Trace(), 7
    schedule = t.build(mode, k, train=_filling_train(t, k, steps), last_step=steps)
    outcomes = [schedule.step(s, prefetch_next=s < steps) for s in range(1, steps + 1)]
    staleness = [o.trained[1] for o in outcomes]
    assert staleness == [0] + [min(s - 1, k) for s in range(2, steps + 1)]
    assert not outcomes[0].prefetched and all(o.prefetched for o in outcomes[1:])
    # the producer ran ahead as far as the bound allows: batch s (s > k) was sampled by version s - 1 - k
    assert [o.batch[1] for o in outcomes] == [max(0, s - 1 - k) for s in range(1, steps + 1)]
    assert [o.synced for o in outcomes] == list(range(1, steps + 1))
    assert t.events.count("gen8+") == 0 and schedule.queued == [] and schedule.pending is None  # nothing past the end
    assert [t.events.count(f"gen{s}+") for s in range(1, steps + 1)] == [1] * steps  # each batch generated once
    assert all(o.dropped == [] for o in outcomes) and t.dropped == []
    assert any(name.startswith(f"{producer_prefix(mode)}-1") for name in t.threads)
    assert schedule.mode == mode and schedule.max_staleness == k


@pytest.mark.parametrize("mode,k", MODES)
def test_first_producer_call_starts_however_soon_train_ends(mode, k):
    """With an instant train every step after the first still trains a prefetched batch: the producer's first call
    of a step always starts (what is prefetched does not depend on thread timing). one_step_off: exactly the batches
    (step, version step - 2) after the first, staleness 1."""
    t, steps = Trace(), 4
    schedule = t.build(mode, k, last_step=steps)
    outcomes = [schedule.step(s, prefetch_next=s < steps) for s in range(1, steps + 1)]
    assert [o.prefetched for o in outcomes] == [False, True, True, True]
    assert all(1 <= o.trained[1] <= k for o in outcomes[1:])
    if mode == "one_step_off":
        assert [o.batch for o in outcomes] == [(1, 0), (2, 0), (3, 1), (4, 2)]  # (step, version that sampled it)
        assert [o.trained[1] for o in outcomes] == [0, 1, 1, 1]
    assert schedule.pending is None and t.events.count(f"gen{steps + 1}+") == 0


@pytest.mark.parametrize("mode,k", MODES)
def test_next_batch_generated_while_training_and_sync_waits_for_the_call_in_flight(mode, k):
    """Weight sync at a generation boundary: generate 2 starts while train 1 runs (train 1 waits for it) and is held
    until train 1 has ended; the sync comes after it, and after every other call that started."""
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

    schedule = t.build(mode, k, train=train, generate=generate)
    out = schedule.step(1, prefetch_next=True)
    e = t.events
    assert e.index("gen2 called") < e.index("train1-") < e.index("gen2-") < e.index("sync1") and e[-1] == "sync1"
    started = [int(x[3:-1]) for x in e if x.startswith("gen") and x.endswith("+")]
    assert all(e.index(f"gen{s}-") < e.index("sync1") for s in started)  # every call started ended before the sync
    assert out.queued == len(started) - 1 <= k  # step 1's own batch was not queued
    if mode == "one_step_off":
        assert started == [1, 2] and schedule.pending == (2, 0) and schedule.queued == [(2, 0)]
    assert any(name.startswith(f"{producer_prefix(mode)}-1") for name in t.threads)


def _failing_step(k: int) -> int:
    """A producer call that happens in step 1 of a k-bounded schedule (the second one for k >= 2)."""
    return min(k, 2) + 1


@pytest.mark.parametrize("mode,k", MODES)
def test_generate_error_is_raised_after_train_and_nothing_stays_queued(mode, k):
    t, fail = Trace(), _failing_step(k)

    def generate(step):
        if step == fail:
            t.log(f"gen{step} failing")
            raise RuntimeError("engine exploded")
        return t.generate(step)

    def train(batch):
        t.wait_event(f"gen{fail} failing")
        return t.train(batch)

    before = threading.active_count()
    schedule = t.build(mode, k, train=train, generate=generate)
    with pytest.raises(RuntimeError, match="engine exploded"):
        schedule.step(1, prefetch_next=True)
    assert "train1-" in t.events and "sync1" not in t.events  # train finished; nothing synced
    assert schedule.queued == [] and schedule.pending is None
    assert threading.active_count() == before
    assert not any(th.name.startswith(producer_prefix(mode)) for th in threading.enumerate())


@pytest.mark.parametrize("mode,k", MODES)
def test_train_error_waits_for_the_producer_and_chains_its_error(mode, k):
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

    schedule = t.build(mode, k, train=train, generate=generate)
    with pytest.raises(RuntimeError, match="rank 1 died") as info:
        schedule.step(1, prefetch_next=True)
    assert isinstance(info.value.__context__, ValueError)
    assert "sync1" not in t.events and schedule.queued == [] and schedule.pending is None
    assert not any(th.name.startswith(producer_prefix(mode)) for th in threading.enumerate())


@pytest.mark.parametrize("mode,k", MODES)
def test_deferrable_producer_error_keeps_the_queued_batches(mode, k):
    """A deferred producer call stops the producer for the step: what was queued before it stays (nothing in
    one_step_off), the step trains and syncs, and the deferred step generates its batch itself after the sync."""
    class Deferred(RuntimeError):
        pass

    t = Trace()
    fail = {_failing_step(k)}
    last = _failing_step(k)

    def generate(step):
        if step in fail:
            fail.discard(step)
            t.log(f"gen{step} deferred")
            raise Deferred("engine died during the overlap")
        return t.generate(step)

    def train(batch):
        if batch[0] == 1:
            t.wait_event(f"gen{last} deferred")
        return t.train(batch)

    schedule = t.build(mode, k, train=train, generate=generate, deferrable=(Deferred,))
    first = schedule.step(1, prefetch_next=True)
    assert first.prefetch_deferred and "sync1" in t.events
    assert schedule.queued == [(s, 0) for s in range(2, last)]
    for s in range(2, last):  # queued before the deferral: trained as prefetched
        out = schedule.step(s, prefetch_next=False)
        assert out.prefetched and out.batch == (s, 0) and not out.prefetch_deferred
    out = schedule.step(last, prefetch_next=False)  # nothing queued: generated on the synced weights, on-policy
    assert not out.prefetched and out.batch == (last, last - 1) and out.trained[1] == 0


@pytest.mark.parametrize("mode,k", MODES)
def test_discard_on_stop_and_a_head_for_another_step_is_refused(mode, k):
    # a queued batch silently replaced would drop its prompts unseen (the data position has moved past them)
    t = Trace()
    filling = _filling_train(t, k, k + 1)
    schedule = t.build(mode, k, train=lambda batch: filling(batch) if batch[0] == 1 else t.train(batch))
    schedule.step(1, prefetch_next=True)
    events, queued = list(t.events), [(s, 0) for s in range(2, k + 2)]
    with pytest.raises(ValueError, match="step 5: the queued head was generated for step 2; discard"):
        schedule.step(5)
    assert t.events == events and schedule.queued == queued and schedule.pending == (2, 0)  # nothing ran
    assert schedule.discard() == queued and schedule.queued == [] and schedule.pending is None
    assert t.dropped == []  # a discard is the caller's (it rewinds the data position itself)
    out = schedule.step(5, prefetch_next=False)  # generated again, on the synced weights
    assert out.batch == (5, 1) and not out.prefetched


def test_async_stale_head_is_dropped_with_the_queue_counted_and_generated_again():
    """The trainer jumps 3 versions at step 1 (k = 2): batches 2 and 3, sampled by version 0, are now 3 behind; both
    are dropped and told to ``drop`` (oldest first), and step 2 generates its batch itself on the synced weights."""
    k, steps = 2, 4
    t = Trace(jumps={1: 3})
    schedule = t.build("async", k, train=_filling_train(t, k, steps), last_step=steps)
    first = schedule.step(1)
    assert schedule.queued == [(2, 0), (3, 0)] and first.queued == 2
    second = schedule.step(2)
    assert second.dropped == [(2, 0), (3, 0)] and t.dropped == [[(2, 0), (3, 0)]]
    assert not second.prefetched and second.batch == (2, 3) and second.trained[1] == 0
    rest = [schedule.step(s) for s in (3, 4)]
    assert [o.batch for o in rest] == [(3, 3), (4, 3)] and all(o.dropped == [] for o in rest)
    assert [o.trained[1] for o in rest] == [1, 2]


def test_one_step_off_is_async_with_max_staleness_1_made_by_mode():
    """make_schedule('one_step_off') is an AsyncSchedule whose mode is one_step_off and k = 1 whatever the spec's
    max_staleness; without version/batch_version/drop it skips the staleness check (one version per step keeps 1)."""
    t = Trace()
    assert isinstance(make_schedule("sync", t.generate, t.train, t.sync), SyncSchedule)
    off = make_schedule("one_step_off", t.generate, t.train, t.sync, max_staleness=4)
    assert isinstance(off, AsyncSchedule) and off.mode == "one_step_off" and off.max_staleness == 1
    assert off.version is None and off.step(1).trained == (1, 0) and off.step(2, prefetch_next=False).prefetched
    with pytest.raises(ValueError, match="mode 'one_step_off' is async with max_staleness 1, got max_staleness 2"):
        AsyncSchedule(t.generate, t.train, t.sync, max_staleness=2, mode="one_step_off")
    with pytest.raises(ValueError, match="rollout.mode: expected one of .* got 'partial'"):
        make_schedule("partial", t.generate, t.train, t.sync)


def test_async_needs_max_staleness_1_and_is_made_by_mode():
    t = Trace()
    with pytest.raises(ValueError, match="rollout.max_staleness: mode 'async' needs >= 1, got 0"):
        t.build("async", 0)
    with pytest.raises(ValueError, match="give all of version, batch_version and drop"):
        AsyncSchedule(t.generate, t.train, t.sync, max_staleness=1, version=lambda: 0)
    with pytest.raises(ValueError, match="expected mode 'async' or 'one_step_off', got 'sync'"):
        AsyncSchedule(t.generate, t.train, t.sync, max_staleness=1, mode="sync")
    schedule = make_schedule("async", t.generate, t.train, t.sync, max_staleness=3, version=lambda: 0,
                             batch_version=lambda b: b[1], drop=t.dropped.append)
    assert isinstance(schedule, AsyncSchedule) and schedule.mode == "async" and schedule.max_staleness == 3


def test_async_queued_can_be_read_while_the_producer_appends():
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


def test_one_step_off_bench_stand_ins_report_staleness_and_overlap():
    """bench/bench_async.py drives the same schedules: staleness 0 in sync, 1 in one_step_off; with 0.3 s generate
    and 0.3 s train a one_step_off step (about 0.3 s: the two overlap) takes well under a sync step (their 0.6 s sum)
    measured in the same sitting, so a loaded machine, which lengthens both, does not decide the outcome."""
    from bench.bench_async import measure

    assert measure("sync", 0.0, 0.0, 0.0, 3)["staleness"] == [0, 0, 0]
    assert measure("one_step_off", 0.0, 0.0, 0.0, 3)["staleness"] == [1, 1, 1]
    sync, off = measure("sync", 0.3, 0.3, 0.0, 2)["step_s"], measure("one_step_off", 0.3, 0.3, 0.0, 2)["step_s"]
    assert off < 0.75 * sync, (off, sync)


def test_async_bench_stand_ins_long_tail_staleness_within_bound():
    """bench/bench_async.py's async row drives the same schedule: staleness 1..k over a long-tail of scripted
    generate seconds (the same seeded durations in every mode, mean as asked)."""
    from bench.bench_async import long_tail_durations, measure

    durations = long_tail_durations(0.01, 12, sigma=1.0)
    assert abs(sum(durations) / 12 - 0.01) < 1e-12 and durations == long_tail_durations(0.01, 12, sigma=1.0)
    assert max(durations) > 2 * min(durations)  # a tail, not a constant
    result = measure("async", durations.__getitem__, 0.0, 0.0, 8, max_staleness=2)
    assert set(result["staleness"]) <= {1, 2} and len(result["staleness"]) == 8

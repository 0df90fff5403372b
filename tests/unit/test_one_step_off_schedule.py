"""``rollout.mode`` schedules (``cluster.loop.overlap``) with stand-in generate/train/sync callables: event order,
staleness, errors and threads — no Ray, no engine, no trainer. Order is checked with events (``threading.Event``),
never with sleeps."""

from __future__ import annotations

import threading

import pytest

from cluster.loop.overlap import OneStepOffSchedule, SyncSchedule, make_schedule


class Trace:
    """Stand-in engines and trainer over a policy version counter: ``generate(k)`` returns ``(k, version)``,
    ``train`` checks nothing and returns the version after the update, ``sync`` publishes it to the "engines"."""

    def __init__(self):
        self.events: list[str] = []
        self.lock = threading.Lock()
        self.trainer_version = 0  # the trainer's policy version
        self.engine_version = 0  # the version the stand-in engines sample with
        self.threads: set[str] = set()

    def log(self, event: str) -> None:
        with self.lock:
            self.events.append(event)

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
        self.trainer_version += 1
        self.log(f"train{step}-")
        return step, staleness

    def sync(self, trained):
        self.log(f"sync{trained[0]}")
        self.engine_version = self.trainer_version
        return self.engine_version


def run(schedule, steps: int) -> list:
    return [schedule.step(k, prefetch_next=k < steps) for k in range(1, steps + 1)]


def test_sync_schedule_one_step_off_baseline_order_and_staleness_0():
    t = Trace()
    outcomes = run(SyncSchedule(t.generate, t.train, t.sync), 3)
    assert t.events == [e for k in (1, 2, 3) for e in (f"gen{k}+", f"gen{k}-", f"train{k}+", f"train{k}-", f"sync{k}")]
    assert [o.trained[1] for o in outcomes] == [0, 0, 0]  # on-policy
    assert [o.prefetched for o in outcomes] == [False] * 3


def test_one_step_off_staleness_is_1_after_the_first_step():
    t = Trace()
    schedule = OneStepOffSchedule(t.generate, t.train, t.sync)
    outcomes = run(schedule, 4)
    assert [o.batch for o in outcomes] == [(1, 0), (2, 0), (3, 1), (4, 2)]  # (step, version that sampled it)
    assert [o.trained[1] for o in outcomes] == [0, 1, 1, 1]
    assert [o.prefetched for o in outcomes] == [False, True, True, True]
    assert [o.synced for o in outcomes] == [1, 2, 3, 4]
    assert schedule.pending is None  # the last step prefetches nothing
    assert t.events.count("gen5+") == 0


def test_one_step_off_generate_next_starts_before_train_ends_and_sync_waits_for_both():
    """The prefetch of step k+1 runs while train k runs (train k waits until generate k+1 has started), and the sync
    comes after both have ended (generate k+1 is held until train k has ended, so a sync that did not wait for it
    would come before gen(k+1)-)."""
    t = Trace()
    gen_started, train_ended = threading.Event(), threading.Event()

    def generate(step):
        if step == 2:
            t.log("gen2 called")
            gen_started.set()
            assert train_ended.wait(10), "train 1 never ended"
        return t.generate(step)

    def train(batch):
        if batch[0] == 1:
            assert gen_started.wait(10), "generate 2 did not start while train 1 ran"
        out = t.train(batch)
        if batch[0] == 1:
            train_ended.set()
        return out

    schedule = OneStepOffSchedule(generate, train, t.sync)
    schedule.step(1, prefetch_next=True)
    e = t.events
    assert e.index("gen2 called") < e.index("train1-") < e.index("gen2-") < e.index("sync1")
    assert e[-1] == "sync1" and schedule.pending == (2, 0)
    assert any(name.startswith("one-step-off-generate-2") for name in t.threads)


def test_one_step_off_generate_error_propagates_after_train_and_no_thread_is_left():
    t = Trace()
    before = threading.active_count()

    def generate(step):
        if step == 2:
            raise RuntimeError("engine exploded")
        return t.generate(step)

    schedule = OneStepOffSchedule(generate, t.train, t.sync)
    with pytest.raises(RuntimeError, match="engine exploded"):
        schedule.step(1, prefetch_next=True)
    assert "train1-" in t.events and "sync1" not in t.events  # train finished; nothing synced
    assert schedule.pending is None
    assert threading.active_count() == before
    assert not any(th.name.startswith("one-step-off") for th in threading.enumerate())


def test_one_step_off_train_error_waits_for_generate_and_chains_its_error():
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

    schedule = OneStepOffSchedule(generate, train, t.sync)
    with pytest.raises(RuntimeError, match="rank 1 died") as info:
        schedule.step(1, prefetch_next=True)
    assert isinstance(info.value.__context__, ValueError)
    assert not any(th.name.startswith("one-step-off") for th in threading.enumerate())
    assert "sync1" not in t.events and schedule.pending is None


def test_one_step_off_deferrable_prefetch_is_dropped_and_generated_after_the_sync():
    class Deferred(RuntimeError):
        pass

    t = Trace()
    fail = {2}

    def generate(step):
        if step in fail:
            fail.discard(step)
            raise Deferred("engine died during the overlap")
        return t.generate(step)

    schedule = OneStepOffSchedule(generate, t.train, t.sync, deferrable=(Deferred,))
    first = schedule.step(1, prefetch_next=True)
    assert first.prefetch_deferred and schedule.pending is None and "sync1" in t.events
    second = schedule.step(2, prefetch_next=False)
    assert not second.prefetched and second.batch == (2, 1) and second.trained[1] == 0  # sampled after the sync


def test_one_step_off_discard_drops_the_prefetched_batch():
    t = Trace()
    schedule = OneStepOffSchedule(t.generate, t.train, t.sync)
    schedule.step(1, prefetch_next=True)
    assert schedule.discard() == (2, 0) and schedule.pending is None
    out = schedule.step(2, prefetch_next=False)  # generated again, on the synced weights
    assert out.batch == (2, 1) and not out.prefetched


def test_one_step_off_step_refuses_a_batch_pending_for_another_step():
    # a pending batch silently replaced would drop its prompts unseen (the data position has moved past them)
    t = Trace()
    schedule = OneStepOffSchedule(t.generate, t.train, t.sync)
    schedule.step(1, prefetch_next=True)
    events = list(t.events)
    with pytest.raises(ValueError, match="step 5: the batch pending was generated for step 2; discard"):
        schedule.step(5)
    assert t.events == events and schedule.pending == (2, 0)  # nothing ran, the batch is still there
    assert schedule.discard() == (2, 0) and schedule.step(5, prefetch_next=False).batch == (5, 1)


def test_one_step_off_make_schedule_by_mode():
    t = Trace()
    assert isinstance(make_schedule("sync", t.generate, t.train, t.sync), SyncSchedule)
    assert isinstance(make_schedule("one_step_off", t.generate, t.train, t.sync), OneStepOffSchedule)
    with pytest.raises(ValueError, match="rollout.mode: expected one of .* got 'partial'"):
        make_schedule("partial", t.generate, t.train, t.sync)


def test_one_step_off_bench_stand_ins_report_staleness_and_overlap():
    """bench/bench_async.py drives the same schedules: staleness 0 in sync, 1 in one_step_off; with 0.2 s generate
    and 0.2 s train a one_step_off step takes well under their 0.4 s sum (loose bound: a loaded machine only adds)."""
    from bench.bench_async import measure

    assert measure("sync", 0.0, 0.0, 0.0, 3)["staleness"] == [0, 0, 0]
    assert measure("one_step_off", 0.0, 0.0, 0.0, 3)["staleness"] == [1, 1, 1]
    assert measure("one_step_off", 0.2, 0.2, 0.0, 2)["max_step_s"] < 0.35

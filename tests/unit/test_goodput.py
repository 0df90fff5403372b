"""Goodput accounting (``cluster.loop.goodput``): the driver's wait clock, the ledger's per-pool parts and the rule that
they add up to workers × the step's wall time; pools that report their time (``contract.goodput.TimedPool``)."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.loop.goodput import DriverClock, GoodputLedger
from cluster.sinks.metric_names import pool_of
from contract.goodput import PoolTime, TimedPool

#: The tolerance of "it adds up" (the issue's done-when): 2 % of a pool's workers × wall.
TOLERANCE = 0.02


def check_adds_up(row: dict, wall_s: float) -> list[str]:
    """What does not add up in one metrics row: every pool's parts are >= -2 % of workers × wall and sum to
    workers × ``wall_s`` (the step's ``timing/step_s``) within 2 %. Returns the problems (empty: it adds up)."""
    pools = {key[len("time/"):-len("_workers")] for key in row if key.startswith("time/") and key.endswith("_workers")}
    problems = [] if "driver" in pools else ["no time/driver_* figures"]
    for pool in sorted(pools):
        workers = row[f"time/{pool}_workers"]
        parts = {p: row[f"time/{pool}_{p}"] for p in ("busy_s", "waiting_s", "idle_s")}
        capacity = workers * wall_s
        if any(v < -TOLERANCE * capacity for v in parts.values()):
            problems.append(f"{pool}: a part below 0: {parts} of {capacity:.4f} worker-s")
        if abs(sum(parts.values()) - capacity) > TOLERANCE * max(capacity, 1e-9):
            problems.append(f"{pool}: parts sum to {sum(parts.values()):.4f}, workers x wall = {capacity:.4f}")
    return problems


class Pool:
    """A stand-in pool with cumulative counters the test moves by hand."""

    def __init__(self, name: str, workers: int, cores: float = 0.0):
        self.name = name
        self.workers = workers
        self.cores = cores
        self.busy = 0.0
        self.waiting = 0.0

    def pool_times(self) -> list[PoolTime]:
        return [PoolTime(self.name, self.workers, self.busy, self.waiting, self.cores)]


def test_goodput_driver_clock_counts_waits_of_the_step_thread_only():
    clock = DriverClock()
    clock.begin_step()
    with clock.waiting():
        time.sleep(0.05)
        with clock.working():  # the driver scoring in the fleet's callback: not a wait
            time.sleep(0.05)
    def producer():  # one_step_off's producer thread: not the driver's main thread
        with clock.waiting():
            time.sleep(0.05)

    t = threading.Thread(target=producer)
    t.start()
    t.join()
    assert 0.045 <= clock.waiting_s < 0.09, clock.waiting_s
    clock.begin_step()
    assert clock.waiting_s == 0.0


def test_goodput_parts_add_up_and_the_sync_holds_engines_and_ranks():
    rollout, train, reward = Pool("rollout", 2, cores=2.0), Pool("train", 4, cores=2.0), Pool("reward", 1)
    ledger = GoodputLedger(lambda: (rollout, train, reward, object(), None))
    ledger.begin_step()
    with ledger.driver.waiting():
        time.sleep(0.05)
    rollout.busy += 0.06  # 2 engines, 0.03 s each
    train.busy += 0.02
    reward.busy += 0.01
    row = ledger.end_step(sync_s=0.004, trained_tokens=100)
    wall = row["time/driver_busy_s"] + row["time/driver_waiting_s"] + row["time/driver_idle_s"]
    assert not check_adds_up(row, wall)
    assert row["time/driver_idle_s"] == 0.0 and row["time/driver_waiting_s"] >= 0.05
    assert row["time/rollout_busy_s"] == pytest.approx(0.06) and row["time/rollout_workers"] == 2
    assert row["time/rollout_waiting_s"] == pytest.approx(2 * 0.004) and row["time/train_waiting_s"] == pytest.approx(
        4 * 0.004)
    assert row["time/reward_waiting_s"] == 0.0  # the sync holds engines and ranks only
    assert row["goodput/cores"] == 4.0 and row["goodput/trained_tokens"] == 100
    assert row["goodput/tokens_per_s"] == pytest.approx(100 / wall, rel=0.01)
    assert row["goodput/tokens_per_core_s"] == pytest.approx(100 / wall / 4, rel=0.01)


def test_goodput_counted_twice_shows_as_negative_idle_not_clipped():
    """Busy time beyond the wall (a double count) must stay visible: the adds-up check catches it."""
    rollout = Pool("rollout", 1)
    ledger = GoodputLedger(lambda: (rollout,))
    ledger.begin_step()
    rollout.busy += 10.0
    row = ledger.end_step(sync_s=0.0, trained_tokens=0)
    assert row["time/rollout_idle_s"] < -9.0
    assert check_adds_up(row, row["time/driver_busy_s"] + row["time/driver_waiting_s"])


def test_goodput_cores_fall_back_to_the_driver_process_and_pools_sum_by_name():
    a, b = Pool("environment", 2), Pool("environment", 3)
    ledger = GoodputLedger(lambda: (a, b), fallback_cores=lambda: 7.0)
    ledger.begin_step()
    a.busy, b.busy = 1.0, 2.0
    row = ledger.end_step(sync_s=1.0, trained_tokens=0)
    assert row["goodput/cores"] == 7.0 and row["time/environment_workers"] == 5
    assert row["time/environment_busy_s"] == 3.0 and row["time/environment_waiting_s"] == 0.0
    assert row["goodput/tokens_per_s"] == 0.0


@pytest.mark.parametrize("name", ["Rollout", "driver", "reward_pool", ""])
def test_goodput_pool_names_must_fit_a_metric_key(name):
    ledger = GoodputLedger(lambda: (Pool(name, 1),))
    with pytest.raises(ValueError, match="pool name"):
        ledger.begin_step()


def test_goodput_end_before_begin_is_an_error():
    with pytest.raises(RuntimeError, match="before begin_step"):
        GoodputLedger(lambda: ()).end_step(sync_s=0.0, trained_tokens=0)


def test_goodput_pools_report_their_time():
    """Every runtime's pools implement the protocol; the loop never names them."""
    from cluster.in_process.fleet import LocalFleet
    from cluster.in_process.trainer import LocalTrainer
    from cluster.loop.environment_host import LocalEnvironments
    from cluster.ray_shell.fleet import EngineFleet
    from cluster.ray_shell.train_pool import RayTrainer
    from cluster.rewards.pool import WorkerPool

    from cluster.agents.pool import AgentWorkerPool

    for cls in (LocalFleet, LocalTrainer, EngineFleet, RayTrainer, WorkerPool, LocalEnvironments, AgentWorkerPool):
        assert issubclass(cls, TimedPool), cls
    pool = WorkerPool(lambda i: None, workers=2, batch_size=4, timeout_s=1.0, kind="test", cores_per_worker=0.5)
    assert pool.pool_times() == [PoolTime("reward", 0, 0.0)]  # not started: no worker serving
    envs = LocalEnvironments("scripted", {}, parallel=3, timeout_s=1.0)
    assert envs.pool_times() == [PoolTime("environment", 3, 0.0)]


def test_goodput_series_carry_their_pool_label():
    assert pool_of("time/reward_busy_s") == "reward" and pool_of("time/rollout_idle_s") == "rollout"
    assert pool_of("time/driver_waiting_s") == "driver" and pool_of("time/environment_workers") == "environment"
    assert pool_of("timing/generate_s") == "rollout" and pool_of("goodput/tokens_per_s") == "driver"

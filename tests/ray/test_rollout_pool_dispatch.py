"""``RolloutPool.generate`` on a local Ray cluster with fake engine actors (no vLLM): load-based dispatch of whole
groups, results in request order, ``on_groups`` called per engine as each finishes (fast engine first), the
``engine_idle_fraction`` formula, and the timeout; and the fleet over such a pool (``EngineFleet``): an engine that
dies past ``rollout.max_engine_restarts`` stops it with ``EngineFailure``. Request-level generation
(``cluster.ray_shell.requests``): many requests in flight per engine actor (its ``requests`` concurrency group), and
the requests of an engine killed mid-request sampled again on its replacement.

A fake engine sleeps a fixed number of seconds per call and reports them as its busy seconds, so the expected idle
fraction is 1 − Σ sleeps / (num_engines × wall seconds).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from cluster.ray_shell.pools import WorkerTimeout
from cluster.ray_shell.rollout_pool import RolloutPool
from cluster.loop.scheduler import assign_groups
from contract.messages import EngineLoad, GenerateStats, GroupRequest, GroupResult

MAX_RESPONSE_TOKENS = 10


def fake_engine_class():
    """The fake engine class, built inside a function so that Ray pickles it by value (worker processes cannot
    import this test module by name)."""

    class FakeEngine:
        """Answers every request with G one-token completions tagged with this engine's name after ``delay_s``."""

        def __init__(self, name: str, delay_s: float):
            self.name, self.delay_s = name, delay_s

        def ready(self) -> bool:
            return True

        def generate(self, requests: list[GroupRequest], group_size: int) -> tuple[list[GroupResult], GenerateStats]:
            time.sleep(self.delay_s)
            results = []
            for r in requests:
                g = r.group_size or group_size
                results.append(GroupResult(r.group_id, list(r.prompt_ids), [[7]] * g, [], ["stop"] * g,
                                           [self.name] * g, policy_version=0))
            return results, GenerateStats(seconds=self.delay_s, tokens=sum(len(x.response_ids) for x in results))

    return FakeEngine


def make_pool(ray, delays: list[float], timeout_s: float = 60.0, max_engine_restarts: int = 3) -> RolloutPool:
    """A RolloutPool whose engines are fake actors (``__init__`` would start vLLM engines)."""
    pool = RolloutPool.__new__(RolloutPool)
    pool.spec = SimpleNamespace(rollout=SimpleNamespace(group_size=2, max_response_tokens=MAX_RESPONSE_TOKENS,
                                                        timeout_s=timeout_s, max_engine_restarts=max_engine_restarts,
                                                        max_staleness=0))
    pool.infos, pool.restarts = [], 0
    actor = ray.remote(num_cpus=0)(fake_engine_class())
    pool.engines = [actor.remote(f"engine{k}", d) for k, d in enumerate(delays)]
    ray.get([e.ready.remote() for e in pool.engines], timeout=60)  # started: timings below exclude actor start-up
    return pool


def requests() -> list[GroupRequest]:
    # Loads (prompt + G·T): 3 + 20 = 23, 8 + 40 = 48, 5 + 20 = 25, 2 + 80 = 82, 4 + 20 = 24 tokens.
    return [GroupRequest(group_id=10 + i, prompt_ids=[1] * p, group_size=g)
            for i, (p, g) in enumerate([(3, None), (8, 4), (5, None), (2, 8), (4, None)])]


def test_dispatch_order_callbacks_and_idle_fraction(local_ray):
    pool = make_pool(local_ray, [1.5, 0.2])
    reqs = requests()
    calls = []
    t0 = time.perf_counter()
    results, stats = pool.generate(reqs, on_groups=lambda groups: calls.append((time.perf_counter() - t0, groups)))
    wall = time.perf_counter() - t0

    # Results in request order; every group's G completions from one engine, the one assign_groups chose.
    assert [r.group_id for r in results] == [q.group_id for q in reqs]
    assert [len(r.response_ids) for r in results] == [2, 4, 2, 8, 2]
    plan = assign_groups([len(q.prompt_ids) for q in reqs], [q.group_size or 2 for q in reqs], 2,
                         MAX_RESPONSE_TOKENS)
    # By tokens, heaviest first onto the lighter engine: 82 → e0, 48 → e1, 25 → e1 (73), 24 → e1 (97), 23 → e0 (105);
    # by request count e0 would get three of the five groups.
    assert plan == [[3, 0], [1, 2, 4]]
    for k, idx in enumerate(plan):
        for i in idx:
            assert set(results[i].texts) == {f"engine{k}"}

    # One callback per engine, fast engine first, before the slow one has finished.
    assert [{g.texts[0] for g in groups} for _, groups in calls] == [{"engine1"}, {"engine0"}]
    assert sorted(g.group_id for _, groups in calls for g in groups) == sorted(q.group_id for q in reqs)
    assert calls[0][0] < 1.0 <= calls[1][0]

    assert stats.tokens == 18 and sorted(stats.engine_seconds) == [0.2, 1.5]
    assert stats.per_engine == [EngineLoad(groups=2, tokens=10, seconds=1.5), EngineLoad(groups=3, tokens=8,
                                                                                          seconds=0.2)]
    expected = 1 - (1.5 + 0.2) / (2 * wall)
    assert stats.engine_idle_fraction == pytest.approx(expected, abs=0.05)
    assert 0.3 < stats.engine_idle_fraction < 0.45


def test_engine_without_groups_counts_as_idle(local_ray):
    pool = make_pool(local_ray, [0.5, 0.5, 0.5])
    reqs = requests()[:2]
    results, stats = pool.generate(reqs)
    assert [r.group_id for r in results] == [10, 11]
    assert len(stats.engine_seconds) == 2  # the third engine got no call
    assert [e for e in stats.per_engine if e.groups == 0] == [EngineLoad(groups=0)]  # no call: zeros, no KV figure
    assert stats.engine_idle_fraction == pytest.approx(1 - 1.0 / 1.5, abs=0.08)  # ≥ 1/3: one engine never ran


def test_timeout_names_the_operation(local_ray):
    pool = make_pool(local_ray, [3.0, 0.1], timeout_s=0.8)
    with pytest.raises(WorkerTimeout, match=r"generating 5 groups did not finish within 0.8 s \(1 engine call"):
        pool.generate(requests())


def test_engine_failures_beyond_the_restart_bound_stop_the_fleet(local_ray):
    """An engine dies with ``rollout.max_engine_restarts: 0``: the fleet's generate finds it dead and, with no
    replacement allowed, stops with ``EngineFailure`` naming the engine and the bound (the loop lets it end the job).
    (Formerly a whole job in test_reliability.py; the replacement itself, with a real engine, is checked there.)"""
    from cluster.ray_shell.fleet import EngineFleet
    from cluster.ray_shell.pools import EngineFailure
    from contract.versions import PolicyVersionLedger

    pool = make_pool(local_ray, [0.1], max_engine_restarts=0)
    messages: list[str] = []
    fleet = EngineFleet(pool.spec)
    fleet.attach(pool, None, PolicyVersionLedger(), messages.append)
    local_ray.kill(pool.engines[0], no_restart=True)
    with pytest.raises(EngineFailure, match=r"rollout engine\(s\) \[0\] failed .*0 replacement\(s\) already made and "
                                            r"rollout.max_engine_restarts=0: stopping"):
        fleet.generate(requests())
    assert pool.restarts == 0 and fleet.restarts == 0


# ---- request-level generation: many Ray calls in flight per engine, and a lost engine ----------------------------


def fake_server_class():
    """A fake engine serving requests (``serve``): sleeps ``delay_s`` per request, answers one token with its name
    (built inside a function so that Ray pickles it by value)."""
    from contract.requests import TokenResult

    class FakeServer:
        def __init__(self, name: str, delay_s: float):
            self.name, self.delay_s = name, delay_s

        def ready(self) -> bool:
            return True

        def serve(self, request):
            time.sleep(self.delay_s)
            return TokenResult(request.request_id, request.prompt_ids, [7], [-0.1], [0], "stop", text=self.name,
                               busy_s=self.delay_s)

    return FakeServer


class ServingFleet:
    """What ``RequestDispatch`` reads of an ``EngineFleet``, over fake serving actors in the ``requests`` group;
    ``recover_engines`` replaces a killed actor with a new one named ``replacement``."""

    def __init__(self, ray, delays: list[float]):
        from cluster.ray_shell.requests import REQUEST_GROUP

        self.ray, self.recovered = ray, []
        self.actor = ray.remote(num_cpus=0, concurrency_groups={REQUEST_GROUP: 16})(fake_server_class())
        self.rollout = SimpleNamespace(engines=[self.actor.remote(f"engine{k}", d) for k, d in enumerate(delays)])
        ray.get([e.ready.remote() for e in self.rollout.engines], timeout=60)

    def recover_engines(self, cause) -> None:
        self.recovered.append(type(cause).__name__)
        for i, engine in enumerate(self.rollout.engines):
            try:
                self.ray.get(engine.ready.remote(), timeout=30)
            except self.ray.exceptions.RayActorError:
                self.rollout.engines[i] = self.actor.remote("replacement", 0.1)

    def record_request(self, engine, result, submitted, done) -> None:
        pass


def test_rollout_engine_requests_run_many_at_once_per_engine_and_survive_a_lost_engine(local_ray):
    from cluster.ray_shell.requests import RequestDispatch
    from contract.requests import TokenRequest

    fleet = ServingFleet(local_ray, [0.5, 0.5])
    dispatch = RequestDispatch(fleet)
    t0 = time.perf_counter()
    futures = [dispatch.submit(TokenRequest(f"r{i}", (1, 2), 4, seed=i)) for i in range(12)]
    results = [f.result(60) for f in futures]
    wall = time.perf_counter() - t0
    assert wall < 2.0, wall  # 12 requests of 0.5 s on 2 engines, in flight together (one at a time: 3 s)
    assert sorted(r.engine for r in results) == ["engine-0"] * 6 + ["engine-1"] * 6  # fewest tokens in flight

    slow = [dispatch.submit(TokenRequest(f"s{i}", (1, 2), 4, seed=i, group_id=1)) for i in range(3)]
    time.sleep(0.2)
    local_ray.kill(fleet.rollout.engines[0], no_restart=True)  # the group's engine dies with its requests
    answers = [f.result(90) for f in slow]
    assert fleet.recovered and {a.text for a in answers} == {"replacement"}
    assert [a.request_id for a in answers] == ["s0", "s1", "s2"]
    dispatch.shutdown()

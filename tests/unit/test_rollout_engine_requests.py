"""Request-level generation's engine-neutral parts (issue 36, item 2), without an engine or Ray: a served request's
segments across pauses (seeds, versions, what its result says), the serving queue's holds, the step figures
(``rollout/request_queue_s``, the engines' idle share from their own busy counters), and the Ray fleet's dispatch of
requests over stand-in engine handles (group affinity, fewest tokens in flight, an engine lost with requests in flight
→ replaced and its requests sampled again from scratch, or failed once the fleet gives up)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import ray

from cluster.loop.step_metrics import step_metrics
from cluster.ray_shell.requests import RequestDispatch
from contract.figures import FleetFigures
from contract.messages import PoolGenerateStats
from contract.requests import TokenRequest, TokenResult
from rollout_workers.partial import resume_seed
from rollout_workers.serving import RequestQueue, ServedRequest, check_request


def request(rid: str = "e0-c0", prompt=(1, 2, 3), max_tokens: int = 8, **kwargs) -> TokenRequest:
    return TokenRequest(rid, tuple(prompt), max_tokens, **kwargs)


def test_rollout_engine_request_segments_continue_with_their_tokens_versions_and_a_fresh_seed():
    state = ServedRequest(request(seed=11, stop=("</a>",)), Future())
    assert state.next_segment() == ([1, 2, 3], 8, 11) and state.scanner(str) is None  # first: the engine's own stop
    state.add([5, 6], [-0.5, -0.25], 0, "ab")  # paused by a sync after two tokens
    prompt, max_tokens, seed = state.next_segment()
    assert (prompt, max_tokens, seed) == ([1, 2, 3, 5, 6], 6, resume_seed(11, 0, 2)) and seed != 11
    assert state.scanner(lambda ids: "x" * len(ids)).prefix == [5, 6]  # stop strings across the pause
    state.add([7], [-1.0], 1, "c")
    state.finish("stop", "</a>")
    result = state.result("engine-3", busy_s=4.5)
    assert (result.token_ids, result.logprobs, result.token_versions) == ([5, 6, 7], [-0.5, -0.25, -1.0], [0, 0, 1])
    assert (result.finish_reason, result.stop_reason, result.text, result.engine, result.busy_s) == (
        "stop", "</a>", "abc", "engine-3", 4.5)
    assert result.prompt_ids == (1, 2, 3) and result.queue_s >= 0 and result.engine_s >= 0 and state.segments == 2
    unseeded = ServedRequest(request(), Future())
    unseeded.add([4], [0.0], 0, "")
    assert unseeded.next_segment()[2] is None


def test_rollout_engine_requests_that_no_engine_can_serve_are_refused_naming_them():
    for bad in (request(prompt=()), request(max_tokens=0), request(temperature=-1.0)):
        with pytest.raises(ValueError, match=r"^request e0-c0: expected a non-empty prompt, max_tokens >= 1"):
            check_request(bad)


def test_rollout_engine_serving_queue_puts_paused_requests_first_and_holds_the_thread_off():
    queue = RequestQueue()
    a, b, c = (ServedRequest(request(r), Future()) for r in "abc")
    queue.put(a)
    queue.put_front([b, c])
    assert [s.request.request_id for s in queue.take(2)] == ["b", "c"] and len(queue) == 1
    woke = []
    thread = threading.Thread(target=lambda: woke.append(queue.wait_for_work(lambda: False)))
    with queue.hold():
        thread.start()
        time.sleep(0.2)
        assert not woke and queue.held  # work is waiting, but the engine is held
    thread.join(5)
    assert woke == [True] and not queue.held
    assert [s.request.request_id for s in queue.close()] == ["a"] and not queue.wait_for_work(lambda: True)
    with pytest.raises(RuntimeError, match="shut down"):
        queue.put(a)


def _result(tokens: int, busy_s: float, queue_s: float) -> TokenResult:
    return TokenResult("r", (1,), [9] * tokens, [0.0] * tokens, [0] * tokens, "stop", queue_s=queue_s,
                       busy_s=busy_s)


def test_rollout_engine_request_figures_give_queue_seconds_and_idle_share_from_the_engines_counters():
    figures = FleetFigures(engines=2, busy_base={0: 10.0, 1: 3.0})
    figures.add_request(0, _result(4, busy_s=12.0, queue_s=0.5), submitted=100.0, done=101.0)
    figures.add_request(0, _result(2, busy_s=13.0, queue_s=1.5), submitted=100.5, done=104.0)
    figures.add_request(1, _result(3, busy_s=1.0, queue_s=0.0), submitted=101.0, done=102.0)  # replaced: from 0
    # busy 3 s (engine 0) + 1 s (engine 1) over 2 engines x 4 s of window: idle 1 - 4/8
    assert figures.request_idle_fraction == pytest.approx(0.5) and figures.idle_fraction == pytest.approx(0.5)
    assert figures.request_queue_mean_s == pytest.approx(2.0 / 3) and figures.tokens == 9
    assert figures.per_engine[0].groups == 2 and figures.per_engine[0].seconds == pytest.approx(3.0)
    # a generate call the same step, 2 engines x 2 s with 3.6 busy engine-seconds: weighed by engine-seconds
    figures.add(PoolGenerateStats(tokens=0, engine_seconds=[1.8, 1.8], engine_idle_fraction=0.1, per_engine=[],
                                  capacity_seconds=4.0))
    assert figures.idle_fraction == pytest.approx(1 - (4.0 + 3.6) / (8.0 + 4.0))
    unmeasured = FleetFigures(engines=1, busy_base={0: 0.0}, capacity_seconds=None)
    unmeasured.add_request(0, _result(1, busy_s=1.0, queue_s=0.0), submitted=0.0, done=4.0)
    unmeasured.idle_fractions.append(0.25)  # a call that did not measure its capacity: the mean of the fractions
    assert unmeasured.idle_fraction == pytest.approx((0.25 + 0.75) / 2)
    assert FleetFigures().request_idle_fraction is None and FleetFigures().request_queue_mean_s is None


def test_rollout_engine_request_queue_seconds_are_a_step_metric_only_when_requests_were_served():
    def row(figures):
        sampling = SimpleNamespace(batch=SimpleNamespace(num_nonfinite_logprobs=lambda: 0))
        train = SimpleNamespace(skipped=False, skip_reason="", metrics={"perf/train_tokens": 1.0})
        clock = SimpleNamespace(seconds={"generate": 1.0, "train": 1.0, "score": 0.0, "sync": 0.0},
                                step_s=lambda: 2.0)
        import cluster.loop.step_metrics as module

        original = module._sampling_metrics
        module._sampling_metrics = lambda *a: {}
        try:
            return step_metrics(policy_version=1, sampling=sampling, group_size=4, version_at_train=0, fleet=figures,
                                engines=1, restarts=0, train=train, skipped_total=0, sync={}, packing={}, epoch=0,
                                prompts_filtered=0, bad_rows=0, clock=clock)
        finally:
            module._sampling_metrics = original

    served = FleetFigures(engines=1)
    served.add_request(0, _result(2, busy_s=1.0, queue_s=0.25), submitted=0.0, done=2.0)
    out = row(served)
    assert out["rollout/request_queue_s"] == 0.25 and out["rollout/engine_idle_fraction"] == pytest.approx(0.5)
    assert "rollout/request_queue_s" not in row(FleetFigures())


# ---- the Ray fleet's dispatch, over stand-in engine handles ----------------------------------------------------------


class _Call:
    """What ``actor.serve.options(...).remote(request)`` returns: ``future()`` as Ray's ObjectRef has."""

    def __init__(self, future: Future):
        self._future = future

    def future(self) -> Future:
        return self._future


class _Engine:
    """A stand-in engine handle: records the requests it gets; the test resolves or fails their calls."""

    def __init__(self, name: str):
        self.name, self.calls = name, []
        self.serve = SimpleNamespace(options=lambda **opts: SimpleNamespace(remote=self._remote))

    def _remote(self, req: TokenRequest) -> _Call:
        future = Future()
        self.calls.append((req, future))
        return _Call(future)

    def answer(self, busy_s: float = 1.0) -> None:
        for req, future in self.calls:
            if not future.done():
                future.set_result(TokenResult(req.request_id, req.prompt_ids, [7], [-0.1], [0], "stop",
                                              engine=self.name, busy_s=busy_s))


class _Fleet:
    """What ``RequestDispatch`` reads of an ``EngineFleet``: the engines, the recovery, the figures."""

    def __init__(self, engines: int, give_up: BaseException | None = None):
        self.rollout = SimpleNamespace(engines=[_Engine(f"e{i}") for i in range(engines)])
        self.recovered = []
        self.recorded = []
        self.give_up = give_up

    def recover_engines(self, cause):
        self.recovered.append(type(cause).__name__)
        if self.give_up is not None:
            raise self.give_up
        if self.rollout.engines[0].name == "e0":  # dead: replaced once (a later recovery finds it alive)
            self.rollout.engines[0] = _Engine("replacement")

    def record_request(self, engine, result, submitted, done):
        self.recorded.append((engine, result.request_id))


def test_rollout_engine_requests_go_to_their_groups_engine_else_to_the_least_loaded():
    fleet = _Fleet(2)
    dispatch = RequestDispatch(fleet)
    first = dispatch.submit(request("g1-a", prompt=[1] * 50, group_id=1))  # engine 0 (both empty)
    dispatch.submit(request("g2-a", prompt=[1] * 10, group_id=2))  # engine 1: fewer tokens in flight
    dispatch.submit(request("g1-b", prompt=[1] * 60, group_id=1))  # its group's engine, though it is busier
    dispatch.submit(request("free", prompt=[1] * 5))  # engine 1: 18 tokens in flight against 126
    assert [r.request_id for r, _ in fleet.rollout.engines[0].calls] == ["g1-a", "g1-b"]
    assert [r.request_id for r, _ in fleet.rollout.engines[1].calls] == ["g2-a", "free"]
    fleet.rollout.engines[0].answer()
    assert first.result(5).engine == "engine-0" and (0, "g1-a") in fleet.recorded


def test_rollout_engine_requests_of_a_dead_engine_are_sampled_again_from_scratch_on_its_replacement():
    fleet = _Fleet(1)
    dispatch = RequestDispatch(fleet)
    futures = [dispatch.submit(request(f"r{i}", seed=5)) for i in range(3)]
    dead = fleet.rollout.engines[0]
    for _, call in dead.calls:
        call.set_exception(ray.exceptions.RayActorError())
    deadline = time.monotonic() + 10
    while len(fleet.rollout.engines[0].calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    replacement = fleet.rollout.engines[0]
    assert replacement.name == "replacement" and fleet.recovered[0] == "RayActorError"
    assert [r for r, _ in replacement.calls] == [r for r, _ in dead.calls]  # the same requests, the same seeds
    replacement.answer()
    assert [f.result(5).request_id for f in futures] == ["r0", "r1", "r2"]
    dispatch.shutdown()


def test_rollout_engine_requests_fail_with_the_fleets_error_when_it_gives_up():
    class EngineFailure(RuntimeError):
        pass

    fleet = _Fleet(1, give_up=EngineFailure("rollout.max_engine_restarts=0: stopping"))
    dispatch = RequestDispatch(fleet)
    future = dispatch.submit(request())
    fleet.rollout.engines[0].calls[0][1].set_exception(ray.exceptions.RayActorError())
    with pytest.raises(EngineFailure, match="max_engine_restarts"):
        future.result(10)
    refused = dispatch.submit(request("bad"))
    fleet.rollout.engines[0].calls[-1][1].set_exception(
        ray.exceptions.RayTaskError("serve", "Traceback (most recent call last):\nValueError: prompt too long",
                                    ValueError("prompt too long")))
    with pytest.raises(ValueError, match="prompt too long"):
        refused.result(10)
    dispatch.shutdown()


def test_rollout_engine_both_fleets_and_both_engines_are_request_servers():
    from cluster.in_process import LocalFleet
    from cluster.ray_shell.fleet import EngineFleet
    from cluster.spec import load_spec_text
    from contract.requests import RequestServer
    from rollout_workers.registry import ROLLOUT_ENGINES, rollout_engine

    spec = load_spec_text("output_dir: o\ntotal_steps: 1\ndata: {train_path: t.jsonl}\n")
    assert isinstance(LocalFleet(spec), RequestServer) and isinstance(EngineFleet(spec), RequestServer)
    for name in ROLLOUT_ENGINES:
        assert callable(getattr(rollout_engine(name), "submit", None)), name
        assert callable(getattr(rollout_engine(name), "serve", None)), name

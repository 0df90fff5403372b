"""The Ray fleet's request-level side (``contract.requests.RequestServer``): each request goes to one engine actor as
its own Ray call, many in flight at once, and resolves on its own.

Dispatch: the requests of one group go to the engine that served the group before (its prefix cache holds the
group's prompt and the episode's earlier turns); a group seen for the first time, or a request without a group, goes
to the engine with the fewest tokens in flight (prompt + ``max_tokens`` of its unfinished requests), lowest index on
ties. The call is ``engine.serve(request)`` in the actor's ``requests`` concurrency group (:data:`REQUEST_GROUP`,
``cluster.ray_shell.rollout_pool``: a pool of threads each waiting on one request while the engine's own serving
thread batches them; the actor's default group keeps serving ``generate``, the weight sync and the liveness probe),
and its ``ObjectRef.future()`` resolves the caller's future.

Faults (the choice made here): an engine that dies with requests in flight is replaced, as a failed ``generate``
replaces it (``EngineFleet``: a new actor in its place, the sync group rebuilt, the trainer's version synced), and
every request it held is sampled again from scratch on the engines then serving — the same request, the same seed —
so its caller sees one result, later; only when the fleet gives up (more deaths than ``rollout.max_engine_restarts``,
a replacement that cannot be placed) do the futures fail, with the fleet's error (``EngineFailure``), which a caller
treats as an infrastructure failure of that episode. A request the engine refuses (e.g. longer than its context)
fails its future with the engine's error. While an engine is being replaced it takes no new request; requests that
find no engine to take them wait and are dispatched once the replacement serves.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import ray

from contract.requests import TokenRequest, TokenResult

__all__ = ["REQUEST_GROUP", "RequestDispatch"]

#: The engine actor's concurrency group that request calls run in (``cluster.ray_shell.rollout_pool`` sizes it).
REQUEST_GROUP = "requests"
#: Groups whose engine is remembered (least recently used forgotten first).
GROUP_MEMORY = 4096
#: Times one request is sampled again after losing its engine before its future fails.
MAX_RESUBMITS = 3


@dataclass
class _Flight:
    """One request in flight: where it went, when it was submitted, how often it was sent."""

    request: TokenRequest
    future: Future
    submitted: float = field(default_factory=time.perf_counter)
    engine: int = -1
    sends: int = 0

    @property
    def tokens(self) -> int:
        return len(self.request.prompt_ids) + self.request.max_tokens


class RequestDispatch:
    """Requests over the fleet's engine actors (module docstring).

    Args:
        fleet: the ``EngineFleet`` (its ``rollout`` pool, ``membership`` lock, ``recover_engines`` and
            ``record_request``).
    """

    def __init__(self, fleet):
        self.fleet = fleet
        self._lock = threading.Lock()
        self._load: dict[int, int] = {}  # engine index → tokens in flight
        self._groups: OrderedDict[int, int] = OrderedDict()  # group id → engine index
        self._unavailable: set[int] = set()  # engines being replaced
        self._parked: list[_Flight] = []  # requests that found no engine to take them
        self._lost: list[_Flight] = []  # requests whose engine died, to send again after the recovery
        self._recovery = ThreadPoolExecutor(max_workers=1, thread_name_prefix="request-recovery")

    def submit(self, request: TokenRequest) -> Future[TokenResult]:
        """Send ``request`` to an engine (module docstring) and return at once; thread-safe."""
        flight = _Flight(request, Future())
        self._send(flight)
        return flight.future

    def shutdown(self) -> None:
        """Stop recovering; requests still waiting for an engine fail."""
        self._recovery.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            waiting, self._parked, self._lost = self._parked + self._lost, [], []
        for flight in waiting:
            if not flight.future.done():
                flight.future.set_exception(RuntimeError(f"request {flight.request.request_id}: the fleet shut down"))

    # ---- dispatch -------------------------------------------------------------------------------------------------
    def _choose(self, request: TokenRequest) -> int | None:
        """The engine for ``request`` (module docstring), or None when none can take it now. Under ``_lock``."""
        engines = len(self.fleet.rollout.engines) if self.fleet.rollout is not None else 0
        ready = [e for e in range(engines) if e not in self._unavailable]
        if not ready:
            return None
        group = request.group_id
        if group is not None and self._groups.get(group) in ready:
            self._groups.move_to_end(group)
            return self._groups[group]
        engine = min(ready, key=lambda e: (self._load.get(e, 0), e))
        if group is not None:
            self._groups[group] = engine
            while len(self._groups) > GROUP_MEMORY:
                self._groups.popitem(last=False)
        return engine

    def _send(self, flight: _Flight) -> None:
        """Dispatch ``flight`` and attach its settlement, or park it until an engine serves again."""
        with self._lock:
            engine = self._choose(flight.request)
            if engine is None:
                self._parked.append(flight)
                return
            flight.engine, flight.sends = engine, flight.sends + 1
            self._load[engine] = self._load.get(engine, 0) + flight.tokens
            actor = self.fleet.rollout.engines[engine]
        ref = actor.serve.options(concurrency_group=REQUEST_GROUP).remote(flight.request)
        ref.future().add_done_callback(lambda done: self._settle(flight, done))

    def _settle(self, flight: _Flight, done: Future) -> None:
        """Resolve ``flight`` from its Ray call (on a Ray thread): its result, the engine's error, or its engine
        lost (:meth:`_lose`)."""
        with self._lock:
            self._load[flight.engine] = self._load.get(flight.engine, 0) - flight.tokens
        try:
            result = done.result()
        except ray.exceptions.RayActorError as exc:
            self._lose(flight, exc)
            return
        except ray.exceptions.RayTaskError as exc:  # the engine's own refusal of this request
            flight.future.set_exception(exc.as_instanceof_cause())
            return
        except Exception as exc:  # noqa: BLE001 - anything else Ray raises for the call: the caller's infra failure
            flight.future.set_exception(exc)
            return
        result = dataclasses.replace(result, engine=f"engine-{flight.engine}")
        self.fleet.record_request(flight.engine, result, flight.submitted, time.perf_counter())
        flight.future.set_result(result)

    # ---- faults ---------------------------------------------------------------------------------------------------
    def _lose(self, flight: _Flight, cause: BaseException) -> None:
        """``flight``'s engine died: keep it for the recovery, which replaces the engine and sends it again."""
        with self._lock:
            self._unavailable.add(flight.engine)
            self._lost.append(flight)
        self._recovery.submit(self._recover, flight.engine, cause)

    def _recover(self, engine: int, cause: BaseException) -> None:
        """Replace the dead engines (``EngineFleet.recover_engines``), then send the lost requests again from scratch
        (same request, same seed) and the parked ones; when the fleet gives up, their futures fail with its error."""
        try:
            self.fleet.recover_engines(cause)
            failure = None
        except BaseException as exc:  # noqa: BLE001 - the fleet gave up: the requests' callers are told
            failure = exc
        with self._lock:
            self._unavailable.clear()
            lost, self._lost = self._lost, []
            parked, self._parked = self._parked, []
        for flight in lost + parked:
            if failure is not None or flight.sends > MAX_RESUBMITS:
                why = failure or RuntimeError(f"request {flight.request.request_id}: lost its engine "
                                              f"{flight.sends} times ({type(cause).__name__})")
                if not flight.future.done():
                    flight.future.set_exception(why)
                continue
            self._send(flight)

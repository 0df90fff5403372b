"""Request-level serving, engine-neutral: what every engine keeps per request it serves
(``contract.requests.RequestServer``), the queue its serving thread takes them from, and its busy clock.

A request (:class:`contract.requests.TokenRequest`) is served by one or more engine *segments*: it starts as one
engine request; a weight sync (or a ``generate`` call) that comes while it runs pauses it — the engine aborts it,
keeping the tokens it has — and it continues as a new engine request whose prompt is the request's prompt followed by
those tokens, capped at what is left of ``max_tokens``, on whatever weights the engine then holds. Every token keeps
the policy version that sampled it (``TokenResult.token_versions``); no token mixes versions (a segment runs on one
version) and no request is lost. A continued segment's seed is :func:`rollout_workers.partial.resume_seed` of the
request's seed and its token count (replaying the original seed would replay the random numbers its first tokens
were drawn with), and its stop strings are searched across the pause (:class:`rollout_workers.stops.StopScanner` with
the earlier tokens as ``prefix``).

Notation: P prompt tokens, R sampled tokens of a request.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

from contract.requests import TokenRequest, TokenResult
from rollout_workers.partial import resume_seed
from rollout_workers.stops import StopScanner

__all__ = ["BusyClock", "RequestQueue", "ServedRequest", "ServingThread", "check_request"]


def check_request(request: TokenRequest) -> None:
    """Raise ValueError (naming the request) for one no engine can serve: no prompt, ``max_tokens`` < 1, a negative
    temperature."""
    if not request.prompt_ids or request.max_tokens < 1 or request.temperature < 0:
        raise ValueError(f"request {request.request_id}: expected a non-empty prompt, max_tokens >= 1 and temperature "
                         f">= 0, got {len(request.prompt_ids)} prompt tokens, max_tokens={request.max_tokens}, "
                         f"temperature={request.temperature}")


@dataclass
class ServedRequest:
    """One request an engine serves, across its segments.

    Attributes:
        request: what was asked. future: resolved with the :class:`TokenResult` (or the engine's error).
        submitted: ``time.perf_counter()`` at submission. started: when its first segment started (None before).
        ids, logprobs, versions: per sampled token: the id, the behaviour logprob, the policy version.
        text: the sampled tokens' text (cut at a stop string's end). segments: engine requests it took so far.
        finish_reason, stop_reason: set when it ended (``TokenResult``'s).
    """

    request: TokenRequest
    future: Future
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    segments: int = 0
    finish_reason: str | None = None
    stop_reason: str | None = None

    @property
    def remaining(self) -> int:
        """Tokens it may still sample."""
        return self.request.max_tokens - len(self.ids)

    def next_segment(self) -> tuple[list[int], int, int | None]:
        """(prompt ids, max tokens, seed) of its next engine request (module docstring); marks it started."""
        if self.started is None:
            self.started = time.perf_counter()
        self.segments += 1
        seed = self.request.seed
        if seed is not None and self.ids:
            seed = resume_seed(seed, 0, len(self.ids))
        return list(self.request.prompt_ids) + self.ids, self.remaining, seed

    def scanner(self, decode: Callable[[list[int]], str]) -> StopScanner | None:
        """A stop-string scanner over a continued segment's tokens (None for a first segment, whose engine checks
        its stop strings itself, or without stop strings)."""
        if not self.ids or not self.request.stop:
            return None
        return StopScanner(self.request.stop, decode, self.ids)

    def add(self, ids: list[int], logprobs: list[float], version: int, text: str) -> None:
        """Append one segment's new tokens, all sampled by ``version``."""
        if len(ids) != len(logprobs):
            raise ValueError(f"request {self.request.request_id}: expected one logprob per token, got {len(ids)} "
                             f"tokens and {len(logprobs)} logprobs")
        self.ids += ids
        self.logprobs += logprobs
        self.versions += [version] * len(ids)
        self.text += text

    def finish(self, reason: str, stop_reason: str | None = None) -> None:
        """Record how it ended: ``"stop"`` (EOS or ``stop_reason``), ``"length"`` or ``"abort"``."""
        self.finish_reason, self.stop_reason = reason, stop_reason

    def result(self, engine: str, busy_s: float) -> TokenResult:
        """Its :class:`TokenResult` (after :meth:`finish`)."""
        now = time.perf_counter()
        started = self.started if self.started is not None else now
        return TokenResult(request_id=self.request.request_id, prompt_ids=tuple(self.request.prompt_ids),
                           token_ids=list(self.ids), logprobs=list(self.logprobs), token_versions=list(self.versions),
                           finish_reason=self.finish_reason or "abort", stop_reason=self.stop_reason, text=self.text,
                           queue_s=started - self.submitted, engine_s=now - started, engine=engine, busy_s=busy_s)


class RequestQueue:
    """Requests waiting for an engine's serving thread, paused ones first; and the holds that keep the thread off
    the engine (a weight sync, a ``generate`` call). Thread-safe.

    Attributes:
        cond: the condition every change notifies (the serving thread waits on it).
    """

    def __init__(self):
        self.cond = threading.Condition()
        self._waiting: deque[ServedRequest] = deque()
        self._holds = 0
        self.closed = False

    def __len__(self) -> int:
        return len(self._waiting)

    def put(self, state: ServedRequest) -> None:
        """Queue a new request (at the back)."""
        with self.cond:
            if self.closed:
                raise RuntimeError(f"request {state.request.request_id}: the engine is shut down")
            self._waiting.append(state)
            self.cond.notify_all()

    def put_front(self, states: Iterable[ServedRequest]) -> None:
        """Queue paused requests ahead of the others (in their order)."""
        with self.cond:
            self._waiting.extendleft(reversed(list(states)))
            self.cond.notify_all()

    def take(self, limit: int | None = None) -> list[ServedRequest]:
        """Up to ``limit`` waiting requests (all when None), front first."""
        with self.cond:
            count = len(self._waiting) if limit is None else min(limit, len(self._waiting))
            return [self._waiting.popleft() for _ in range(count)]

    @property
    def held(self) -> bool:
        """Whether another thread holds the engine (the serving thread must not take it)."""
        return self._holds > 0

    @contextmanager
    def hold(self):
        """Keep the serving thread off the engine for the block (it finishes its current step, or its decode batch
        stops at its next token, then waits until no hold is left)."""
        with self.cond:
            self._holds += 1
        try:
            yield
        finally:
            with self.cond:
                self._holds -= 1
                self.cond.notify_all()

    def wait_for_work(self, busy: Callable[[], bool], ready: Callable[[], bool] = lambda: True) -> bool:
        """Block until there is work for the serving thread (requests waiting, or ``busy()``: requests running), no
        hold, and ``ready()`` (the engine holds a complete policy; a hold's release re-checks it); False once
        :meth:`close` was called."""
        with self.cond:
            while not self.closed and (self._holds or not ready() or not (self._waiting or busy())):
                self.cond.wait()
            return not self.closed

    def close(self) -> list[ServedRequest]:
        """Stop serving: the thread's next wait returns False; returns the requests still waiting."""
        with self.cond:
            self.closed = True
            waiting, self._waiting = list(self._waiting), deque()
            self.cond.notify_all()
            return waiting


class ServingThread:
    """An engine's serving thread: a daemon running ``target``, started by the first request :meth:`submit` queues,
    so an engine nobody sends requests to runs none. Thread-safe.

    Args:
        target: the serving loop (it returns once ``queue`` is closed). name: the thread's name.
        queue: the engine's request queue.
    """

    def __init__(self, target: Callable[[], None], name: str, queue: RequestQueue):
        self._target = target
        self._name = name
        self._queue = queue
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, request: TokenRequest) -> Future[TokenResult]:
        """A future for ``request``: failed at once with ValueError when no engine can serve it
        (:func:`check_request`); else the thread is started (once) and the request queued.

        Raises:
            RuntimeError: the queue is closed (the engine is shut down).
        """
        future: Future[TokenResult] = Future()
        try:
            check_request(request)
        except ValueError as exc:
            future.set_exception(exc)
            return future
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._target, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put(ServedRequest(request, future))
        return future

    def join(self, timeout_s: float = 60) -> None:
        """Wait up to ``timeout_s`` seconds for the thread to end (after the queue was closed); none started: return."""
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)


class BusyClock:
    """An engine's cumulative busy seconds (``TokenResult.busy_s``): time inside :meth:`running` blocks."""

    def __init__(self):
        self._total = 0.0
        self._since: float | None = None
        self._lock = threading.Lock()

    @property
    def seconds(self) -> float:
        """Busy seconds so far, the running block's included."""
        with self._lock:
            return self._total + (time.perf_counter() - self._since if self._since is not None else 0.0)

    @contextmanager
    def running(self):
        """Count the block as busy (blocks do not nest)."""
        with self._lock:
            self._since = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self._total += time.perf_counter() - self._since
                self._since = None

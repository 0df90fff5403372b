"""Stand-in ``contract.requests.RequestServer`` s for tests and benches of the agent endpoint, before (and beside)
the fleets' own:

- :class:`ScriptedRequestServer`: returns scripted token ids (each call's next script item), optionally after a
  delay (a timer thread, so the caller's event loop is never blocked), with optional stop strings applied;
- :class:`TinyModelRequestServer`: samples with a real model in this process (``rollout_workers.hf.sampling``: the
  same distribution, seeds and logprobs as the in-process fleet), one worker thread, queued requests sampled
  together.

Both record every request they were given (``requests``) and stamp tokens with ``version``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future

from contract.requests import TokenRequest, TokenResult


def apply_stop(ids: list[int], decode: Callable[[list[int]], str], stop: Sequence[str]) -> tuple[list[int], str | None]:
    """``ids`` cut after the first token at which the decoded text contains a stop string (the stop text kept, as
    ``rollout.stop`` keeps it), and the string matched; ``(ids, None)`` when none matches."""
    if not stop:
        return ids, None
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n])
        hit = next((s for s in stop if s in text), None)
        if hit is not None:
            return ids[:n], hit
    return ids, None


class ScriptedRequestServer:
    """A RequestServer whose completions are scripted.

    Args:
        script: token-id lists, one per request in submission order, or a function ``request -> ids``. An item may
            also be an exception (the future raises it) or ``"abort"`` (finish reason abort, no tokens).
        logprob: every sampled token's behaviour logprob (or a function ``(request, position) -> float``).
        version: the policy version stamped on every token. delay_s: seconds until each future resolves.
        eos_id: the token that ends a completion with finish reason ``"stop"`` (others end at the script's end:
            ``"stop"`` too, or ``"length"`` when cut at ``max_tokens``).
        decode: decodes ids for stop strings (None: stop strings are not applied).
    """

    def __init__(self, script: Iterable | Callable[[TokenRequest], list[int]], logprob: float | Callable = -0.25,
                 version: int = 3, delay_s: float = 0.0, eos_id: int | None = None,
                 decode: Callable[[list[int]], str] | None = None):
        self.script = script if callable(script) else iter(script)
        self.logprob = logprob
        self.version = version
        self.delay_s = delay_s
        self.eos_id, self.decode = eos_id, decode
        self.requests: list[TokenRequest] = []
        self._lock = threading.Lock()

    def _next(self, request: TokenRequest):
        with self._lock:
            self.requests.append(request)
            return self.script(request) if callable(self.script) else next(self.script)

    def result(self, request: TokenRequest, item, engine_s: float) -> TokenResult:
        """The :class:`TokenResult` of ``request`` for script item ``item`` (a list of ids or ``"abort"``)."""
        if item == "abort":
            return TokenResult(request.request_id, request.prompt_ids, [], [], [], "abort", engine_s=engine_s)
        ids = list(item)[:request.max_tokens]
        ids, stop_hit = apply_stop(ids, self.decode, request.stop) if self.decode else (ids, None)
        ended = stop_hit is not None or (ids and ids[-1] == self.eos_id) or len(ids) < request.max_tokens
        lp = self.logprob
        logprobs = [lp(request, i) if callable(lp) else float(lp) for i in range(len(ids))]
        return TokenResult(request.request_id, request.prompt_ids, ids, logprobs, [self.version] * len(ids),
                           "stop" if ended else "length", stop_reason=stop_hit, engine_s=engine_s)

    def submit(self, request: TokenRequest) -> Future:
        future: Future = Future()
        item = self._next(request)
        started = time.perf_counter()

        def resolve() -> None:
            if isinstance(item, BaseException):
                future.set_exception(item)
            else:
                future.set_result(self.result(request, item, time.perf_counter() - started))

        if self.delay_s > 0:
            threading.Timer(self.delay_s, resolve).start()
        else:
            resolve()
        return future


class TinyModelRequestServer:
    """A RequestServer sampling with an HF causal LM in this process (module docstring).

    Args:
        model: the model (eval mode). tokenizer: its tokenizer (decodes for stop strings and texts).
        eos_ids: ids that end a completion. version: the policy version stamped on every token.
    """

    def __init__(self, model, tokenizer, eos_ids: frozenset[int], version: int = 0):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.version = version
        self.requests: list[TokenRequest] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="tiny-model-requests", daemon=True)
        self._thread.start()

    def submit(self, request: TokenRequest) -> Future:
        future: Future = Future()
        self.requests.append(request)
        self._queue.put((request, future, time.perf_counter()))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _work(self) -> None:
        while True:
            batch = [self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get())
            if any(item is None for item in batch):
                return
            self._sample(batch)

    def _sample(self, batch: list) -> None:
        from rollout_workers.hf.sampling import RowJob, Sampling, sample_rows

        jobs = [RowJob(r.prompt_ids, r.max_tokens, r.seed if r.seed is not None else 0,
                       Sampling(r.temperature, r.max_tokens, r.top_k, r.top_p, r.min_p)) for r, _, _ in batch]
        started = time.perf_counter()
        try:
            states = sample_rows(self.model, jobs, self.eos_ids)
        except Exception as exc:  # noqa: BLE001 - handed to every waiting caller
            for _, future, _ in batch:
                future.set_exception(exc)
            return
        engine_s = time.perf_counter() - started
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        for (request, future, submitted), state in zip(batch, states):
            ids, stop_hit = apply_stop(list(state.ids), decode, request.stop)
            finish = "stop" if stop_hit is not None else state.finish_reason
            future.set_result(TokenResult(request.request_id, request.prompt_ids, ids, state.logprobs[:len(ids)],
                                          [self.version] * len(ids), finish, stop_reason=stop_hit, text=decode(ids),
                                          queue_s=started - submitted, engine_s=engine_s))
